"""What the agent does about a verdict (agent/attribution.py ``Attribution.act``)
over a real in-memory store: a node fault excludes the node only where the job
can go on without it, ``--quarantine-time 0`` and ``--no-stop-on-script-fault``
only report; every verdict is kept in the fault history, which ``elastrun
status`` shows (its table and ``--json``), with the failed health checks."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from elastrun.agent.attribution import Attribution
from elastrun.agent.hooks import Core
from elastrun.agent.spec import AttributionSettings
from elastrun.event_kinds import FaultVerdict
from elastrun.events import ListSink
from elastrun.failure import FailureRecord
from elastrun.rendezvous import fault_history as H
from elastrun.rendezvous import quarantine as Q
from elastrun.rendezvous.records import NodeInfo, PresenceRecord, RoundRecord, RoundState
from elastrun.rendezvous.verdict import Verdict, VerdictKind
from elastrun.status.show import render_table
from elastrun.status.summary import read_summary
from elastrun.store.memory import MemoryStore
from tests.unit.test_straggler_replacement import KEYS, RUN, StoreRendezvous, result

NODE = Verdict(VerdictKind.NODE, host="b", what="RuntimeError: CUDA error", rounds=(2, 3))
SCRIPT = Verdict(
    VerdictKind.SCRIPT, host="b", rank=1, step=3, what="ValueError: bad batch", rounds=(2, 3)
)
JOB = FailureRecord(host="b", rank=1, message="RuntimeError: CUDA error")


@pytest.mark.parametrize(
    ("members", "min_nodes", "spares", "stays"),
    [
        (2, 2, 0, True),  # a fixed size, no spare: the job could not go on
        (2, 2, 1, False),  # a spare takes its place
        (3, 2, 0, False),  # the others are still the minimum
        (2, 1, 0, False),
        (1, 1, 0, True),
        (4, 4, 2, False),
    ],
)
def test_a_faulty_node_is_kept_in_only_where_the_job_could_not_go_on_without_it(
    members: int, min_nodes: int, spares: int, stays: bool
) -> None:
    why = Q.kept_in(members, min_nodes, spares)
    assert (why is not None) == stays
    if stays:
        assert why == (
            f"not excluded: the job would fall below --nnodes min {min_nodes} with no spare"
        )


def attribution(
    store: MemoryStore, host: str, settings: AttributionSettings
) -> tuple[Attribution, ListSink]:
    """The agent's attribution on node ``host`` of a job --nnodes=2:3 (the
    round of :func:`result`: a and b)."""
    sink = ListSink()
    spec = SimpleNamespace(
        host=host, attribution=settings, run_id=RUN, stragglers=SimpleNamespace(replace_after=0)
    )
    core = SimpleNamespace(spec=spec, rendezvous=StoreRendezvous(store), events=sink)
    return Attribution(cast(Core, core)), sink


def verdict_events(sink: ListSink) -> list[dict[str, Any]]:
    return [e for e in sink.events if e["kind"] == FaultVerdict.KIND]


def present(node_id: str, host: str) -> bytes:
    return PresenceRecord(NodeInfo(node_id, host, "127.0.0.1", 1)).encode()


async def job(store: MemoryStore, *, spare: bool) -> None:
    """Round 3 (a and b) failed, round 4 is open; with ``spare``, node s is
    alive beside them (it waited, and may have joined round 4 already)."""
    await store.put(KEYS.round, RoundRecord(4, RoundState.OPEN).encode())
    for node_id, host in (("a-1-abc", "a"), ("b-1-abc", "b"), ("b-2-def", "b")):
        # (a second agent on b, a node of the faulty host, is no spare)
        await store.put(KEYS.node(node_id), present(node_id, host))
    if spare:
        await store.put(KEYS.node("s-1-abc"), present("s-1-abc", "s"))


def test_a_node_fault_at_the_minimum_without_a_spare_stays_and_status_says_why() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job(store, spare=False)
        for host in ("b", "a"):  # the faulty node and its peer decide alike
            att, sink = attribution(store, host, AttributionSettings(quarantine=600.0))
            action = await att.act(NODE, result(3), JOB)
            assert action.exit_code is None
            assert action.line.endswith(
                "node fault: node b failed 2 times in a row (RuntimeError: CUDA error): "
                "not excluded: the job would fall below --nnodes min 2 with no spare"
            ), action.line
            (ev,) = verdict_events(sink)
            assert (ev["verdict"], ev["node"], ev["action"]) == ("node_fault", "b", "stays")
        assert await Q.find(store, KEYS, "b") is None
        summary = await read_summary(store, RUN)
        assert summary is not None
        (kept,) = summary.verdicts
        assert (kept.round, kept.kind, kept.host) == (3, "node_fault", "b")
        table = render_table(summary, "h:1")
        assert (
            "verdict   round 3: node fault: node b failed 2 times in a row (RuntimeError: CUDA "
            "error); not excluded: the job would fall below --nnodes min 2 with no spare"
        ) in table, table
        out = json.loads(json.dumps(summary.to_json()))
        (v,) = out["fault_verdicts"]
        assert (v["host"], v["kind"], v["round"]) == ("b", "node_fault", 3)
        assert v["outcome"].startswith("not excluded: the job would fall below")

    asyncio.run(main())


def test_a_node_fault_with_a_waiting_spare_quarantines_the_node_and_it_leaves() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job(store, spare=True)
        att, sink = attribution(store, "b", AttributionSettings(quarantine=600.0))
        action = await att.act(NODE, result(3), JOB)
        assert action.exit_code == 1
        assert "this node (b) leaves the job, quarantined until" in action.line
        assert verdict_events(sink)[0]["action"] == "quarantine"
        rec = await Q.find(store, KEYS, "b")
        assert rec is not None and rec.active(time.time())
        peer, peer_sink = attribution(store, "a", AttributionSettings(quarantine=600.0))
        said = await peer.act(NODE, result(3), JOB)
        assert said.exit_code is None and said.line.endswith("node b leaves the job")
        assert verdict_events(peer_sink)[0]["action"] == "leaves"
        summary = await read_summary(store, RUN)
        assert summary is not None
        table = render_table(summary, "h:1")
        assert "; left the job, quarantined until" in table, table
        assert "node b quarantined until" in table

    asyncio.run(main())


def test_with_quarantine_off_a_node_fault_is_only_reported() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job(store, spare=True)
        att, sink = attribution(store, "b", AttributionSettings(quarantine=0.0))
        action = await att.act(NODE, result(3), JOB)
        assert action.exit_code is None and action.line.endswith("(--quarantine-time 0: it stays)")
        assert verdict_events(sink)[0]["action"] == "none"
        assert await Q.find(store, KEYS, "b") is None

    asyncio.run(main())


def test_without_stop_on_script_fault_the_job_restarts_instead_of_stopping() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job(store, spare=False)
        settings = AttributionSettings(stop_script_faults=False)
        att, sink = attribution(store, "a", settings)
        action = await att.act(SCRIPT, result(3), JOB)
        assert action.exit_code is None
        assert action.line == (
            "elastrun: script fault: ValueError: bad batch in rank 1 at step 3, 2 identical "
            "failures (last on b) (--no-stop-on-script-fault: restarting)"
        )
        assert verdict_events(sink)[0]["action"] == "none"
        hist = await H.read(store, KEYS)
        assert hist.stopped == ""  # the job is not stopped: a spare does not end
        kv = await store.get(KEYS.round)
        assert kv is not None and RoundRecord.decode(kv.key, kv.value).state is RoundState.OPEN
        # Stopping (the default) marks both.
        att, _ = attribution(store, "a", AttributionSettings())
        stopped = await att.act(SCRIPT, result(3), JOB)
        assert stopped.exit_code == 1 and stopped.line.startswith("elastrun: job stopped: ")
        summary = await read_summary(store, RUN)
        assert summary is not None and summary.state == "failed"
        table = render_table(summary, "h:1")
        assert "stopped:  script fault: ValueError: bad batch in rank 1 at step 3" in table
        out = summary.to_json()
        assert out["fault_stopped"] == SCRIPT.summary()
        # The verdict of round 3 kept is the first one (restarting).
        assert out["fault_verdicts"][0]["outcome"] == "--no-stop-on-script-fault: restarting"

    asyncio.run(main())


def test_failed_health_checks_are_kept_bounded_stamped_with_the_round_and_shown() -> None:
    async def main() -> None:
        store = MemoryStore()
        await store.put(KEYS.round, RoundRecord(2, RoundState.CLOSED).encode())
        for i in range(H.MAX_HEALTH + 3):
            failure = H.HealthFailure(
                host=f"c{i}",
                when="training" if i % 2 else "before_round",
                round=None,
                at=time.time(),
                reason="exited with code 7",
                output="probing\nGPU 0 has fallen off the bus\x1b[2J",
            )
            await H.health_failed(store, KEYS, failure)
        hist = await H.read(store, KEYS)
        assert [h.host for h in hist.health] == [f"c{i}" for i in range(3, H.MAX_HEALTH + 3)]
        assert {h.round for h in hist.health} == {2}
        summary = await read_summary(store, RUN)
        assert summary is not None
        table = render_table(summary, "h:1")
        last = H.MAX_HEALTH + 2
        line = next(ln for ln in table.splitlines() if f"node c{last} " in ln)
        assert f"health    node c{last} failed its health check before joining at " in line
        assert line.endswith(", round 2: exited with code 7: GPU 0 has fallen off the bus\\x1b[2J")
        out = summary.to_json()
        assert len(out["health_failures"]) == H.MAX_HEALTH
        assert out["health_failures"][-1]["when"] == "before_round"

    asyncio.run(main())
