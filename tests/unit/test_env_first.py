"""A script that sets its environment before it imports what a warm
interpreter imports (agent/env_first.py, agent/warm_pool.py)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from elastrun.agent import PythonScript, WorkerSpec
from elastrun.agent.env_first import env_set_first
from elastrun.agent.warm_pool import WarmPool
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.rendezvous.notes import ModuleReport
from tests.conftest import PYTHON


@pytest.mark.parametrize(
    ("source", "variable", "line"),
    [
        ("import os\nos.environ['OMP_NUM_THREADS'] = '4'\nimport torch\n", "OMP_NUM_THREADS", 2),
        (
            "import os\nos.environ.setdefault('TORCH_LOGS', '+dynamo')\nimport torch.nn\n",
            "TORCH_LOGS",
            2,
        ),
        (
            "from os import environ\nenviron.update(TORCH_LOGS='x')\nfrom torch import nn\n",
            "TORCH_LOGS",
            2,
        ),
        ("import os\nos.putenv('A', 'b')\nimport torch\n", "A", 2),
        ("import os\ndef main():\n    os.environ[key()] = '1'\n    import torch\n", "?", 3),
    ],
)
def test_a_write_before_the_import_is_found(tmp_path, source, variable, line):
    path = tmp_path / "s.py"
    path.write_text(source)
    got = env_set_first(str(path), ["torch"])
    assert got is not None and (got.variable, got.line) == (variable, line)
    assert f"sets {variable} (line {line}) before it imports torch" in got.describe()


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nimport os\nos.environ['OMP_NUM_THREADS'] = '4'\n",
        "import os\nprint(os.environ.get('OMP_NUM_THREADS'))\nimport torch\n",
        "import os\nos.environ['X'] = '1'\nimport numpy\n",
        "this is not python(\n",
    ],
)
def test_reads_writes_after_and_other_modules_are_not(tmp_path, source):
    path = tmp_path / "s.py"
    path.write_text(source)
    assert env_set_first(str(path), ["torch"]) is None
    assert env_set_first(None, ["torch"]) is None


def _pool(tmp_path, source: str) -> tuple[WarmPool, ListSink, list[str]]:
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(source))
    command = PythonScript(str(script), python=PYTHON)
    spec = WorkerSpec(command=command, nproc=1, run_id=RunId("env-first"))
    sink, said = ListSink(), list[str]()
    return WarmPool(spec, command, sink, say=said.append), sink, said


def test_such_a_script_starts_cold_with_one_line(tmp_path):
    source = "import os\nos.environ['OMP_NUM_THREADS'] = '3'\nimport torch\n"
    pool, sink, said = _pool(tmp_path, source)
    pool.say_cold()
    pool.keep({"OMP_NUM_THREADS": "1"})
    assert pool.pids == []  # no zygote is even started
    assert asyncio.run(pool.fork({0: {}}, {0: -1})) == {}
    (line,) = said
    assert "sets OMP_NUM_THREADS (line 2) before it imports torch" in line
    assert "start cold" in line
    assert [e["kind"] for e in sink.events] == ["warm_failed"]


def test_a_learned_module_imported_after_a_write_turns_warm_starts_off(tmp_path):
    pool, _, said = _pool(tmp_path, "import torch, os\nos.environ['X'] = '1'\nimport mylib\n")
    before = pool.cold
    pool.learn(ModuleReport(("mylib",), "3.11.7", None), "test")
    cold = pool.cold
    assert before is None and cold is not None
    assert cold.module == "mylib"
    assert len(said) == 1 and "sets X (line 2) before it imports mylib" in said[0]
