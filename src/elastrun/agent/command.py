"""What each worker runs: a typed command, built once by the launcher.

===========================  ==============================  ===========================
command                      runs as                         asked by
===========================  ==============================  ===========================
``PythonScript(path, args)``  ``python -u path args``        ``elastrun train.py``
``PythonModule(name, args)``  ``python -u -m name args``     ``elastrun -m pkg.train``
``Executable(argv)``          ``argv`` as given              ``--no-python``; ``--run-path``
                                                             (a ``python -u -c`` stub); a
                                                             program given to ``launch()``
===========================  ==============================  ===========================

A Python command (script or module) runs through elastrun's worker runner
(``worker/_runner.py``): ``python -u .../_runner.py path args`` (or ``-m name
args``), which runs the target exactly as ``python -u`` would and observes it
from inside (the modules it imported, its progress, its stacks); only a
Python command may be forked from a warm interpreter (agent/warm.py). An
``Executable`` runs as given.

In a worker's arguments, ``${local_rank}`` is replaced by that worker's local
rank (torchrun's macro; ``python -m elastrun.launch`` passes
``--local_rank=${local_rank}``). Only that exact text is replaced (torch's
``string.Template`` would also turn ``$$`` into ``$`` and replace
``$local_rank``).

The command is never recovered from an argv's shape: every part of the agent
(spawning, warm starts, the module cache's key) reads these fields.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import field
from typing import ClassVar

from elastrun.frozen import frozen

__all__ = [
    "LOCAL_RANK_MACRO",
    "RUNNER_SCRIPT",
    "Executable",
    "PythonCommand",
    "PythonModule",
    "PythonScript",
    "WorkerCommand",
    "with_local_rank",
]

LOCAL_RANK_MACRO = "${local_rank}"
RUNNER_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "_runner.py"
)
UNBUFFERED = "-u"  # as torchrun: every Python worker's output unbuffered


def with_local_rank(args: Sequence[str], local_rank: int | None) -> tuple[str, ...]:
    """``args`` with each ``${local_rank}`` replaced (as given for None)."""
    if local_rank is None:
        return tuple(args)
    return tuple(a.replace(LOCAL_RANK_MACRO, str(local_rank)) for a in args)


def _python() -> str:
    return sys.executable


class _Python:
    """What a script and a module command share: the interpreter, its
    arguments, and the runner in front."""

    kind: ClassVar[str]
    python: str
    args: tuple[str, ...]

    @property
    def target(self) -> str:
        raise NotImplementedError

    @property
    def entry(self) -> tuple[str, ...]:
        """What follows the interpreter's flags: ``path`` or ``-m name``."""
        raise NotImplementedError

    @property
    def program(self) -> str:
        return self.python

    def command_line(self, local_rank: int | None = None) -> tuple[str, ...]:
        """The command line as ``torchrun`` would run it."""
        return (self.python, UNBUFFERED, *self.entry, *with_local_rank(self.args, local_rank))

    def worker_argv(self, local_rank: int | None) -> tuple[str, ...]:
        """What the agent runs: the same, through the worker runner (for
        ``None``, the arguments as given: what a warm interpreter starts with)."""
        args = with_local_rank(self.args, local_rank)
        return (self.python, UNBUFFERED, RUNNER_SCRIPT, *self.entry, *args)


@frozen
class PythonScript(_Python):
    """``python -u path args``."""

    kind: ClassVar[str] = "script"
    path: str
    args: tuple[str, ...] = ()
    python: str = field(default_factory=_python)

    @property
    def target(self) -> str:
        return self.path

    @property
    def entry(self) -> tuple[str, ...]:
        return (self.path,)


@frozen
class PythonModule(_Python):
    """``python -u -m name args``."""

    kind: ClassVar[str] = "module"
    name: str
    args: tuple[str, ...] = ()
    python: str = field(default_factory=_python)
    # The source file that says what the workers import, when it is not the
    # module's own (``launch(fn)``: the function's module, which the runner
    # imports); read, never imported, for the warm interpreter's choices.
    source: str | None = None

    @property
    def target(self) -> str:
        return self.name

    @property
    def entry(self) -> tuple[str, ...]:
        return ("-m", self.name)


@frozen
class Executable:
    """A program run as given (``${local_rank}`` replaced in every part)."""

    argv: tuple[str, ...]

    @property
    def program(self) -> str:
        return self.argv[0] if self.argv else "<empty command>"

    def command_line(self, local_rank: int | None = None) -> tuple[str, ...]:
        return with_local_rank(self.argv, local_rank)

    def worker_argv(self, local_rank: int | None) -> tuple[str, ...]:
        return self.command_line(local_rank)


PythonCommand = PythonScript | PythonModule
WorkerCommand = PythonScript | PythonModule | Executable
