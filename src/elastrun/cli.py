"""The ``elastrun`` command: dispatch to a subcommand or to the launcher.

``elastrun store ...``, ``elastrun status ...``, ``elastrun timeline ...``,
``elastrun checkpoint-convert ...`` (torch, imported only then) are
subcommands; anything else is a torchrun-compatible launch (``elastrun [flags]
script [args]``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]


def _store(argv: list[str]) -> int:
    from elastrun.store.cli import main as store_main

    return store_main(argv)


def _status(argv: list[str]) -> int:
    from elastrun.status.cli import main as status_main

    return status_main(argv)


def _timeline(argv: list[str]) -> int:
    from elastrun.status.timeline import main as timeline_main

    return timeline_main(argv)


def _checkpoint_convert(argv: list[str]) -> int:
    from elastrun.train.convert import main as convert_main

    return convert_main(argv)


def _launch(argv: list[str]) -> int:
    from elastrun.launcher.cli import main as launch_main

    return launch_main(argv)


SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "store": _store,
    "status": _status,
    "timeline": _timeline,
    "checkpoint-convert": _checkpoint_convert,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]](args[1:])
    return _launch(args)
