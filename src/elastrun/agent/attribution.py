"""Fault attribution across restarts: crash loops stopped, faulty nodes excluded.

After each worker failure the nodes agree on the job's root cause
(rendezvous/root_cause.py). :class:`Attribution` then adds it, with the step
its rank reached (the rank's progress file, which the worker's runner writes
as the script raises: agent/watchdog.py), to the job's fault history in the
store (rendezvous/fault_history.py) and applies the verdict rule
(rendezvous/verdict.py) to that history, which every member of the failed
round reads alike. A verdict that is not transient is kept in the history
too, with what was done about it, for ``elastrun status``:

* **script fault**: with ``--stop-on-script-fault`` (the default), every
  node prints ``elastrun: job stopped: script fault: ValueError: bad batch
  in rank 1 at step 5, 2 identical failures`` and exits 1; the job is marked
  failed in the store, so that a spare that waits ends too (and prints the
  same line). Without it, the verdict is reported and the job restarts.
* **node fault**: with ``--quarantine-time S`` (default 600 s; 0: off), the
  faulty node leaves only where the job can go on without it: a spare waits
  to take its place (a node of the job alive beside the failed round's
  members), or the round's other members are still at least ``--nnodes``'
  minimum (rendezvous/quarantine.py ``kept_in``; every member decides alike
  from the round and the nodes present). Then it writes its
  quarantine record, says so and leaves the job (exit 1); the others go on:
  a waiting spare takes its place (docs/spares.md), else the job goes on at
  a smaller allowed world size. Otherwise it stays, and the verdict says
  why (``not excluded: the job would fall below --nnodes min 2 with no
  spare``). An agent that starts on a quarantined node is refused
  (:meth:`refusal`) until the record expires or an operator clears it
  (``elastrun status --clear-quarantine HOST``).
* **transient**: nothing more than the restart.

Settings: :class:`~elastrun.agent.spec.AttributionSettings` (``--fault-limit``
0 turns attribution off).
"""

from __future__ import annotations

import contextlib
import time

from elastrun.agent.failures import SETTLE_TIMEOUT
from elastrun.agent.hang_group import progress_file
from elastrun.agent.hooks import Core
from elastrun.agent.watchdog import read_beat
from elastrun.agent.workers import WorkerGroup
from elastrun.errors import ElastrunError
from elastrun.event_kinds import FaultVerdict, NodeQuarantined, QuarantineRefused
from elastrun.failure import FailureRecord, same_failure
from elastrun.frozen import frozen
from elastrun.rendezvous.api import RoundResult
from elastrun.rendezvous.fault_history import JudgedFault, entry_of
from elastrun.rendezvous.quarantine import QuarantineRecord, kept_in
from elastrun.rendezvous.verdict import Verdict, VerdictKind, judge
from elastrun.untrusted import printable

__all__ = ["ENTRY_TIMEOUT", "Action", "Attribution"]

# s a member whose failure is not the root cause waits for the root-cause
# node's entry (that node settles first: at most SETTLE_TIMEOUT).
ENTRY_TIMEOUT = SETTLE_TIMEOUT + 5.0


@frozen
class Action:
    """What the agent does about a verdict: ``exit_code`` (None: go on) and
    the line it prints."""

    exit_code: int | None
    line: str


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class Attribution:
    """The agent's side of fault attribution (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.settings = core.spec.attribution

    @property
    def enabled(self) -> bool:
        return self.settings.limit > 0

    async def refusal(self) -> str | None:
        """The line refusing this node when it is quarantined (None: it may join)."""
        host = self.core.spec.host
        # A straggler replaced by a spare is kept out by the same record.
        replaces = self.core.spec.stragglers.replace_after > 0
        if not (self.enabled or replaces) or not host:
            return None
        rec = await self.core.rendezvous.quarantine_of(host)
        if rec is None or not rec.active(time.time()):
            return None
        self.core.events.emit(
            QuarantineRefused(quarantined_host=host, until=rec.until, reason=rec.reason)
        )
        return (
            f"elastrun: error: this node ({printable(host)}) is quarantined until "
            f"{_when(rec.until)}: {printable(rec.reason, limit=300)}; it does not join. "
            f"Clear it with: elastrun status --rdzv-endpoint=... --rdzv-id="
            f"{self.core.spec.run_id} --clear-quarantine {printable(host)}"
        )

    async def stopped(self) -> str | None:
        """The summary of the script fault that stopped the job, if one did."""
        if not self.enabled:
            return None
        hist = await self.core.rendezvous.fault_history()
        return hist.stopped if hist is not None and hist.stopped else None

    async def judge(
        self,
        group: WorkerGroup,
        result: RoundResult,
        job: FailureRecord,
        record: FailureRecord,
    ) -> Verdict | None:
        """The verdict once round ``result.round`` failed with root cause
        ``job`` (this node's own failure: ``record``); None when attribution
        is off or the store keeps no history."""
        if not self.enabled:
            return None
        own = same_failure(job, record)
        step = self._step(group, job) if own else None
        entry = entry_of(job, result.round, step)
        hist = await self.core.rendezvous.record_fault(entry, own=own, timeout=ENTRY_TIMEOUT)
        if hist is None or not hist.has(result.round):
            return None
        return judge(hist.entries, self.settings.limit)

    def _step(self, group: WorkerGroup, job: FailureRecord) -> int | None:
        """The step the failed rank reached: its progress file, flushed as
        its script raised (None: no progress reported)."""
        for w in group.workers:
            if w.local_rank == job.local_rank:
                beat = read_beat(progress_file(w))
                return beat.step if beat is not None else None
        return None

    async def act(self, verdict: Verdict, result: RoundResult, job: FailureRecord) -> Action:
        """Apply ``verdict`` (see the module docstring); report it."""
        summary = verdict.summary()
        shown = printable(summary, limit=1000)
        host = self.core.spec.host
        action, out, outcome = "none", Action(None, ""), ""
        if verdict.kind is VerdictKind.SCRIPT and self.settings.stop_script_faults:
            await self.core.rendezvous.stop_job(summary)
            action, outcome = "stop", "the job stopped"
            out = Action(1, f"elastrun: job stopped: {shown}")
        elif verdict.kind is VerdictKind.SCRIPT:
            outcome = "--no-stop-on-script-fault: restarting"
            out = Action(None, f"elastrun: {shown} ({outcome})")
        elif verdict.kind is VerdictKind.NODE and self.settings.quarantine > 0:
            kept = await self._kept_in(verdict.host, result)
            if kept is not None:
                action, outcome = "stays", kept
                out = Action(None, f"elastrun: {shown}: {kept}")
            elif verdict.host == host:
                action = "quarantine"
                out, outcome = await self._quarantine(verdict, result, summary)
            else:
                action = "leaves"
                out = Action(
                    None, f"elastrun: {shown}: node {printable(verdict.host)} leaves the job"
                )
        elif verdict.kind is VerdictKind.NODE:
            outcome = "not excluded: --quarantine-time 0"
            out = Action(None, f"elastrun: {shown} (--quarantine-time 0: it stays)")
        if verdict.kind is not VerdictKind.TRANSIENT:
            # For `elastrun status`, by the node that acts on it: a node
            # fault's own node decides whether it leaves.
            if verdict.kind is VerdictKind.SCRIPT or verdict.host == host:
                await self.core.rendezvous.record_verdict(
                    JudgedFault(result.round, verdict.kind.value, verdict.host, summary, outcome)
                )
            self.core.events.emit(
                FaultVerdict(
                    round=result.round,
                    verdict=verdict.kind.value,
                    node=verdict.host,
                    failure=verdict.what,
                    rounds=list(verdict.rounds),
                    summary=summary,
                    action=action,
                    rank=verdict.rank,
                    step=verdict.step,
                )
            )
        return out

    async def _kept_in(self, faulty: str, result: RoundResult) -> str | None:
        """Why node ``faulty`` stays in the job (None: it leaves): the job
        could not go on without it (rendezvous/quarantine.py ``kept_in``).
        A spare is a node of the job alive beside the failed round's members
        (waiting, or joined the round the failure opened); spares not known
        (the store did not answer) count as none."""
        rdzv = self.core.rendezvous
        spares = None
        with contextlib.suppress(ElastrunError):
            full = result if result.complete else await rdzv.full_result(result)
            spares = await rdzv.spares_for(faulty, [m.node_id for m in full.members])
        return kept_in(result.group_world_size, rdzv.settings.min_nodes, spares or 0)

    async def _quarantine(
        self, verdict: Verdict, result: RoundResult, summary: str
    ) -> tuple[Action, str]:
        host = self.core.spec.host
        now = time.time()
        until = now + self.settings.quarantine
        rec = QuarantineRecord(host, now, until, summary, result.round)
        recorded = await self.core.rendezvous.quarantine(rec)
        self.core.events.emit(
            NodeQuarantined(quarantined_host=host, until=until, reason=summary, recorded=recorded)
        )
        kept = (
            f"quarantined until {_when(until)}"
            if recorded
            else "not quarantined (the store did not take the record)"
        )
        line = (
            f"elastrun: {printable(summary, limit=1000)}: this node ({printable(host)}) leaves "
            f"the job, {kept}"
        )
        return Action(1, line), f"left the job, {kept}"
