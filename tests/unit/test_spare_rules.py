"""Which worker commands get warm spares, and when a spare may become a worker."""

from __future__ import annotations

from elastrun.agent.spares import ROUND_VARS, PythonEntry, compatible, python_entry
from elastrun.launcher.cli import RUN_PATH_CODE, Command, worker_argv


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
    assert "LOCAL_RANK" not in ROUND_VARS  # a spare belongs to one local rank
