"""What each worker runs: the script, module or program of the command line
(:class:`Command`) and, typed, what the agent runs for it
(:func:`worker_command`: an :mod:`elastrun.agent.command` value), as torchrun
builds it."""

from __future__ import annotations

import os
import shutil
import sys

from elastrun.agent.command import Executable, PythonModule, PythonScript, WorkerCommand
from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.worker import _settle

__all__ = ["RUN_PATH_CODE", "Command", "check_command", "worker_argv", "worker_command"]

# --run-path: run the script with runpy in a fresh interpreter (torchrun's run_script_path),
# inside worker/_settle.py's after_success (loaded by path: any Python 3 interpreter), which
# shuts torch.distributed down before exit when the script succeeded and left it up.
RUN_PATH_CODE = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    from importlib.util import module_from_spec, spec_from_file_location\n"
    f"    _spec = spec_from_file_location('_elastrun_settle', {_settle.__file__!r})\n"
    "    _mod = module_from_spec(_spec)\n"
    "    _spec.loader.exec_module(_mod)\n"
    "    _guard = _mod.after_success()\n"
    "except Exception:\n"
    "    import contextlib\n"
    "    _guard = contextlib.nullcontext()\n"
    "with _guard:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@frozen
class Command:
    """What each worker runs."""

    script: str
    args: tuple[str, ...]
    module: bool = False
    no_python: bool = False
    run_path: bool = False


def worker_command(cmd: Command) -> WorkerCommand:
    """What each worker runs, typed, as torchrun builds it."""
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if cmd.run_path:
        script = os.path.abspath(cmd.script)
        return Executable((python, "-u", "-c", RUN_PATH_CODE, script, *cmd.args))
    if cmd.no_python:
        return Executable((cmd.script, *cmd.args))
    if cmd.module:
        return PythonModule(cmd.script, cmd.args, python=python)
    return PythonScript(cmd.script, cmd.args, python=python)


def worker_argv(cmd: Command) -> tuple[str, ...]:
    """The full argv of a worker, as torchrun builds it."""
    return worker_command(cmd).command_line()


def check_command(cmd: Command) -> None:
    """The script file or program exists (a module is found by the worker's
    Python); ``--no-python`` and ``-m`` are not combined."""
    if cmd.module and cmd.no_python and not cmd.run_path:
        raise ConfigError("--no-python: cannot be combined with -m/--module")
    if cmd.module and not cmd.run_path:
        return
    if cmd.no_python and not cmd.run_path:
        found = os.path.isfile(cmd.script) if os.sep in cmd.script else shutil.which(cmd.script)
        if not found:
            raise ConfigError(f"script: program {cmd.script!r} not found")
        return
    if not os.path.isfile(cmd.script):
        raise ConfigError(
            f"script: file {cmd.script!r} not found (run a module with -m, a program with "
            "--no-python)"
        )
