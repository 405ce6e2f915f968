"""Which worker commands get warm spares, and when a spare may become a worker."""

from __future__ import annotations

from elastrun.agent.spares import LOCAL_VARS, ROUND_VARS, compatible
from elastrun.agent.spawn import (
    RUNNER_SCRIPT,
    PythonEntry,
    entry_file,
    imports_any,
    python_entry,
    runner_argv,
)
from elastrun.launcher.command import RUN_PATH_CODE, Command, worker_argv


def test_script_and_module_commands_split():
    argv = worker_argv(Command(script="train.py", args=("--lr", "1")))
    assert python_entry(argv) == PythonEntry((argv[0], "-u"), "script", "train.py", ("--lr", "1"))
    argv = worker_argv(Command(script="pkg.train", args=("x",), module=True))
    assert python_entry(argv) == PythonEntry((argv[0], "-u"), "module", "pkg.train", ("x",))


def test_run_path_and_odd_shapes_get_no_spare():
    assert python_entry(("python", "-u", "-c", RUN_PATH_CODE, "t.py")) is None
    assert python_entry(("python", "-u", "-m")) is None
    assert python_entry(("python", "t.py")) is None
    assert python_entry(("./prog",)) is None


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
    argv = worker_argv(Command(script="train.py", args=("--lr", "1")))
    assert runner_argv(argv) == (argv[0], "-u", RUNNER_SCRIPT, "train.py", "--lr", "1")
    argv = worker_argv(Command(script="pkg.train", args=("x",), module=True))
    assert runner_argv(argv) == (argv[0], "-u", RUNNER_SCRIPT, "-m", "pkg.train", "x")
    assert runner_argv(("./prog", "a")) == ("./prog", "a")
    run_path = worker_argv(Command(script="t.py", args=(), run_path=True))
    assert runner_argv(run_path) == run_path


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
    assert entry_file(PythonEntry(("py", "-u"), "module", "pkg.train", ())) == str(
        tmp_path / "pkg" / "train.py"
    )
    assert entry_file(PythonEntry(("py", "-u"), "module", "pkg.app", ())) == str(
        tmp_path / "pkg" / "app" / "__main__.py"
    )
    assert entry_file(PythonEntry(("py", "-u"), "module", "json.tool", ())) is None
    assert entry_file(PythonEntry(("py", "-u"), "script", "t.py", ())) == "t.py"
