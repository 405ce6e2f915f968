"""How a worker command is started: the parent-death signal, and the Python
commands that run through elastrun's worker runner.

The launcher builds a Python worker's argv as ``python -u script args`` or
``python -u -m module args`` (:func:`python_entry` recognises both). Such a
worker runs as ``python -u .../elastrun/worker/_runner.py script args``
(:func:`runner_argv`): the runner runs the script exactly as ``python -u``
would and reports what the worker imported (see ``worker/_runner.py``). Other
commands (``--no-python``, ``--run-path``) run as given.

Every worker's stdin is the agent's own (:func:`launcher_stdin`), as torchrun
gives it: one open file shared by every worker (whoever reads first gets the
data), or ``/dev/null`` when the agent has none.
"""

from __future__ import annotations

import ast
import ctypes
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "RUNNER_SCRIPT",
    "PythonEntry",
    "entry_file",
    "imports_any",
    "launcher_stdin",
    "preexec_for",
    "python_entry",
    "runner_argv",
]

RUNNER_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "_runner.py"
)
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Resolved once, in the parent: the child after fork only calls it.
PRCTL = _load_prctl()


def launcher_stdin() -> int | None:
    """The agent's stdin (fd 0) for its workers, or None when it has none
    (closed): the workers then get ``/dev/null``."""
    try:
        os.fstat(0)
    except OSError:
        return None
    return 0


def preexec_for(parent_pid: int) -> Callable[[], None]:
    """The ``preexec_fn`` of a child that must die with ``parent_pid``."""
    prctl = PRCTL

    def child() -> None:  # runs in the forked child, before exec
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        # The agent may have died between fork and prctl: then nobody would kill us.
        if os.getppid() != parent_pid:
            os._exit(137)

    return child


@dataclass(frozen=True)
class PythonEntry:
    """A worker argv split as ``prefix + [target] + args`` (script) or
    ``prefix + ["-m", target] + args`` (module)."""

    prefix: tuple[str, ...]
    kind: str  # "script" | "module"
    target: str
    args: tuple[str, ...]

    @property
    def command(self) -> list[str]:
        """What follows the interpreter and its flags: ``[-m] target``."""
        return ["-m", self.target] if self.kind == "module" else [self.target]


def python_entry(argv: Sequence[str]) -> PythonEntry | None:
    """The launcher's Python argv shapes: ``python -u [-m] target args``."""
    if len(argv) < 3 or argv[1] != "-u":
        return None
    if argv[2] == "-m":
        if len(argv) < 4:
            return None
        return PythonEntry(tuple(argv[:2]), "module", argv[3], tuple(argv[4:]))
    if argv[2].startswith("-"):
        return None
    return PythonEntry(tuple(argv[:2]), "script", argv[2], tuple(argv[3:]))


def runner_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` with the worker runner in front, for the Python shapes; as
    given otherwise."""
    entry = python_entry(argv)
    if entry is None:
        return tuple(argv)
    return (*entry.prefix, RUNNER_SCRIPT, *entry.command, *entry.args)


def entry_file(entry: PythonEntry) -> str | None:
    """The source file the worker runs first: the script, or for ``-m`` the
    module's file under the working directory (None when not found there; the
    agent never imports user code to find it)."""
    if entry.kind == "script":
        return entry.target
    base = os.path.join(os.getcwd(), *entry.target.split("."))
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return None


def imports_any(path: str | None, modules: Sequence[str]) -> bool:
    """Whether the Python source at ``path`` imports one of ``modules`` (or a
    submodule) anywhere in it; False when it cannot be read or parsed."""
    if path is None or not modules:
        return False
    try:
        with open(path, "rb") as fp:
            tree = ast.parse(fp.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    roots = set(modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] in roots for name in names):
            return True
    return False
