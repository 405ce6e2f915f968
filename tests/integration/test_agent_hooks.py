"""The agent's core and its hooks (agent/hooks.py), with real worker processes.

A feature written for the test records when each hook is called and what it
is given; it runs alone (no warm starts, no hang diagnosis), so these tests
show the core's contract: the order of the hooks, the environment a feature
adds, the runner's typed messages, a rank a feature declares failed (the root
cause by the one rule), a feature's report in the failure summary, a node a
feature asks to leave (the rendezvous left before its workers stop), a node
quarantined while its round ended (it does not join the next).
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastrun.agent import Agent, PythonScript, WorkerSpec
from elastrun.agent.children import ForkedProcess
from elastrun.agent.hooks import Core, Feature, Leave, RoundHooks
from elastrun.agent.process import Worker
from elastrun.agent.spec import StragglerSettings, WarmSettings
from elastrun.agent.workers import WorkerGroup
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.rendezvous.api import Change
from elastrun.rendezvous.quarantine import QuarantineRecord
from elastrun.worker._messages import Message, Modules
from tests.conftest import PYTHON
from tests.integration.scripts.one_node import OneNodeRendezvous

AGENT_TIMEOUT = 120.0

# Writes its environment, then waits (bounded) for the file GO_FILE.
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    out = os.environ["OUT"]
    with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
        json.dump(dict(os.environ), f)
    go = os.environ["GO_FILE"]
    for _ in range(1200):  # at most 60 s
        if os.path.exists(go):
            sys.exit(0)
        time.sleep(0.05)
    sys.exit(3)
    """
)


class Recorder(Feature):
    """Records the hooks; ``declare``: the local rank it declares failed
    once every worker started; ``go``: the file it writes once both runners
    sent their modules (the workers then exit 0)."""

    def __init__(self, go: Path, declare: int | None = None) -> None:
        self.go = go
        self.declare = declare
        self.calls: list[str] = []
        self.messages: list[tuple[int, Message]] = []

    def start(self) -> None:
        self.calls.append("start")

    async def before_round(self) -> None:
        self.calls.append("before_round")

    def round(self, group: WorkerGroup) -> RoundHooks:
        self.calls.append("round")
        return _Round(self, group)

    async def close(self) -> None:
        self.calls.append("close")


class _Round(RoundHooks):
    def __init__(self, rec: Recorder, group: WorkerGroup) -> None:
        self.rec = rec
        self.group = group

    async def before_start(self) -> None:
        self.rec.calls.append("before_start")

    def worker_env(self, worker: Worker) -> dict[str, str]:
        self.rec.calls.append(f"worker_env {worker.local_rank}")
        return {"FROM_FEATURE": f"rank {worker.rank}"}

    async def fork(
        self, envs: Mapping[int, Mapping[str, str]], channels: Mapping[int, int]
    ) -> dict[int, ForkedProcess]:
        self.rec.calls.append(f"fork {sorted(envs)}")
        return {}  # the core spawns them all

    def started(self) -> None:
        self.rec.calls.append("started")
        if self.rec.declare is not None:
            w = self.group.workers[self.rec.declare]
            self.group.declare(w, f"rank {w.rank} declared failed by the test feature")

    def on_message(self, worker: Worker, message: Message) -> None:
        self.rec.messages.append((worker.local_rank, message))
        if len({lr for lr, m in self.rec.messages if isinstance(m, Modules)}) == 2:
            self.rec.go.write_text("go")

    def exited(self, worker: Worker) -> None:
        self.rec.calls.append(f"exited {worker.local_rank}")

    async def ended(self) -> None:
        self.rec.calls.append("ended")

    async def failed(self) -> str:
        self.rec.calls.append("failed")
        return "a report line from the test feature"

    async def changed(self, change: Change) -> None:
        self.rec.calls.append(f"changed {change.reason}")


def _run(tmp_path: Path, rec: Recorder) -> tuple[int, ListSink, dict[int, dict[str, Any]]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    spec = WorkerSpec(
        command=PythonScript(str(script), python=PYTHON),
        nproc=2,
        run_id=RunId("hooks"),
        host="testhost",
        shutdown_timeout=5.0,
        warm=WarmSettings(enabled=True),  # asked for, but no warm-start feature is given
        env={"OUT": str(out), "GO_FILE": str(rec.go), "ELASTRUN_MODULES_AFTER": "0.1"},
    )
    sink = ListSink()
    agent = Agent(
        spec, OneNodeRendezvous(run_id="hooks", nproc=2), sink, features=[lambda _c: [rec]]
    )
    code = asyncio.run(asyncio.wait_for(agent.run(), AGENT_TIMEOUT))
    envs = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    return code, sink, envs


def test_the_hooks_run_in_order_with_typed_messages(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "go")
    code, sink, envs = _run(tmp_path, rec)
    assert code == 0
    calls = rec.calls
    head = ["start", "before_round", "round", "before_start", "worker_env 0", "worker_env 1"]
    head.append("fork [0, 1]")
    assert calls[: len(head) + 1] == [*head, "started"]
    assert sorted(calls[len(head) + 1 : -2]) == ["exited 0", "exited 1"]
    assert calls[-2:] == ["ended", "close"]
    # Each runner's report, typed: the modules its worker imported.
    reports = {lr: m for lr, m in rec.messages if isinstance(m, Modules)}
    assert set(reports) == {0, 1} and all("json" in m.modules for m in reports.values())
    assert all(m.why == "timer" for m in reports.values())
    # The feature's variable reached each worker; the features not given added nothing.
    assert {r: e["FROM_FEATURE"] for r, e in envs.items()} == {0: "rank 0", 1: "rank 1"}
    assert not any(k.startswith(("ELASTRUN_HEARTBEAT", "ELASTRUN_STACK")) for k in envs[0])
    started = [e for e in sink.events if e["kind"] == "workers_started"]
    assert started[0]["warm"] == [False, False]
    assert not [e for e in sink.events if e["kind"].startswith("warm_")]


def test_a_rank_a_feature_declares_failed_is_the_root_cause(tmp_path: Path, capfd: Any) -> None:
    rec = Recorder(tmp_path / "never", declare=1)
    code, sink, _ = _run(tmp_path, rec)
    assert code == 1  # no restart left
    # Declared while both ran: reported before the workers were stopped.
    assert rec.calls.index("failed") < rec.calls.index("exited 0")
    exits = {e["local_rank"]: e for e in sink.events if e["kind"] == "worker_exited"}
    assert exits[1]["cause"] == "root_cause" and exits[0]["cause"] == "collateral"
    assert exits[0]["stopped_by_agent"] and exits[1]["signal"] == "SIGTERM"
    err = capfd.readouterr().err
    assert "[ROOT CAUSE] rank 1 (local rank 1)" in err
    assert "rank 1 declared failed by the test feature" in err
    assert "a report line from the test feature" in err
    (failed,) = [e for e in sink.events if e["kind"] == "job_failed"]
    assert failed["failure"]["rank"] == 1 and "declared failed" in failed["failure"]["hang"]


class Leaver(Feature):
    """Asks the node to leave the job once its workers started (as a
    replaced straggler's agent does), and records, at each worker's exit,
    how many times the agent had left the rendezvous by then."""

    def __init__(self, rdzv: OneNodeRendezvous) -> None:
        self.rdzv = rdzv
        self.core: Core | None = None
        self.left_at_exit: list[int] = []

    def round(self, group: WorkerGroup) -> RoundHooks:
        feature = self

        class Hooks(RoundHooks):
            def started(self) -> None:
                assert feature.core is not None
                feature.core.departure.request(Leave("elastrun: test: this node leaves", "test"))

            def exited(self, worker: Worker) -> None:
                feature.left_at_exit.append(feature.rdzv.shutdowns)

        return Hooks()


def test_a_node_a_feature_asks_to_leave_leaves_the_rendezvous_before_its_workers_stop(
    tmp_path: Path, capfd: Any
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    spec = WorkerSpec(
        command=PythonScript(str(script), python=PYTHON),
        nproc=2,
        run_id=RunId("leave"),
        host="testhost",
        shutdown_timeout=5.0,
        env={"OUT": str(out), "GO_FILE": str(tmp_path / "never")},
    )
    rdzv = OneNodeRendezvous(run_id="leave", nproc=2)
    leaver = Leaver(rdzv)

    def make(core: Core) -> list[Feature]:
        leaver.core = core
        return [leaver]

    sink = ListSink()
    code = asyncio.run(
        asyncio.wait_for(Agent(spec, rdzv, sink, features=[make]).run(), AGENT_TIMEOUT)
    )
    assert code == 1
    assert "elastrun: test: this node leaves" in capfd.readouterr().err
    # The others see a member leave (a membership change), not its workers'
    # collectives broken: the rendezvous was left before any worker stopped.
    assert len(leaver.left_at_exit) == 2 and min(leaver.left_at_exit) >= 1
    (failed,) = [e for e in sink.events if e["kind"] == "job_failed"]
    assert failed["reason"] == "test"
    assert not [e for e in sink.events if e["kind"] == "restart"]


class KeptOutLater(OneNodeRendezvous):
    """A one-node rendezvous whose node gets a quarantine record while its
    first round runs (a straggler's replacement it has not seen yet)."""

    record: QuarantineRecord | None = None

    async def quarantine_of(self, host: str) -> QuarantineRecord | None:
        return self.record


class ChangeOnce(Feature):
    """At the first round's start: the node's record is written and the
    round ends for another reason (a change); later rounds finish."""

    def __init__(self, rdzv: KeptOutLater, go: Path) -> None:
        self.rdzv = rdzv
        self.go = go

    def round(self, group: WorkerGroup) -> RoundHooks:
        feature = self

        class Hooks(RoundHooks):
            def started(self) -> None:
                if feature.rdzv.record is None:
                    now = time.time()
                    feature.rdzv.record = QuarantineRecord("testhost", now, now + 60, "straggler")
                    feature.rdzv.change.set()
                else:
                    feature.go.write_text("go")

        return Hooks()


def test_a_node_replaced_while_its_round_ended_otherwise_does_not_join_the_next(
    tmp_path: Path, capfd: Any
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    spec = WorkerSpec(
        command=PythonScript(str(script), python=PYTHON),
        nproc=1,
        run_id=RunId("kept"),
        host="testhost",
        shutdown_timeout=5.0,
        env={"OUT": str(out), "GO_FILE": str(tmp_path / "go")},
        stragglers=StragglerSettings(replace_after=2),
    )
    rdzv = KeptOutLater(run_id="kept", nproc=1)
    feature = ChangeOnce(rdzv, tmp_path / "go")
    sink = ListSink()
    agent = Agent(spec, rdzv, sink, features=[lambda _c: [feature]])
    code = asyncio.run(asyncio.wait_for(agent.run(), AGENT_TIMEOUT))
    assert code == 1
    assert "this node (testhost) is quarantined until" in capfd.readouterr().err
    assert len([e for e in sink.events if e["kind"] == "workers_started"]) == 1
