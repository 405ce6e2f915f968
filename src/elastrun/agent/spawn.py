"""How a worker starts: the parent-death signal, its stdin, and what the
agent can tell of a Python command's source without importing it.

What the agent runs for each kind of command: agent/command.py.

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

from elastrun.agent.command import PythonCommand, PythonScript

__all__ = ["entry_file", "imports_any", "launcher_stdin", "preexec_for"]

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


def entry_file(command: PythonCommand) -> str | None:
    """The source file the worker runs first: the script, or for ``-m`` the
    module's file under the working directory (None when not found there; the
    agent never imports user code to find it), or the file the command names
    as its source (``PythonModule.source``)."""
    if isinstance(command, PythonScript):
        return command.path
    if command.source is not None:
        return command.source
    base = os.path.join(os.getcwd(), *command.name.split("."))
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
