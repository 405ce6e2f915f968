"""A warm interpreter (zygote) is started only when some start can use it
(agent/warm_pool.py): real zygotes that import a small package, no torch."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent import PythonScript, WorkerSpec
from elastrun.agent.warm_pool import WarmPool
from elastrun.events import ListSink
from elastrun.names import RunId
from tests.conftest import PYTHON

BOUND = 60.0


def _rank_reader(tmp_path: Path) -> PythonScript:
    """A script importing a package that reads RANK when imported (as
    Lightning does): the shared zygote refuses it, per-rank ones import it."""
    (tmp_path / "rankpkg").mkdir()
    (tmp_path / "rankpkg" / "__init__.py").write_text("")
    (tmp_path / "rankpkg" / "reader.py").write_text("import os\nAT = os.environ.get('RANK')\n")
    (tmp_path / "s.py").write_text("import rankpkg.reader\n")
    return PythonScript(str(tmp_path / "s.py"), python=PYTHON)


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ELASTRUN_") and k != "PYTORCH_NVML_BASED_CUDA_CHECK"
    }
    return {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", **extra}


def _kinds(sink: ListSink, kind: str) -> list[dict[str, Any]]:
    return [e for e in sink.events if e["kind"] == kind]


@pytest.mark.parametrize("last", [True, False], ids=["last-start", "a-start-may-follow"])
def test_a_zygote_that_quits_during_the_last_start_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last: bool
) -> None:
    """The shared zygote quits while a start forks from it (it refused a
    package that reads RANK: the per-rank zygotes' from now on). When a start
    may follow, a shared one and one for the rank are started for it; when
    none can (restarts used up, no elastic range), none is: each would be
    discarded unused a moment later. The start itself is cold either way."""
    monkeypatch.chdir(tmp_path)
    command = _rank_reader(tmp_path)
    spec = WorkerSpec(command=command, nproc=1, run_id=RunId("warm-needed"))
    sink = ListSink()
    env = _env()

    async def main() -> dict[int, Any]:
        pool = WarmPool(spec, command, sink, preload=("rankpkg.reader",), scope="all")
        try:
            pool.keep_ranks({0: env})  # the round before: rank 0's variables
            pool.keep(env)
            ours, theirs = socket.socketpair()
            try:
                forked = await pool.fork({0: env}, {0: theirs.fileno()}, last=last)
            finally:
                ours.close()
                theirs.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + BOUND
            while "rankpkg" not in pool.recorded.ranked and loop.time() < deadline:
                await asyncio.sleep(0.02)
            assert "rankpkg" in pool.recorded.ranked, sink.events
            return dict(forked)
        finally:
            await pool.close()

    forked = asyncio.run(main())
    assert forked == {}  # the zygote quit: this start is cold
    started = [e["local_rank"] for e in _kinds(sink, "warm_started")]
    assert started == ([None] if last else [None, 0, None]), sink.events
