"""The warm interpreter on its own (agent/warm.py, worker/_zygote.py): what it
imports ahead of time, what it refuses, how it is bounded, and the module
cache that survives the run (agent/modcache.py).

Real zygote processes, real forks, real files; no agent (the agent-level
behaviour is in test_warm_starts.py and test_warm_join.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import textwrap
from pathlib import Path
from typing import Any

from elastrun.agent import PythonScript, WorkerSpec
from elastrun.agent.modcache import ModuleCache, ModuleList, cache_key
from elastrun.agent.warm_pool import WarmPool
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.rendezvous.notes import ModuleReport
from tests.conftest import PYTHON
from tests.helpers import pid_alive
from tests.zygote_forks import GO, fork_many

# Prints which of the modules named in PROBE_MODULES were loaded before the
# script itself imported anything, then imports them (as a script would).
SCRIPT = textwrap.dedent(
    """
    import os, sys
    names = [n for n in os.environ.get("PROBE_MODULES", "").split(",") if n]
    before = sorted(n for n in names if n in sys.modules)
    import importlib
    for n in names:
        with __import__("contextlib").suppress(ImportError):
            importlib.import_module(n)
    print("BEFORE", ",".join(before), "RANK", os.environ.get("RANK"), flush=True)
    """
)


# A module that starts a thread when imported: not safe in the zygote.
THREADER = (
    "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
)


def _pool(
    tmp_path: Path,
    *,
    preload: tuple[str, ...] = ("email.mime.text",),
    script_text: str = SCRIPT,
    cache: bool = True,
    sink: ListSink | None = None,
    **kw: Any,
) -> tuple[WarmPool, ListSink]:
    script = tmp_path / "s.py"
    script.write_text(script_text)
    command = PythonScript(str(script), python=PYTHON)
    spec = WorkerSpec(command=command, nproc=1, run_id=RunId("zygote-test"))
    sink = sink or ListSink()
    mc = None
    if cache:
        key = cache_key(command, str(tmp_path))
        mc = ModuleCache(str(tmp_path / "cache"), key)
    return WarmPool(spec, command, sink, preload=preload, cache=mc, **kw), sink


def _env(**extra: str) -> dict[str, str]:
    # Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK in the process that imports
    # it (another test, in this test process): not a worker's.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ELASTRUN_") and k != "PYTORCH_NVML_BASED_CUDA_CHECK"
    }
    env.update({"RANK": "0", **extra})
    return env


async def _fork_one(pool: WarmPool, env: dict[str, str]) -> tuple[int, str] | None:
    """Fork one worker with ``env``; its exit code and output (None: not forked)."""
    ours, theirs = socket.socketpair()
    try:
        forked = await pool.fork({0: env}, {0: theirs.fileno()})
    finally:
        theirs.close()
    if not forked:
        ours.close()
        return None
    proc = forked[0]
    ours.send(GO)
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    out = await loop.run_in_executor(None, proc.stdout.read)
    rc = await loop.run_in_executor(None, proc.wait, 60)
    ours.close()
    return rc, out.decode()


def _kinds(sink: ListSink, kind: str) -> list[dict[str, Any]]:
    return [e for e in sink.events if e["kind"] == kind]


def test_more_workers_than_cpus_wait_for_a_zygote_importing_what_they_import(tmp_path):
    # The zygote's preload takes 3 s; the script imports the same module; two
    # workers on one CPU: the start waits for the whole import (one import
    # beats two fighting for the CPU), and both find it loaded.
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(3)\n")
    (tmp_path / "later.py").write_text("X = 1\n")
    env = _env(PROBE_MODULES="slowmod,later")
    script = SCRIPT + "import slowmod  # the script imports it itself (after the check)\n"

    async def main() -> dict[int, str]:
        pool, _ = _pool(tmp_path, preload=("slowmod", "later"), scope="all", script_text=script)
        assert pool.head_start
        pool.keep(env)
        try:
            return await fork_many(pool, {0: {**env, "RANK": "5"}, 1: {**env, "RANK": "6"}})
        finally:
            await pool.close()

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        out = asyncio.run(main())
    finally:
        os.sched_setaffinity(0, cpus)
    # Both were forked once the zygote had imported slowmod (3 s) and later:
    # the start waited for it.
    assert "BEFORE later,slowmod RANK 5" in out[0] and "BEFORE later,slowmod RANK 6" in out[1]


def test_with_cpus_to_spare_a_start_forks_between_two_imports(tmp_path):
    # One worker: it is forked as soon as the zygote has its base module
    # (slowa stands for torch) and is between two of the script's recorded
    # ones (slowb), and imports the rest itself.
    (tmp_path / "slowa.py").write_text("import time\ntime.sleep(2)\n")
    (tmp_path / "slowb.py").write_text("import time\ntime.sleep(20)\n")
    env = _env(PROBE_MODULES="slowa,slowb")
    script = SCRIPT.replace("importlib.import_module(n)", "pass") + "import slowa\n"

    async def main() -> tuple[int, str] | None:
        pool, _ = _pool(tmp_path, preload=("slowa",), scope="all", script_text=script)
        assert pool.cache is not None
        pool.cache.save(ModuleList(modules=["slowb"]))
        pool.recorded = pool.cache.load()
        pool.keep(env)
        await asyncio.sleep(0.5)  # the zygote is importing slowa
        try:
            return await _fork_one(pool, env)
        finally:
            await pool.close()

    got = asyncio.run(main())
    # Forked with slowa loaded and slowb not (yet): it did not wait for slowb.
    assert got is not None and got[0] == 0 and "BEFORE slowa RANK 0" in got[1], got


def test_a_zygote_importing_is_kept_for_a_script_that_does_not_need_it(tmp_path):
    # An import of an hour: a start that waited for it (or for READY_WAIT,
    # a minute) would end the bounded wait below.
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(3600)\n")

    async def main() -> None:
        pool, sink = _pool(
            tmp_path, preload=("slowmod",), script_text="print('no slowmod here')\n", cache=False
        )
        assert pool.head_start is False
        pool.keep(_env())
        (pid,) = pool.pids
        try:
            # the worker starts cold, without waiting for the zygote
            assert await asyncio.wait_for(_fork_one(pool, _env()), 30.0) is None
            assert pool.pids == [pid] and pid_alive(pid)  # kept for a later start
        finally:
            await pool.close()
        assert not pid_alive(pid)
        assert not _kinds(sink, "warm_used") and not _kinds(sink, "warm_discarded")

    asyncio.run(main())


def test_a_zygote_started_with_another_environment_is_not_used(tmp_path):
    async def main() -> None:
        pool, sink = _pool(tmp_path, preload=(), cache=False)
        env = _env(OMP_NUM_THREADS="1")
        pool.keep(env)
        (pid,) = pool.pids
        try:
            assert await _fork_one(pool, {**env, "OMP_NUM_THREADS": "8"}) is None
        finally:
            await pool.close()
        (gone,) = _kinds(sink, "warm_discarded")
        assert gone["reason"] == "started with a different OMP_NUM_THREADS"
        assert not pid_alive(pid)

    asyncio.run(main())


def test_learned_modules_are_imported_and_kept_for_the_next_run(tmp_path):
    # A worker reports the modules it imported; the zygote imports the new
    # ones before it counts as ready again, and the list is written to the
    # cache, where the next run's zygote finds it from its start.
    names = ["email.mime.text", "xml.dom.minidom", "wave"]
    env = _env(PROBE_MODULES=",".join(names))

    async def first() -> str:
        pool, sink = _pool(tmp_path, preload=())
        pool.keep(env)
        try:
            assert await pool.wait_ready(60)
            assert pool.learn(ModuleReport(tuple(names)), "optimizer_step")
            assert not pool.ready  # importing the new ones
            assert await pool.wait_ready(60)
            got = await _fork_one(pool, env)
        finally:
            await pool.close()
        (recorded,) = _kinds(sink, "modules_recorded")
        assert recorded["new"] == 3 and recorded["cache"]
        assert _kinds(sink, "warm_ready")[-1]["loaded"] == 3
        assert got is not None and got[0] == 0
        return got[1]

    out = asyncio.run(first())
    assert "BEFORE email.mime.text,wave,xml.dom.minidom" in out, out
    (cached,) = (tmp_path / "cache").glob("modules-*.json")
    assert json.loads(cached.read_text())["modules"] == names
    assert oct(os.stat(tmp_path / "cache").st_mode & 0o777) == "0o700"

    async def second() -> None:
        pool, sink = _pool(tmp_path, preload=())
        assert pool.head_start  # its list was recorded: the script imports them
        pool.keep(env)
        try:
            assert await pool.wait_ready(60)
        finally:
            await pool.close()
        (started,) = _kinds(sink, "warm_started")
        assert started["modules"] == 3
        assert _kinds(sink, "warm_ready")[0]["loaded"] == 3

    asyncio.run(second())


def test_a_module_that_fails_to_import_is_skipped_and_named(tmp_path):
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "fine.py").write_text("X = 1\n")
    env = _env(PROBE_MODULES="fine")

    async def main() -> tuple[int, str] | None:
        pool, sink = _pool(
            tmp_path, preload=("boom", "no_such_module_xyz", "fine"), scope="all", cache=False
        )
        pool.keep(env)
        try:
            assert await pool.wait_ready(60)
            (ready,) = _kinds(sink, "warm_ready")
            assert ready["failed"] == ["boom", "no_such_module_xyz"]
            assert ready["loaded"] == 1
            return await _fork_one(pool, env)
        finally:
            await pool.close()

    got = asyncio.run(main())
    assert got is not None and got[0] == 0 and "BEFORE fine" in got[1]


async def _preloaded(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    """The ``warm_ready`` event of a zygote (no cache) once its preload is done."""
    pool, sink = _pool(tmp_path, cache=False, **kw)
    pool.keep(_env())
    try:
        assert await pool.wait_ready(60)
    finally:
        await pool.close()
    (ready,) = _kinds(sink, "warm_ready")
    return ready


def test_the_zygote_itself_refuses_entry_points_the_script_and_modules_that_act(tmp_path):
    # The second line of defence: names handed to the warm interpreter without
    # the agent's check. unittest.__main__ would run the tests named on its
    # command line (the script, s.py); s is the script itself; this and
    # __hello__ print when imported. Even with every module in scope.
    ran = tmp_path / "RAN"
    script = f"open({str(ran)!r}, 'a').write('ran\\n')\n"

    preload = ("unittest.__main__", "this", "__hello__", "s", "s.x", "wave")
    ready = asyncio.run(_preloaded(tmp_path, preload=preload, script_text=script, scope="all"))
    assert ready["failed"] == ["unittest.__main__", "this", "__hello__", "s", "s.x"]
    assert ready["loaded"] == 1
    assert not ran.exists()


def test_only_installed_modules_are_imported_unless_asked(tmp_path):
    # The script's own folder is on sys.path, but its modules (which may run
    # code at import) are not imported ahead of time by default.
    (tmp_path / "mine.py").write_text("open('IMPORTED', 'w').close()\n")

    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        ready = asyncio.run(_preloaded(tmp_path, preload=("mine", "wave")))
    finally:
        os.chdir(old)
    assert ready["failed"] == ["mine"] and ready["loaded"] == 1
    assert not (tmp_path / "IMPORTED").exists()


def test_a_module_that_starts_a_thread_is_dropped_and_remembered(tmp_path):
    # Forking copies one thread: a module that starts a thread at import is
    # not safe in the zygote. It is refused, remembered in the cache, and a
    # new zygote without it takes over.
    (tmp_path / "threader.py").write_text(THREADER)
    env = _env(PROBE_MODULES="email.mime.text")

    async def main() -> tuple[int, str] | None:
        pool, sink = _pool(tmp_path, preload=("threader", "email.mime.text"), scope="all")
        pool.keep(env)
        try:
            for _ in range(200):  # the first zygote refuses threader and a second starts
                if len(_kinds(sink, "warm_started")) == 2:
                    break
                await asyncio.sleep(0.05)
            assert await pool.wait_ready(60)
            (gone,) = _kinds(sink, "warm_discarded")
            assert "threader" in gone["reason"] and "thread" in gone["reason"]
            return await _fork_one(pool, env)
        finally:
            await pool.close()

    got = asyncio.run(main())
    assert got is not None and got[0] == 0 and "BEFORE email.mime.text" in got[1]
    (cached,) = (tmp_path / "cache").glob("modules-*.json")
    assert "threader" in json.loads(cached.read_text())["skip"]


def _skipped(tmp_path: Path) -> dict[str, str]:
    (cached,) = (tmp_path / "cache").glob("modules-*.json")
    skip: dict[str, str] = json.loads(cached.read_text())["skip"]
    return skip


def test_a_refusal_sent_while_the_agent_was_busy_is_read_before_the_start(tmp_path):
    # The zygote refuses a module and exits while the agent runs without
    # reading it (a round start in progress, its event loop not yet back to
    # the socket). The start that finds it ended reads the refusal first: the
    # module is remembered, a zygote without it takes over, and the workers
    # start cold at once. Before, the zygote was let go as "exited before it
    # was needed" and the refusal was lost: the next zygote refused again.
    (tmp_path / "threader.py").write_text(THREADER)
    env = _env()

    async def main() -> tuple[tuple[int, str] | None, dict[str, Any], int]:
        pool, sink = _pool(tmp_path, preload=("threader", "email.mime.text"), scope="all")
        pool.keep(env)
        try:
            first = pool._z
            assert first is not None
            assert first.popen.wait(60) == 4  # blocks the loop: nothing is read meanwhile
            got = await _fork_one(pool, env)
            (gone,) = _kinds(sink, "warm_discarded")
            return got, gone, len(_kinds(sink, "warm_started"))
        finally:
            await pool.close()

    got, gone, started = asyncio.run(main())
    assert "threader" in gone["reason"] and "thread" in gone["reason"], gone
    assert "threader" in _skipped(tmp_path)
    assert started == 2  # another zygote, without it
    assert got is None  # cold, at once


def _held_import(folder: Path) -> str:
    """The head of a module whose import writes ``folder/importing``, then
    waits (at most 60 s) until ``folder/go`` exists: a test holds it there."""
    return (
        "import pathlib, time\n"
        f"(pathlib.Path({str(folder)!r}) / 'importing').touch()\n"
        "for _ in range(6000):\n"
        f"    if (pathlib.Path({str(folder)!r}) / 'go').exists():\n"
        "        break\n"
        "    time.sleep(0.01)\n"
    )


async def _importing(folder: Path) -> None:
    """Until the zygote is inside a ``_held_import`` module (at most 60 s)."""
    for _ in range(600):
        if (folder / "importing").exists():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the zygote never started the held import")


async def _order_to_a_refusing_zygote(
    tmp_path: Path, module: str, *, unread: bool
) -> tuple[Any, list[dict[str, Any]]]:
    """A fork order to a zygote that imports ``module`` and refuses it: sent
    once it quit, or (``unread``) while it imports the module, the order left
    unread when it quits (the module waits for ``go`` once it wrote
    ``importing``). The event loop reads nothing until the zygote exited.
    What the order returned (or the OSError it raised), and the discards."""
    env = _env()
    pool, sink = _pool(tmp_path, preload=(module,), scope="all")
    pool.keep(env)
    ours, theirs = socket.socketpair()
    try:
        z = pool._z
        assert z is not None
        pending = None
        if unread:
            await _importing(tmp_path)
            pending = asyncio.ensure_future(
                z.fork_workers({0: (env, ("s.py",), theirs.fileno())}, None)
            )
            await asyncio.sleep(0)  # the order is in the zygote's socket
            (tmp_path / "go").touch()
        assert z.popen.wait(60) == 4  # blocks the loop: nothing is read meanwhile
        try:
            got: Any = await (
                pending or z.fork_workers({0: (env, ("s.py",), theirs.fileno())}, None)
            )
        except OSError as e:
            got = repr(e)
        return got, _kinds(sink, "warm_discarded")
    finally:
        ours.close()
        theirs.close()
        await pool.close()


def test_a_refusal_sent_before_a_fork_order_is_read_when_the_order_fails(tmp_path):
    # The zygote exits (its refusal sent) after the agent found it usable and
    # before its fork order went out: the order cannot be sent, and what the
    # zygote sent before it exited is read then, not dropped with it.
    (tmp_path / "threader.py").write_text(THREADER)
    failed, gone = asyncio.run(_order_to_a_refusing_zygote(tmp_path, "threader", unread=False))
    assert "BrokenPipe" in failed or "ConnectionReset" in failed, failed
    assert len(gone) == 1 and "threader is not safe" in gone[0]["reason"], gone
    assert "thread" in gone[0]["reason"], gone
    assert "threader" in _skipped(tmp_path)


def test_a_refusal_sent_with_a_fork_order_unread_is_read_not_taken_for_a_reset(tmp_path):
    # The fork order reaches the zygote while it imports a module that turns
    # out unsafe: it refuses and exits with the order still unread in its
    # socket. Linux then reports a reset to the agent before the refusal that
    # is still queued; the refusal is read (the module remembered), not lost
    # with the zygote as "exited before it was needed".
    (tmp_path / "late_threader.py").write_text(_held_import(tmp_path) + THREADER)
    forked, gone = asyncio.run(_order_to_a_refusing_zygote(tmp_path, "late_threader", unread=True))
    assert forked == {}  # nothing forked: the start is cold
    assert gone and "late_threader is not safe" in gone[0]["reason"], gone
    assert "late_threader" in _skipped(tmp_path)


def test_a_refusal_of_a_per_rank_zygote_is_read_before_the_start(tmp_path):
    # The same for a local rank's own zygote: the start that finds it ended
    # reads its refusal (the module is skipped from then on) instead of
    # letting it go as "exited before it was needed".
    pkg = tmp_path / "rankpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "reader.py").write_text(THREADER)
    command_cache = ModuleCache(
        str(tmp_path / "cache"),
        cache_key(PythonScript(str(tmp_path / "s.py"), python=PYTHON), str(tmp_path)),
    )
    assert command_cache.save(
        ModuleList(modules=["rankpkg.reader"], ranked={"rankpkg": "reads RANK"})
    )
    env = _env(RANK="7")

    async def main() -> tuple[tuple[int, str] | None, dict[str, Any]]:
        pool, sink = _pool(tmp_path, preload=(), scope="all")
        pool.keep_ranks({0: env})
        try:
            rz = pool.ranks.by_rank[0]
            assert rz.popen.wait(60) == 4  # blocks the loop: nothing is read meanwhile
            got = await _fork_one(pool, env)
            (gone,) = [e for e in _kinds(sink, "warm_discarded") if e["local_rank"] == 0]
            return got, gone
        finally:
            await pool.close()

    got, gone = asyncio.run(main())
    assert got is None or got[0] == 0, got  # cold, or from its replacement (a head start)
    assert "rankpkg.reader" in gone["reason"] and "thread" in gone["reason"], gone
    assert "rankpkg.reader" in _skipped(tmp_path)


def test_the_preload_is_bounded_in_time(tmp_path):
    for i in range(4):
        (tmp_path / f"slow{i}.py").write_text("import time\ntime.sleep(1)\n")

    async def main() -> dict[str, Any]:
        pool, sink = _pool(
            tmp_path,
            preload=tuple(f"slow{i}" for i in range(4)),
            scope="all",
            cache=False,
            budget=1.5,
        )
        pool.keep(_env())
        try:
            assert await pool.wait_ready(60)
        finally:
            await pool.close()
        return _kinds(sink, "warm_ready")[0]

    ready = asyncio.run(main())
    assert ready["stopped"] == "time budget of 1.5 s spent"
    assert 1 <= ready["loaded"] <= 3
    assert ready["rss_mb"] > 0


def test_a_forked_worker_runs_only_after_the_go(tmp_path):
    # A worker the agent never registered (no "go": the agent died or gave up)
    # exits without running the script.
    marker = tmp_path / "RAN"
    script = f"open({str(marker)!r}, 'w').close()\n"

    async def main() -> int:
        pool, _ = _pool(tmp_path, preload=(), script_text=script, cache=False)
        pool.keep(_env())
        ours, theirs = socket.socketpair()
        try:
            assert await pool.wait_ready(60)
            forked = await pool.fork({0: _env()}, {0: theirs.fileno()})
            theirs.close()
            ours.close()  # never "go"
            return await asyncio.get_running_loop().run_in_executor(None, forked[0].wait, 30)
        finally:
            with contextlib.suppress(OSError):
                theirs.close()
            await pool.close()

    assert asyncio.run(main()) == 71
    assert not marker.exists()


def _rank_package(tmp_path: Path, reads: str) -> str:
    """A package whose module reads ``reads`` when imported; the script that
    prints whether it was loaded before the script ran, and what it read."""
    pkg = tmp_path / "rankpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "reader.py").write_text(f"import os\nAT_IMPORT = os.environ.get({reads!r})\n")
    return (
        "import os, sys\n"
        "before = 'rankpkg.reader' in sys.modules\n"
        "import rankpkg.reader\n"
        "print('BEFORE', before, 'READ', rankpkg.reader.AT_IMPORT,"
        f" 'NOW', os.environ.get({reads!r}), flush=True)\n"
    )


async def _events_until(sink: ListSink, kind: str, count: int, bound: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while len(_kinds(sink, kind)) < count and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert len(_kinds(sink, kind)) >= count, sink.events


def test_a_module_that_reads_a_rank_variable_is_imported_per_rank(tmp_path):
    # The shared zygote has no RANK; a module that reads it when imported
    # would keep the zygote's answer in every worker. It is refused there (with
    # its package), remembered as per-rank, and a worker forked from the shared
    # zygote imports it itself. Once a start gave local rank 0 RANK=7, a
    # per-rank zygote started with RANK=7 imports it: a restart with RANK=7
    # forks from it (imported, with 7); one with RANK=3 discards it and forks
    # from the shared zygote (the module imported by the worker, with 3).
    script = _rank_package(tmp_path, "RANK")

    async def main() -> list[tuple[int, str] | None]:
        pool, sink = _pool(
            tmp_path, preload=("rankpkg.reader", "email.mime.text"), scope="all", script_text=script
        )
        pool.keep(_env())
        try:
            await _events_until(sink, "warm_started", 2)
            assert await pool.wait_ready(60)
            (gone,) = _kinds(sink, "warm_discarded")
            assert "rankpkg.reader reads RANK when it is imported" in gone["reason"]
            assert "per-rank" in gone["reason"]
            got = [await _fork_one(pool, _env(RANK="7"))]
            pool.keep_ranks({0: _env(RANK="7")})
            await _events_until(sink, "warm_ready", 2)
            (ranked,) = [e for e in _kinds(sink, "warm_ready") if e["local_rank"] == 0]
            assert ranked["failed"] == [] and ranked["loaded"] >= 2
            got.append(await _fork_one(pool, _env(RANK="7", MASTER_PORT="1234")))
            got.append(await _fork_one(pool, _env(RANK="3")))
            used = _kinds(sink, "warm_used")
            assert [u["per_rank"] for u in used] == [False, True, False]
            (changed,) = [e for e in _kinds(sink, "warm_discarded") if e["local_rank"] == 0]
            assert changed["reason"] == "started with a different RANK"
            return got
        finally:
            await pool.close()

    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = asyncio.run(main())
    finally:
        os.chdir(old)
    outs = [g[1] for g in got if g is not None and g[0] == 0]
    assert len(outs) == 3, got
    assert "BEFORE False READ 7 NOW 7" in outs[0]
    assert "BEFORE True READ 7 NOW 7" in outs[1]  # per rank: imported ahead, with its rank
    assert "BEFORE False READ 3 NOW 3" in outs[2]
    (cached,) = (tmp_path / "cache").glob("modules-*.json")
    saved = json.loads(cached.read_text())
    assert "rankpkg" in saved["ranked"] and "rankpkg" not in saved["skip"]


def test_virtual_local_rank_forks_each_rank_with_its_device(tmp_path):
    # --virtual-local-rank: every worker is LOCAL_RANK=0 with its own
    # CUDA_VISIBLE_DEVICES. One shared zygote (started without the variable)
    # forks both ranks, each with its device. A module that reads the variable
    # when imported is refused there, like a rank variable, and imported by
    # the per-rank zygotes, each started with its rank's device.
    script = _rank_package(tmp_path, "CUDA_VISIBLE_DEVICES")
    (tmp_path / "s.py").write_text(script)
    command = PythonScript(str(tmp_path / "s.py"), python=PYTHON)
    spec = WorkerSpec(command=command, nproc=2, run_id=RunId("vlr"), virtual_local_rank=True)
    sink = ListSink()
    cache = ModuleCache(str(tmp_path / "cache"), cache_key(command, str(tmp_path)))
    envs = {
        lr: _env(RANK=str(lr), LOCAL_RANK="0", CUDA_VISIBLE_DEVICES=device)
        for lr, device in ((0, "5"), (1, "7"))
    }

    async def main() -> list[dict[int, str]]:
        pool = WarmPool(
            spec,
            command,
            sink,
            preload=("rankpkg.reader", "email.mime.text"),
            cache=cache,
            scope="all",
        )
        pool.keep(envs[0])
        try:
            await _events_until(sink, "warm_started", 2)
            assert await pool.wait_ready(60)
            (gone,) = _kinds(sink, "warm_discarded")
            assert "reads CUDA_VISIBLE_DEVICES when it is imported" in gone["reason"]
            assert "per-rank" in gone["reason"]
            first = await fork_many(pool, envs)
            pool.keep_ranks(envs)
            await _events_until(sink, "warm_ready", 3)
            again = await fork_many(pool, envs)
            used = _kinds(sink, "warm_used")
            assert [u["per_rank"] for u in used] == [False, False, True, True], used
            # No zygote was let go for a device that differs between ranks.
            assert len(_kinds(sink, "warm_discarded")) == 1, _kinds(sink, "warm_discarded")
            return [first, again]
        finally:
            await pool.close()

    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        first, again = asyncio.run(main())
    finally:
        os.chdir(old)
    assert "BEFORE False READ 5 NOW 5" in first[0] and "BEFORE False READ 7 NOW 7" in first[1]
    assert "BEFORE True READ 5 NOW 5" in again[0] and "BEFORE True READ 7 NOW 7" in again[1]


def test_a_module_that_reads_a_round_variable_is_not_preloaded_even_per_rank(tmp_path):
    # The module reads RANK, then MASTER_PORT, which changes every round: no
    # per-rank zygote can hold what it read. Left to the per-rank zygotes by
    # the shared one, refused by the per-rank one too, and skipped from then
    # on: the worker imports it, with its port.
    script = _rank_package(tmp_path, "MASTER_PORT")
    reader = tmp_path / "rankpkg" / "reader.py"
    reader.write_text("import os\nRANK = os.environ.get('RANK')\n" + reader.read_text())

    async def main() -> tuple[int, str] | None:
        pool, sink = _pool(
            tmp_path, preload=("rankpkg.reader", "email.mime.text"), scope="all", script_text=script
        )
        pool.keep(_env())
        try:
            await _events_until(sink, "warm_started", 2)
            assert await pool.wait_ready(60)
            assert pool.recorded.ranked.keys() == {"rankpkg"}
            pool.keep_ranks({0: _env(RANK="0", MASTER_PORT="1")})
            await _events_until(sink, "warm_discarded", 2)
            (refused,) = [e for e in _kinds(sink, "warm_discarded") if e["local_rank"] == 0]
            assert "reads MASTER_PORT when it is imported" in refused["reason"]
            assert pool.recorded.skip.keys() == {"rankpkg"} and not pool.recorded.ranked
            assert not pool.ranks.by_rank  # nothing needs a rank's variables any more
            return await _fork_one(pool, _env(MASTER_PORT="2"))
        finally:
            await pool.close()

    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = asyncio.run(main())
    finally:
        os.chdir(old)
    assert got is not None and got[0] == 0 and "BEFORE False READ 2 NOW 2" in got[1], got


def test_a_restart_does_not_wait_for_the_rest_of_an_import_that_read_a_rank(tmp_path, monkeypatch):
    # The first run of a Lightning script: its workers report what they
    # imported, the zygote imports it while they train, and a restart comes
    # while it is inside the long import that reads LOCAL_RANK (Lightning's:
    # seconds, its rank read in the first 2%). The zygote quits at the read,
    # not after the import: the restart starts cold at once, instead of
    # waiting for an import whose zygote could only refuse (before, it waited
    # for all of it, up to the 30 s fork timeout, to start cold anyway). The
    # next zygote, without the package, forks warm.
    script = "import email.mime.text\n" + _rank_package(tmp_path, "LOCAL_RANK")
    reader = tmp_path / "rankpkg" / "reader.py"
    marks = {m: tmp_path / m for m in ("go", "imported")}
    reader.write_text(
        _held_import(tmp_path)  # until the restart came
        + reader.read_text()
        + "if AT_IMPORT is None:  # the zygote: the rest of a long import\n"
        "    time.sleep(3600)\n"
        f"    pathlib.Path({str(marks['imported'])!r}).touch()\n"
    )

    async def main() -> tuple[tuple[int, str] | None, tuple[int, str] | None, ListSink]:
        pool, sink = _pool(
            tmp_path,
            preload=("email.mime.text",),
            scope="all",
            script_text=script,
            import_timeout=0,
        )
        pool.keep(_env())
        try:
            assert await pool.wait_ready(60)
            assert pool.learn(ModuleReport(("rankpkg.reader",)), "optimizer_step")
            await _importing(tmp_path)
            restart = asyncio.ensure_future(_fork_one(pool, _env(LOCAL_RANK="0")))
            await asyncio.sleep(0)  # its fork order sent
            marks["go"].touch()
            cold = await restart
            (gone,) = _kinds(sink, "warm_discarded")
            assert "rankpkg.reader reads LOCAL_RANK when it is imported" in gone["reason"], gone
            assert await pool.wait_ready(60)
            return cold, await _fork_one(pool, _env(LOCAL_RANK="0")), sink
        finally:
            await pool.close()

    monkeypatch.chdir(tmp_path)
    cold, warm, sink = asyncio.run(main())
    assert cold is None and not marks["imported"].exists()  # started cold, import cut short
    assert warm is not None and "BEFORE False READ 0 NOW 0" in warm[1], warm
    assert [u["per_rank"] for u in _kinds(sink, "warm_used")] == [False]


def test_a_restart_forks_every_rank_from_its_own_zygote_at_once(tmp_path, monkeypatch):
    # A job of one node, on the script's first run: the shared zygote refused
    # the package that reads the rank, per-rank zygotes started for the round
    # that ran, and the restart comes while they are inside an import (each
    # forks once it is done). Every rank's order is sent at once: each rank's
    # zygote, inside the import, sees its order come, and the other rank's
    # too (before, the second rank's order waited for the first rank's fork,
    # which waited for its import: waits added up, one per local rank).
    _rank_package(tmp_path, "RANK")
    seen = {d: tmp_path / d for d in ("importing", "orders")}
    for d in seen.values():
        d.mkdir()
    (tmp_path / "rankpkg" / "both.py").write_text(
        "import os, pathlib, select, time\n"
        "rank = os.environ['RANK']\n"
        f"pathlib.Path({str(seen['importing'])!r}, rank).touch()\n"
        "select.select([0], [], [], 60)  # its fork order came (the zygote's socket)\n"
        f"orders = pathlib.Path({str(seen['orders'])!r})\n"
        "(orders / rank).touch()\n"
        "for _ in range(2000):  # the other rank's came too (at most 20 s: within the fork's 30)\n"
        "    if len(list(orders.iterdir())) == 2:\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "BOTH = len(list(orders.iterdir())) == 2\n"
    )
    script = (
        "import email.mime.text, sys\n"
        "print('BOTH', getattr(sys.modules.get('rankpkg.both'), 'BOTH', None), flush=True)\n"
    )
    envs = {lr: _env(RANK=str(lr), LOCAL_RANK=str(lr)) for lr in (0, 1)}

    async def main() -> tuple[dict[int, str], ListSink]:
        pool, sink = _pool(tmp_path, preload=("email.mime.text",), scope="all", script_text=script)
        pool.fixed_ranks = True
        pool.keep_all(envs)  # after the first round's start
        try:
            assert await pool.wait_ready(60)
            # The workers report what they imported; the shared zygote refuses it.
            assert pool.learn(ModuleReport(("rankpkg.reader", "rankpkg.both")), "optimizer_step")
            await _events_until(sink, "warm_started", 3)  # then one per rank
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while len(list(seen["importing"].iterdir())) < 2 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert pool._z is None and len(list(seen["importing"].iterdir())) == 2, sink.events
            return await fork_many(pool, envs), sink
        finally:
            await pool.close()

    monkeypatch.chdir(tmp_path)
    out, sink = asyncio.run(main())
    assert "BOTH True" in out[0] and "BOTH True" in out[1], out
    assert [u["per_rank"] for u in _kinds(sink, "warm_used")] == [True, True]


def test_a_module_that_initialises_cuda_is_not_preloaded(tmp_path):
    # The warm interpreter must leave the GPU free. This machine has no GPU, so
    # the module only marks torch.cuda initialised as CUDA initialisation
    # would: the zygote must refuse it all the same and go on without it.
    (tmp_path / "cudainit.py").write_text("import torch.cuda\ntorch.cuda._initialized = True\n")
    env = _env(PROBE_MODULES="email.mime.text")

    async def main() -> tuple[int, str] | None:
        pool, sink = _pool(tmp_path, preload=("torch", "cudainit", "email.mime.text"), scope="all")
        pool.keep(env)
        try:
            for _ in range(400):
                if len(_kinds(sink, "warm_started")) == 2:
                    break
                await asyncio.sleep(0.05)
            assert await pool.wait_ready(120)
            (gone,) = _kinds(sink, "warm_discarded")
            assert "cudainit" in gone["reason"] and "CUDA" in gone["reason"]
            return await _fork_one(pool, env)
        finally:
            await pool.close()

    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = asyncio.run(main())
    finally:
        os.chdir(old)
    assert got is not None and got[0] == 0 and "BEFORE email.mime.text" in got[1], got


def test_the_zygote_leaves_cuda_to_the_workers(tmp_path):
    # torch imported ahead of time: the forked worker finds CUDA not
    # initialised and the driver not loaded (the zygote's state at the fork),
    # and may ask torch about CUDA itself, as a script on a GPU machine does.
    script = (
        "import sys\n"
        "before = 'torch' in sys.modules\n"
        "import torch\n"
        "initialised = torch.cuda.is_initialized()\n"
        "driver = b'/libcuda.so' in open('/proc/self/maps', 'rb').read()\n"
        "available = torch.cuda.is_available()\n"
        "print('BEFORE', before, 'INITIALISED', initialised, 'DRIVER', driver, 'AVAILABLE',"
        " available == (torch.cuda.device_count() > 0), flush=True)\n"
    )

    async def main() -> tuple[int, str] | None:
        pool, sink = _pool(tmp_path, preload=("torch", "torch.cuda"), script_text=script)
        pool.keep(_env())
        try:
            assert await pool.wait_ready(120)
            assert not _kinds(sink, "warm_discarded")
            return await _fork_one(pool, _env())
        finally:
            await pool.close()

    got = asyncio.run(main())
    assert got is not None and got[0] == 0, got
    assert "BEFORE True INITIALISED False DRIVER False AVAILABLE True" in got[1], got


def test_a_module_that_loads_the_cuda_driver_is_not_preloaded(tmp_path):
    # torch.cuda.is_available() at import loads the driver without marking
    # torch's CUDA initialised, and a worker forked after it cannot use the
    # GPU. This machine has no driver: the module maps a copy of a library
    # under the driver's name, which is what the zygote looks for.
    lib = next(
        p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6") if os.path.exists(p)
    )
    fake = tmp_path / "libcuda.so.1"
    fake.write_bytes(Path(lib).read_bytes())
    (tmp_path / "driverinit.py").write_text(f"import ctypes\nctypes.CDLL({str(fake)!r})\n")
    (tmp_path / "nvmlcheck.py").write_text(
        "import os\nSEEN = os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n"
    )
    env = _env()
    # The variable was set while the zygote imported, and is not the worker's.
    script = (
        "import os, sys\n"
        "before = 'nvmlcheck' in sys.modules\n"
        "import nvmlcheck\n"
        "print('BEFORE', before, 'SEEN', nvmlcheck.SEEN,"
        " 'NOW', os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'), flush=True)\n"
    )

    async def main() -> tuple[int, str] | None:
        pool, sink = _pool(
            tmp_path,
            preload=("nvmlcheck", "driverinit", "email.mime.text"),
            scope="all",
            script_text=script,
        )
        pool.keep(env)
        try:
            await _events_until(sink, "warm_started", 2)
            assert await pool.wait_ready(60)
            (gone,) = _kinds(sink, "warm_discarded")
            assert "driverinit" in gone["reason"] and "CUDA driver" in gone["reason"]
            return await _fork_one(pool, env)
        finally:
            await pool.close()

    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = asyncio.run(main())
    finally:
        os.chdir(old)
    assert got is not None and got[0] == 0 and "BEFORE True SEEN 1 NOW None" in got[1], got


def test_a_forked_worker_never_walks_the_zygotes_objects(tmp_path):
    # The zygote freezes what it holds before it forks: the worker's cyclic
    # collections (and the one at its exit) leave those objects alone, so
    # the pages it shares with the zygote stay shared. Its own objects are
    # collected as usual.
    script = (
        "import gc\n"
        "frozen = gc.get_freeze_count()\n"
        "class Cycle: pass\n"
        "a = Cycle(); a.me = a; del a\n"
        "print('FROZEN', frozen > 1000, 'ENABLED', gc.isenabled(),"
        " 'COLLECTED', gc.collect() >= 1, flush=True)\n"
    )

    async def main() -> tuple[int, str] | None:
        pool, _ = _pool(tmp_path, preload=("email.mime.text", "json"), script_text=script)
        pool.keep(_env())
        try:
            assert await pool.wait_ready(60)
            return await _fork_one(pool, _env())
        finally:
            await pool.close()

    got = asyncio.run(main())
    assert got is not None and got[0] == 0, got
    assert "FROZEN True ENABLED True COLLECTED True" in got[1], got
