"""A warm interpreter (zygote) is started only when some start can use it
(agent/warm_pool.py): real zygotes that import a small package, no torch."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent import PythonScript, WorkerSpec
from elastrun.agent.warm_pool import WarmPool
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.procs import pid_alive
from elastrun.rendezvous.notes import ModuleReport
from tests.conftest import PYTHON
from tests.zygote_forks import fork_many

BOUND = 60.0


def _rank_reader(tmp_path: Path) -> PythonScript:
    """A script importing a package that reads RANK when imported (as
    Lightning does): the shared zygote refuses it, per-rank ones import it."""
    (tmp_path / "rankpkg").mkdir()
    (tmp_path / "rankpkg" / "__init__.py").write_text("import os\nAT = os.environ.get('RANK')\n")
    (tmp_path / "s.py").write_text(
        "import sys, email.mime.text\nbefore = 'rankpkg' in sys.modules\nimport rankpkg\n"
        "print('BEFORE', before, 'READ', rankpkg.AT, flush=True)\n"
    )
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


async def _until(done: Any, sink: ListSink) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    assert done(), sink.events


@pytest.mark.parametrize("last", [True, False], ids=["last-start", "a-start-may-follow"])
def test_after_the_last_start_a_zygote_that_quits_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last: bool
) -> None:
    """A start forks its worker from the shared zygote; then the zygote quits
    (it refused a package the workers reported, which reads RANK: the per-rank
    zygotes' from now on). When a start may follow, a shared one and one for
    the rank are started for it; after a start no other can follow (restarts
    used up, no elastic range), none is: each would be discarded unused."""
    monkeypatch.chdir(tmp_path)
    command = _rank_reader(tmp_path)
    spec = WorkerSpec(command=command, nproc=1, run_id=RunId("warm-needed"))
    sink = ListSink()
    env = _env()

    async def main() -> dict[int, str]:
        pool = WarmPool(spec, command, sink, preload=("email.mime.text",), scope="all")
        try:
            pool.keep_ranks({0: env})  # the round before: rank 0's variables
            pool.keep(env)
            assert await pool.wait_ready(BOUND), sink.events
            out = await fork_many(pool, {0: env}, last=last)
            assert pool.learn(ModuleReport(("rankpkg",)), "worker")
            await _until(lambda: "rankpkg" in pool.recorded.ranked, sink)
            return out
        finally:
            await pool.close()

    out = asyncio.run(main())
    assert "BEFORE False READ 0" in out[0]  # warm, the package imported by the worker
    started = [e["local_rank"] for e in _kinds(sink, "warm_started")]
    assert started == ([None] if last else [None, 0, None]), sink.events


def test_a_single_node_job_keeps_no_shared_zygote_beside_one_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node: every round gives a local rank the same rank variables, so
    once each local rank has its own zygote no start would fork from the
    shared one: it is not replaced when it refuses the package, nor kept after
    a start. The next start forks each rank from its own, even one still
    importing (the head start the shared one would have been), and the
    package read the worker's own rank. Should a rank's own zygote die, the
    shared one is started again: that rank's next start is still warm."""
    monkeypatch.chdir(tmp_path)
    command = _rank_reader(tmp_path)
    spec = WorkerSpec(command=command, nproc=2, run_id=RunId("warm-needed"))
    sink = ListSink()
    envs = {lr: _env(RANK=str(lr), LOCAL_RANK=str(lr), WORLD_SIZE="2") for lr in (0, 1)}

    async def main() -> list[dict[int, str]]:
        pool = WarmPool(spec, command, sink, preload=("rankpkg",), scope="all")
        pool.fixed_ranks = True
        try:
            pool.keep_all(envs)  # after the first start: nothing known per rank yet
            await _until(lambda: len(_kinds(sink, "warm_started")) >= 3, sink)
            # The shared one refused the package: one per rank instead, no new shared one.
            assert [e["local_rank"] for e in _kinds(sink, "warm_started")] == [None, 0, 1]
            pool.keep_all(envs)  # another start, the same ranks: nothing new
            assert len(_kinds(sink, "warm_started")) == 3, sink.events
            first = await fork_many(pool, envs)
            (rank_1,) = [e["pid"] for e in _kinds(sink, "warm_started") if e["local_rank"] == 1]
            os.kill(rank_1, signal.SIGKILL)
            await _until(lambda: not pid_alive(rank_1), sink)
            pool.on_child()  # the agent's SIGCHLD handler
            assert [e["local_rank"] for e in _kinds(sink, "warm_started")] == [None, 0, 1, None]
            return [first, await fork_many(pool, envs)]
        finally:
            await pool.close()

    first, again = asyncio.run(main())
    used = [(u["local_rank"], u["per_rank"]) for u in _kinds(sink, "warm_used")]
    # The ranks' own zygotes fork together: their events come in either order.
    assert sorted(used[:2]) == [(0, True), (1, True)], used
    assert used[2:] == [
        (0, True),
        (1, False),  # from the shared one, which imports no rankpkg: the worker does
    ], used
    assert "BEFORE True READ 0" in first[0] and "BEFORE True READ 1" in first[1], first
    assert "BEFORE True READ 0" in again[0] and "BEFORE False READ 1" in again[1], again


def test_a_shared_zygote_serves_until_every_ranks_own_is_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node, the package known to read RANK (the module cache said so):
    the shared zygote, without it, forks the first start; the per-rank ones
    are started after it, and the shared one is kept until they are all
    ready (a restart before then forks from it, not from them still
    importing), then let go."""
    monkeypatch.chdir(tmp_path)
    command = _rank_reader(tmp_path)
    spec = WorkerSpec(command=command, nproc=2, run_id=RunId("warm-needed"))
    sink = ListSink()
    envs = {lr: _env(RANK=str(lr), LOCAL_RANK=str(lr), WORLD_SIZE="2") for lr in (0, 1)}

    def reasons() -> list[tuple[int | None, str]]:
        return [(e["local_rank"], e["reason"]) for e in _kinds(sink, "warm_discarded")]

    async def main() -> None:
        pool = WarmPool(spec, command, sink, preload=("rankpkg",), scope="all")
        pool.fixed_ranks = True
        pool.recorded.ranked["rankpkg"] = "rankpkg reads RANK when it is imported"
        try:
            pool.keep(envs[0])  # at the agent's start
            assert await pool.wait_ready(BOUND), sink.events
            await fork_many(pool, envs)
            pool.keep_all(envs)  # after the first start
            assert [e["local_rank"] for e in _kinds(sink, "warm_started")] == [None, 0, 1]
            assert reasons() == []  # they are importing: the shared one stays
            await _until(lambda: reasons() != [], sink)
            assert reasons() == [(None, "every local rank has its own")]
            ready = {e["local_rank"] for e in _kinds(sink, "warm_ready")}
            assert ready == {None, 0, 1}, sink.events
        finally:
            await pool.close()

    asyncio.run(main())
