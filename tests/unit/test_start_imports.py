"""What an agent and a worker import before they start work: nothing that
their common path does not use (each start pays for every module it imports;
a test suite starts hundreds). One fresh interpreter each."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "src" / "elastrun" / "worker" / "_runner.py"

# An agent that joins a store hosted elsewhere: the launcher, its flags parsed,
# the agent, the dynamic rendezvous and the embedded store's client.
AGENT = """
import json, sys
from elastrun.launcher.cli import parse
import elastrun.agent.agent, elastrun.launcher.run, elastrun.rendezvous.dynamic
import elastrun.store.client
parse(["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", sys.argv[1]])
print(json.dumps(sorted(sys.modules)))
"""

NOT_AT_AGENT_START = {
    "importlib.metadata",  # --version's lookup, only when given
    "statistics",  # the stragglers' median, when there are step times
    "elastrun.store.memory",  # tests' in-process store
    "elastrun.store.engine",  # the store's engine: only where it is hosted
    "elastrun.store.server",
    "elastrun.store.failover",  # candidate hosts only
}

NOT_AT_WORKER_START = {
    "statistics",  # the progress recorder's median, from the first step
    "_elastrun_master",  # torch.distributed's store, when the script imports it
}


def test_an_agent_imports_nothing_its_common_path_does_not_use(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    out = subprocess.run(
        [sys.executable, "-c", AGENT, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        check=True,
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "elastrun.agent.agent" in loaded
    assert loaded & NOT_AT_AGENT_START == set()


def test_a_worker_imports_nothing_its_common_path_does_not_use(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import json, sys\nprint(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run(
        [sys.executable, "-u", str(RUNNER), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        check=True,
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "_elastrun_messages" in loaded  # the runner ran the script
    assert loaded & NOT_AT_WORKER_START == set()


def test_the_processes_a_test_starts_load_elastrun_compiled() -> None:
    """Each module of src/ has its bytecode cached (tests/conftest.py compiles
    them once per session): the agents, workers and stores the tests start do
    not compile them from source, PYTHONDONTWRITEBYTECODE set or not."""
    stale = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        cached = Path(importlib.util.cache_from_source(str(path)))
        if not cached.exists() or cached.stat().st_mtime < path.stat().st_mtime:
            stale.append(str(path.relative_to(ROOT)))
    assert stale == []
