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
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.warm_pool import DEVICE_VARS, LOCAL_VARS, ROUND_VARS, compatible, local_vars
from elastrun.agent.warm_ranks import RANK_VARS, rank_part, same_ranks
from elastrun.launcher.command import RUN_PATH_CODE, Command, worker_argv, worker_command
from elastrun.names import RunId


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
    # torch's file timer: a pipe per local rank (TORCHELASTIC_ENABLE_FILE_TIMER=1).
    timer = {**base, "TORCHELASTIC_TIMER_FILE": "/t/timer.fifo.0"}
    assert compatible(timer, {**timer, "TORCHELASTIC_TIMER_FILE": "/t/timer.fifo.1"}) is None


def test_virtual_local_rank_makes_the_device_a_local_rank_variable():
    spec = WorkerSpec(command=Executable(("python", "x.py")), nproc=2, run_id=RunId("j"))
    assert local_vars(spec) == LOCAL_VARS
    virtual = WorkerSpec(
        command=Executable(("python", "x.py")), nproc=2, run_id=RunId("j"), virtual_local_rank=True
    )
    assert local_vars(virtual) == LOCAL_VARS | DEVICE_VARS
    assert local_vars(virtual) == {
        "LOCAL_RANK",
        "ELASTRUN_LOCAL_MAIN",
        "TORCHELASTIC_TIMER_FILE",
        "CUDA_VISIBLE_DEVICES",
    }
    base = {"PATH": "/bin", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "5"}
    rank1 = {**base, "CUDA_VISIBLE_DEVICES": "7"}
    # Without the flag the device list is the node's, and must be the same.
    assert compatible(base, rank1) == "CUDA_VISIBLE_DEVICES"
    assert compatible(base, rank1, local_vars(virtual)) is None
    assert compatible(base, {**rank1, "PATH": "/x"}, local_vars(virtual)) == "PATH"
    assert not DEVICE_VARS & ROUND_VARS


def test_a_per_rank_interpreter_needs_the_same_ranks_and_nothing_of_the_round():
    started = {"PATH": "/bin", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    started |= {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3"}
    started |= {"ROLE_WORLD_SIZE": "4"}
    # Another round of the same job: new port, restart count, error file.
    again = {**started, "MASTER_PORT": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert same_ranks(started, again) is None and compatible(started, again) is None
    # The membership changed: another rank, or the same rank in a bigger world.
    assert same_ranks(started, {**started, "RANK": "1"}) == "RANK"
    assert same_ranks(started, {**started, "WORLD_SIZE": "6"}) == "WORLD_SIZE"
    assert same_ranks(started, {**started, "GROUP_RANK": "0"}) == "GROUP_RANK"
    # What it is started with: the ranks only, never the round's address or port.
    assert rank_part({**again, "MASTER_ADDR": "h"}) == {k: started[k] for k in RANK_VARS}
    assert not RANK_VARS & {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"}
    assert RANK_VARS <= ROUND_VARS | LOCAL_VARS


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


def test_a_function_launched_names_its_module_as_the_source_of_its_imports(tmp_path, monkeypatch):
    """launch(fn): the workers run the function runner, which imports the
    function's module: that module's imports give the warm interpreter its
    head start (without it, each worker imported torch itself, cold)."""
    import importlib

    from elastrun.launcher.api import FN_RUNNER, _source

    (tmp_path / "fnmod.py").write_text("import torch\n\ndef work():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fnmod = importlib.import_module("fnmod")
    source = _source(fnmod.work)
    assert source == str(tmp_path / "fnmod.py")
    command = PythonModule(FN_RUNNER, ("spec.json",), source=source)
    assert entry_file(command) == source
    assert imports_any(entry_file(command), ["torch"])
    assert not imports_any(entry_file(PythonModule(FN_RUNNER, ("spec.json",))), ["torch"])
    assert _source(len) is None  # a builtin: no file to read
    # Two functions' workers import different modules: their lists are kept apart.
    from elastrun.agent.modcache import cache_key

    other = PythonModule(FN_RUNNER, ("spec.json",), source=str(tmp_path / "other.py"))
    assert cache_key(command, str(tmp_path)) != cache_key(other, str(tmp_path))
