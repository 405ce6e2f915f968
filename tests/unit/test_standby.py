"""Standby ranks (agent/standby.py, docs/in_process.md *Standby ranks*): the
worker's side (a standby waits at its function for a rank; a worker tells its
agent when the script wraps a function), the standby's environment and the
variables it is told with its rank, how ``elastrun status`` shows a rank
served by a standby, and the agent's pool with real processes: a standby that
fails is replaced a bounded number of times, a ready one is stopped with its
process group. End to end: tests/integration/test_in_process.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from elastrun.agent.command import PythonScript
from elastrun.agent.env import rank_vars, standby_env, worker_env
from elastrun.agent.logs import LogWriteErrors
from elastrun.agent.process import Worker
from elastrun.agent.spec import StandbySettings, WorkerSpec
from elastrun.agent.standby import MAX_FAILURES, Standbys
from elastrun.agent.workers import WorkerGroup
from elastrun.errors import WorkerError
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.api import RoundResult
from elastrun.status.timeline import read_line, render_html
from elastrun.worker import _messages as M
from elastrun.worker import _restart
from elastrun.worker._messages import MAX_ENTER_VARS
from elastrun.worker._restart import Port
from tests.helpers import wait_for
from tests.unit.test_env import _round, _spec
from tests.unit.test_in_process import Agent, roundtrip
from tests.unit.test_in_process_visibility import T, rank, table
from tests.unit.timeline_events import line, logged, opened, standby_used, started

SRC = Path(__file__).resolve().parents[2] / "src"
BOUND = 120.0


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent()
    yield a
    a.ours.close()


def test_the_standby_messages_read_back_as_written() -> None:
    for message in (M.InProcess(), M.StandbyReady()):
        assert roundtrip(message) == message


def test_a_standby_waits_at_its_function_for_a_rank(agent: Agent) -> None:
    late = threading.Event()
    port = Port(agent.channel, -1, standby=True, late=late.set)
    port.wrapped()  # a standby's agent knows already: nothing sent
    out: list[dict[str, str] | None] = []
    t = threading.Thread(target=lambda: out.append(port.stand_by()), daemon=True)
    t.start()
    assert agent.read() == M.StandbyReady()
    agent.send(M.Abort(round=-1))  # not inside its function: refused
    agent.send(M.Enter(round=4, env={"RANK": "2", "LOCAL_RANK": "1"}))
    t.join(30)
    assert out == [{"RANK": "2", "LOCAL_RANK": "1"}]
    assert port.round == 4 and not port.standby and port.refused == 1
    port.entering()  # its first entry: as a new worker's
    assert agent.read() == M.Restartable(round=4)


def test_a_worker_tells_its_agent_once_that_the_script_wraps_a_function(agent: Agent) -> None:
    port = Port(agent.channel, 0)
    port.wrapped()
    port.wrapped()
    assert agent.read() == M.InProcess()
    port.entering()
    assert agent.read() == M.Restartable(round=0)


def test_the_runner_makes_a_standby_port_from_its_variable(agent: Agent) -> None:
    numbers = type("N", (), {"ascii_int": staticmethod(lambda s: int(s) if s else None)})
    try:
        _restart.install(agent.channel, None, numbers, standby_text="1")
        port = _restart.PORT
        assert port is not None and port.standby and port.round == -1
        _restart.install(agent.channel, "3", numbers)
        port = _restart.PORT
        assert port is not None and not port.standby and port.round == 3
    finally:
        _restart.PORT = None


def test_a_standby_starts_without_a_rank_and_is_told_its_rank_s_variables() -> None:
    spec = _spec()
    base = {"PATH": "/bin", "LOCAL_RANK": "7", "RANK": "7"}  # stale ones from the agent's
    standing = standby_env(spec, "job7", 3, base)
    assert not {"LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"} & set(standing)
    assert standing[_restart.STANDBY_ENV] == "1" and standing["LOCAL_WORLD_SIZE"] == "3"
    env = {**worker_env(spec, _round(), 2, "/e/2/error.json", base), "ELASTRUN_HEARTBEAT_FILE": "h"}
    given = rank_vars(standing, env)
    assert given["LOCAL_RANK"] == "2" and given["RANK"] == "4" and given["MASTER_PORT"] == "29511"
    assert given["ELASTRUN_HEARTBEAT_FILE"] == "h"
    assert "PATH" not in given and "LOCAL_WORLD_SIZE" not in given  # the same already
    many = {**env, **{f"V{i}": "x" for i in range(MAX_ENTER_VARS)}}
    with pytest.raises(WorkerError, match="more than 32"):
        rank_vars(standing, many)


def test_status_shows_a_rank_served_by_a_standby() -> None:
    served = {**rank(2, 404, False), "standby": True}
    text, out = table([rank(0, 101, True), rank(1, 102, True), served])
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip()[:1].isdigit()}
    assert "standby (pid 404)" in rows["2"] and "kept (pid 101)" in rows["0"]
    assert [r["standby"] for r in out["ranks"]] == [None, None, True]
    with pytest.raises(ValueError):
        N.RankProgress.from_json({"rank": 0, "standby": "yes"})


def test_the_timeline_marks_a_rank_served_by_a_standby() -> None:
    used = standby_used(1, 2, 404)
    read = read_line(line(T + 10.2, used, "n1", "h1"))
    assert read is not None and read.event == used  # a drawn kind, typed
    events = [logged(T, opened(0), "n1", "h1"), logged(T + 0.1, started(0, 3), "n1", "h1"), read]
    html = render_html(events)
    assert "in-process restart, round 1: rank 2 served by a standby (pid 404)" in html


def test_a_standby_taken_over_is_served_not_kept() -> None:
    w = Worker(-1, -1, "f", "f/error.json", cast(Any, (None, None)))
    w.standby = True
    w.take_over(rank=2, round_=4)
    assert (w.taken_over, w.rank, w.round) == (False, 2, 4)


def test_a_process_a_standby_served_is_kept_when_a_later_round_keeps_it(tmp_path: Path) -> None:
    """Round 5: rank 4 (local 2) served by a standby; round 6 keeps that process
    and rank 2's (local 0): both are in ``ranks_kept``, as status shows them."""

    def group(result: RoundResult, kept: dict[int, Worker]) -> WorkerGroup:
        return WorkerGroup(
            _spec(),
            result,
            attempt=result.round,
            attempt_dir=str(tmp_path),
            keep_files=False,
            events=ListSink(),
            kept=kept,
        )

    served = Worker(-1, -1, "f", "f/error.json", cast(Any, (None, None)))
    served.popen, served.standby = cast(Any, SimpleNamespace(pid=404)), True  # Standbys.take
    first = group(_round(), {2: served})
    assert first.ranks_kept() is None  # a standby served, nothing kept
    assert (served.standby, served.taken_over) == (True, False)
    survivor = first.workers[0]
    survivor.popen = cast(Any, SimpleNamespace(pid=101))
    second = group(dataclasses.replace(_round(), round=6), {0: survivor, 2: served})
    kept = second.ranks_kept()
    assert kept is not None
    assert (kept.round, kept.kept, kept.kept_pids, kept.started) == (6, [2, 4], [101, 404], [3])
    assert (served.standby, served.taken_over) == (False, True)  # status: kept (pid 404)


# ---------------------------------------------------------------- the pool, real processes
def pool(tmp_path: Path, script: str) -> tuple[Standbys, ListSink]:
    path = tmp_path / "script.py"
    path.write_text(script)
    spec = WorkerSpec(
        command=PythonScript(str(path)),
        nproc=1,
        run_id=RunId("standby"),
        env={"PYTHONPATH": str(SRC)},
        standby=StandbySettings(count=1),
    )
    sink = ListSink()
    folder = tmp_path / "base"
    folder.mkdir(mode=0o700)
    return Standbys(spec, sink, lambda: str(folder), log_errors=LogWriteErrors(sink)), sink


async def until(check: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while not check():
        assert loop.time() < deadline, f"not within {BOUND} s: {what}"
        await asyncio.sleep(0.05)


def test_a_failing_standby_is_replaced_a_bounded_number_of_times(tmp_path: Path) -> None:
    standbys, sink = pool(tmp_path, "raise SystemExit(3)\n")

    async def run() -> None:
        standbys.want("standby", 0)
        failed = lambda: [e for e in sink.events if e["kind"] == "standby_failed"]  # noqa: E731
        await until(lambda: len(failed()) == MAX_FAILURES, "the standbys' failures")
        await asyncio.sleep(0.5)  # none more is started
        await standbys.stop(5.0)

    asyncio.run(run())
    assert sink.kinds().count("standby_started") == MAX_FAILURES
    fails = [e for e in sink.events if e["kind"] == "standby_failed"]
    assert [e["retry"] for e in fails] == [True] * (MAX_FAILURES - 1) + [False]
    assert all(e["reason"] == "exited with code 3" for e in fails)


def test_a_ready_standby_is_taken_and_the_rest_stopped_with_their_groups(tmp_path: Path) -> None:
    script = (
        "import subprocess, sys\n"
        "from elastrun.train import in_process\n"
        # a child in its process group: stopped with it
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('child', child.pid, flush=True)\n"
        "in_process(lambda: None)()\n"
    )
    standbys, sink = pool(tmp_path, script)
    pids: list[int] = []

    async def run() -> None:
        standbys.want("standby", 0)
        await until(lambda: "standby_ready" in sink.kinds(), "the first standby's readiness")
        taken = standbys.take(2)  # one is ready: one is taken
        assert [w.pid for w, _ in taken] == [sink.events[0]["pid"]]
        standbys.fill()  # the agent's, once the round started: another is started
        pids.append(taken[0][0].pid)
        await until(lambda: sink.kinds().count("standby_ready") == 2, "the second one")
        await standbys.stop(5.0)
        for w, _ in taken:  # the taken one is the group's: stopped by the test here
            os.killpg(w.pid, 9)
            await asyncio.wait_for(asyncio.shield(cast(Any, w.exited)), BOUND)
            w.reap(asyncio.get_running_loop(), 0.0)
            w.release()

    asyncio.run(run())
    second = [e["pid"] for e in sink.events if e["kind"] == "standby_ready"][1]
    logs = sorted((tmp_path / "base" / "standby").glob("*/stdout.log"))
    firsts = [f.read_text().splitlines()[:1] for f in logs]
    children = [int(first[0].split()[1]) for first in firsts if first]
    assert len(children) == 2

    def ended(pid: int) -> bool:
        return not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)

    for pid in [second, *children]:  # SIGKILLed: gone (or a zombie) once the kernel ran it
        wait_for(functools.partial(ended, pid), BOUND, f"{pid} to end")
    assert "standby_failed" not in sink.kinds()
    assert json.dumps(sink.events)  # typed events, JSON as written


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_module_report_leaves_the_optimizer_s_later_hooks_working() -> None:
    """A standby's progress hook is registered after the runner's module
    report (once it has a rank): the report, done at the first step, must
    not break the optimizer's loop over its hooks by removing itself."""
    torch = pytest.importorskip("torch")
    from torch.optim import optimizer

    from elastrun.worker import _runner

    sent: list[Any] = []
    channel = type("C", (), {"fd": None, "send": lambda self, m: sent.append(m)})()
    before = set(optimizer._global_optimizer_post_hooks)
    seen: list[int] = []
    try:
        recorder = _runner.ModuleRecorder(channel, "installed", 0.0)
        recorder.install()
        optimizer.register_optimizer_step_post_hook(lambda *_: seen.append(1))
        p = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([p], lr=0.1)
        for _ in range(2):
            p.grad = torch.ones(1)
            opt.step()
        recorder.finish()  # the list goes out from a thread of its own
    finally:
        for key in set(optimizer._global_optimizer_post_hooks) - before:
            del optimizer._global_optimizer_post_hooks[key]
    assert seen == [1, 1]
    assert [type(m).__name__ for m in sent] == ["Modules"]


def test_the_flag_reaches_the_agent_as_a_settings_group_within_its_bounds() -> None:
    from elastrun.errors import ConfigError
    from elastrun.launcher.config import LaunchConfig
    from elastrun.launcher.flags import parse_flags, resolve_flags
    from elastrun.launcher.plan import resolve

    script = str(SRC.parent / "examples" / "train.py")
    flags = parse_flags(["--standby-ranks=2", script])
    spec = resolve_flags(flags, resolve(LaunchConfig()).workers.command).workers.standby
    assert spec.count == 2
    assert resolve(LaunchConfig()).workers.standby.count == 1  # the default
    assert (
        resolve(LaunchConfig(standby_ranks=3, virtual_local_rank=True)).workers.standby.count == 0
    )
    for bad in (-1, 9):
        with pytest.raises(ConfigError, match="--standby-ranks"):
            resolve(LaunchConfig(standby_ranks=bad))
