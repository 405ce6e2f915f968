"""Where the training helpers' lines go: ``log``, a callable the script may
pass (``print`` by default; None: quiet), and the one way they say a line."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Log", "say"]

Log = Callable[[str], None] | None


def say(log: Log, line: str) -> None:
    """Say ``line`` through ``log`` (nothing when it is None)."""
    if log is not None:
        log(line)
