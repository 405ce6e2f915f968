"""``elastrun [flags] script [script args...]``: torchrun's command line.

The flags are read by :mod:`elastrun.launcher.flags` and resolved into a
:class:`~elastrun.launcher.plan.Plan` by :func:`elastrun.launcher.plan.resolve`;
this module runs it. Programmatic use::

    from elastrun.launcher.cli import main
    exit_code = main(["--standalone", "--nproc-per-node=2", "train.py"])
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from elastrun.errors import ConfigError, ElastrunError
from elastrun.launcher.command import Command, worker_command
from elastrun.launcher.flags import parse_flags, resolve_flags
from elastrun.launcher.plan import Plan

__all__ = ["execute", "main", "parse", "usage_error"]

USAGE = "elastrun [flags] script [script args...]"


def parse(argv: Sequence[str]) -> tuple[Plan, Command]:
    """Flags -> (Plan, Command). Raises ConfigError naming the flag."""
    flags = parse_flags(argv)
    return resolve_flags(flags, worker_command(flags.command)), flags.command


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``elastrun [flags] script [args]``; returns the exit code (2: bad flags)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        plan, _ = parse(args)
    except ConfigError as exc:
        return usage_error(exc)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    return execute(plan)


def usage_error(exc: ConfigError, usage: str = USAGE) -> int:
    """Report a bad flag (before anything started); returns 2."""
    sys.stderr.write(f"usage: {usage} (see --help)\n")
    sys.stderr.write(f"elastrun: error: {exc}\n")
    return 2


def execute(plan: Plan) -> int:
    """Run a parsed launch; returns the exit code."""
    from elastrun.launcher.run import run_plan

    try:
        return run_plan(plan)
    except ConfigError as exc:
        sys.stderr.write(f"elastrun: error: {exc}\n")
        return 2
    except ElastrunError as exc:
        sys.stderr.write(f"elastrun: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("elastrun: interrupted\n")
        return 130
