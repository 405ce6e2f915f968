"""Which worker commands get warm interpreters, and when a warm interpreter may fork a worker."""

from __future__ import annotations

import sys

from elastrun.agent.command import (
    RUNNER_SCRIPT,
    Executable,
    PythonModule,
    PythonScript,
)
from elastrun.agent.spawn import entry_file, imports_any
from elastrun.agent.warm_pool import LOCAL_VARS, ROUND_VARS, compatible
from elastrun.launcher.command import RUN_PATH_CODE, Command, worker_argv, worker_command


def test_the_launcher_types_script_and_module_commands():
    cmd = Command(script="train.py", args=("--lr", "1"))
    assert worker_command(cmd) == PythonScript("train.py", ("--lr", "1"), python=sys.executable)
    assert worker_argv(cmd) == (sys.executable, "-u", "train.py", "--lr", "1")
    cmd = Command(script="pkg.train", args=("x",), module=True)
    assert worker_command(cmd) == PythonModule("pkg.train", ("x",), python=sys.executable)
    assert worker_argv(cmd) == (sys.executable, "-u", "-m", "pkg.train", "x")


def test_run_path_and_programs_are_run_as_given():
    # No warm interpreter, no runner: what they run is not a script elastrun knows.
    run_path = worker_command(Command(script="t.py", args=(), run_path=True))
    assert isinstance(run_path, Executable) and RUN_PATH_CODE in run_path.argv
    assert run_path.worker_argv(0) == run_path.argv
    program = worker_command(Command(script="./prog", args=("a",), no_python=True))
    assert program == Executable(("./prog", "a"))
    assert program.worker_argv(3) == ("./prog", "a")


def test_only_round_variables_may_differ():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "MASTER_PORT": "1"}
    assert compatible(base, {**base, "RANK": "3", "MASTER_PORT": "2"}) is None
    assert compatible(base, {**base, "OMP_NUM_THREADS": "4"}) == "OMP_NUM_THREADS"
    assert compatible(base, {**base, "NEW": "x"}) == "NEW"
    missing = dict(base)
    del missing["PATH"]
    assert compatible(base, missing) == "PATH"
    # One warm interpreter forks every local rank's worker.
    assert "LOCAL_RANK" in LOCAL_VARS and "LOCAL_RANK" not in ROUND_VARS
    assert compatible(base, {**base, "LOCAL_RANK": "3"}) is None
    # The per-worker files and the stack signal a hang watchdog adds.
    hang = {**base, "ELASTRUN_HEARTBEAT_FILE": "/l/0/heartbeat.json"}
    hang |= {"ELASTRUN_STACKS_FILE": "/l/0/stacks.txt", "ELASTRUN_STACK_SIGNAL": "39"}
    assert compatible(base, hang) is None


def test_python_workers_run_through_the_runner():
    script = PythonScript("train.py", ("--lr", "1", "--rank=${local_rank}"), python="py")
    assert script.worker_argv(2) == ("py", "-u", RUNNER_SCRIPT, "train.py", "--lr", "1", "--rank=2")
    # What a warm interpreter starts with: the arguments as given (each fork
    # order brings its rank's).
    assert script.worker_argv(None)[-1] == "--rank=${local_rank}"
    module = PythonModule("pkg.train", ("x",), python="py")
    assert module.worker_argv(0) == ("py", "-u", RUNNER_SCRIPT, "-m", "pkg.train", "x")
    assert Executable(("./prog", "--r=${local_rank}")).worker_argv(1) == ("./prog", "--r=1")


def test_whether_the_worker_imports_the_preloaded_modules(tmp_path):
    def src(text: str) -> str:
        path = tmp_path / "s.py"
        path.write_text(text)
        return str(path)

    assert imports_any(src("import torch\n"), ["torch"])
    assert imports_any(src("import os, torch.distributed as dist\n"), ["torch"])
    assert imports_any(src("def main():\n    from torch import nn\n"), ["torch"])
    assert not imports_any(src("import torchvision\nfrom . import torch\n"), ["torch"])
    assert not imports_any(src("print('torch')\n"), ["torch"])
    assert not imports_any(src("import torch(\n"), ["torch"])  # not Python: no
    assert not imports_any(str(tmp_path / "missing.py"), ["torch"])
    assert not imports_any(None, ["torch"])


def test_the_file_a_module_entry_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg" / "app").mkdir(parents=True)
    (tmp_path / "pkg" / "train.py").write_text("")
    (tmp_path / "pkg" / "app" / "__main__.py").write_text("")
    assert entry_file(PythonModule("pkg.train")) == str(tmp_path / "pkg" / "train.py")
    assert entry_file(PythonModule("pkg.app")) == str(tmp_path / "pkg" / "app" / "__main__.py")
    assert entry_file(PythonModule("json.tool")) is None
    assert entry_file(PythonScript("t.py")) == "t.py"
