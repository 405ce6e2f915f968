"""The invariants of fault attribution's exclusions, checked from the agents'
event logs (pure).

Given every agent's event log (``--events-file``), the failures the test
injected (the workers' ``injected.jsonl``: node, pid, what) and the job's
settings, :func:`violations` lists every breach of:

1. every round's world (its members) is within ``--nnodes`` (never below
   the minimum);
2. every node-fault verdict (``fault_verdict``, whichever node wrote it, and
   so every quarantine) rests on the rule (docs/reliability.md, *Fault
   attribution*): its failed rounds are ``limit`` many, the last failed
   rounds of the job at that time (no other failed round between them), and
   in each the job's root cause, as every node recorded it (their
   ``restart`` and ``job_failed`` events), is a failure of the named node by
   itself (role ``root_cause``, never a broken collective or a hang), of one
   class (kind, exception type, exit code, signal), by a worker whose
   failure the test injected on that node: never a healthy node's
   collective a peer broke;
3. a quarantine (``node_quarantined``) follows such a verdict of its own
   node's, with the action ``quarantine``, and no node is quarantined more
   often than its injected failures allow (``limit`` each, in disjoint
   rounds);
4. no script-fault verdict: every injected failure's message is unique;
5. a quarantine lasts ``--quarantine-time`` (its ``until``); while it lasts
   no agent of that node joins the job (waits in a round or trains), and a
   refused start (``quarantine_refused``) happens only before it expires;
6. an exclusion never takes the job below ``--nnodes``' minimum without a
   spare: a node quarantined for a node fault left a round (the verdict's
   last failed round) whose other members were at least the minimum, or a
   node of another host was there to take its place (its last
   ``node_waiting`` / ``round_joined`` / ``workers_started`` before the
   quarantine a ``node_waiting``, or it joined a later round without being a
   member of the failed one); and a
   node that stayed (action ``stays``) left a round whose other members were
   fewer than the minimum.

Times are the events' ``ts`` (wall clock of the one machine that runs every
namespace), so the logs of different agents compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]
OWN_KINDS = ("error", "signal")  # failure.ERROR, failure.SIGNAL: a rank failed by itself
CLOCK_SLACK = 2.0  # s between an event's ts and the time its agent computed


def _exception_type(message: str) -> str:
    head = message.strip().split(":", 1)[0]
    return head if head.replace(".", "").replace("_", "").isalnum() else ""


def failure_class(record: Mapping[str, Any]) -> tuple[object, ...]:
    return (
        record.get("kind"),
        _exception_type(str(record.get("message") or "")),
        record.get("exitcode"),
        record.get("signal"),
    )


def root_causes(logs: Mapping[str, Sequence[Event]]) -> dict[int, list[Mapping[str, Any]]]:
    """Failed round -> the job's root cause as each node that went on (its
    ``restart``) or ended (its ``job_failed`` after a verdict on that round)
    recorded it."""
    causes: dict[int, list[Mapping[str, Any]]] = {}
    for events in logs.values():
        verdict_round: int | None = None
        for ev in events:
            if ev["kind"] == "restart" and ev.get("failure"):
                causes.setdefault(ev["round"], []).append(ev["failure"])
            elif ev["kind"] == "fault_verdict":
                verdict_round = ev["round"]
            elif ev["kind"] == "job_failed" and ev.get("failure") and verdict_round is not None:
                causes.setdefault(verdict_round, []).append(ev["failure"])
                verdict_round = None
    return causes


def violations(
    logs: Mapping[str, Sequence[Event]],
    injected: Sequence[Mapping[str, Any]],
    *,
    limit: int,
    nnodes: tuple[int, int],
    quarantine_time: float,
    hosts: Mapping[str, str],
) -> list[str]:
    """``hosts``: each log's (agent's) node."""
    found: list[str] = []
    low, high = nnodes
    for agent, events in logs.items():
        for ev in events:
            if ev["kind"] == "round_closed" and not low <= len(ev["members"]) <= high:
                found.append(f"{agent}: round {ev['round']} closed with {ev['members']}")
    causes = root_causes(logs)
    failed = set(causes)
    pids: dict[str, set[int]] = {}
    for inj in injected:
        pids.setdefault(str(inj["node"]), set()).add(int(inj["pid"]))

    def justified(ev: Event, agent: str) -> list[str]:
        host, rounds = ev["node"], list(ev["rounds"])
        why = []
        if len(rounds) != limit:
            why.append(f"rests on {len(rounds)} failed rounds, not {limit}")
        between = sorted(r for r in failed if rounds and rounds[0] < r < rounds[-1])
        if set(between) - set(rounds):
            why.append(f"other failed rounds lie between its rounds: {between}")
        classes = set()
        for r in rounds:
            for cause in causes.get(r, []) or [{}]:
                classes.add(failure_class(cause))
                if cause.get("host") != host or cause.get("role") != "root_cause":
                    why.append(f"round {r}'s root cause is not {host}'s: {dict(cause)}")
                elif cause.get("kind") not in OWN_KINDS:
                    why.append(f"round {r}'s root cause is a {cause.get('kind')} (collateral)")
                elif cause.get("pid") not in pids.get(host, set()):
                    why.append(f"round {r}'s root cause, pid {cause.get('pid')}, was no injection")
        if len(classes) > 1:
            why.append(f"its failures are of different classes: {sorted(map(str, classes))}")
        return [f"{agent}: verdict on {host} at round {ev['round']}: {w}" for w in why]

    quarantined: dict[str, list[tuple[int, ...]]] = {}
    for agent, events in logs.items():
        # The node's own verdict (action "quarantine") and its quarantine, in
        # either order (the record is written before the verdict is told).
        own = [e for e in events if e["kind"] == "fault_verdict" and e["action"] == "quarantine"]
        records = [e for e in events if e["kind"] == "node_quarantined"]
        if len(own) != len(records):
            found.append(f"{agent}: {len(records)} quarantines, {len(own)} verdicts to quarantine")
        for verdict, ev in zip(own, records, strict=False):
            host = ev["quarantined_host"]
            if verdict["node"] != host or verdict["verdict"] != "node_fault":
                found.append(f"{agent}: {host} quarantined on another verdict: {verdict}")
            else:
                quarantined.setdefault(host, []).append(tuple(verdict["rounds"]))
        for ev in events:
            if ev["kind"] == "fault_verdict" and ev["verdict"] == "script_fault":
                found.append(f"{agent}: a script-fault verdict on unique failures: {ev}")
            elif ev["kind"] == "fault_verdict" and ev["verdict"] == "node_fault":
                found += justified(ev, agent)
            elif ev["kind"] == "node_quarantined":
                length = ev["until"] - ev["ts"]
                if abs(length - quarantine_time) > CLOCK_SLACK:
                    found.append(f"{agent}: quarantined for {length:.1f} s: {ev}")
            elif ev["kind"] == "quarantine_refused" and ev["ts"] >= ev["until"]:
                found.append(f"{agent}: refused after its quarantine expired: {ev}")
    found += _below_minimum(logs, low, hosts)
    periods = [
        (ev["quarantined_host"], ev["ts"], ev["until"])
        for events in logs.values()
        for ev in events
        if ev["kind"] == "node_quarantined"
    ]
    joins = ("node_waiting", "round_joined", "workers_started")
    for agent, events in logs.items():
        for ev in events:
            for host, since, until in periods:
                if ev["kind"] in joins and hosts.get(agent) == host and since < ev["ts"] < until:
                    found.append(f"{agent}: {ev['kind']} while {host} is quarantined: {ev}")
    for host, verdicts in quarantined.items():
        allowed = len(pids.get(host, ())) // max(limit, 1)
        if len(verdicts) > allowed:
            found.append(
                f"{host} quarantined {len(verdicts)} times, its injections allow {allowed}"
            )
        rounds = [r for v in verdicts for r in v]
        if len(rounds) != len(set(rounds)):
            found.append(f"{host}'s quarantines share failed rounds: {verdicts}")
    return found


def round_sizes(logs: Mapping[str, Sequence[Event]]) -> dict[int, int]:
    """Round -> its members, as its members and its decider logged them."""
    sizes: dict[int, int] = {}
    for events in logs.values():
        for ev in events:
            if ev["kind"] == "round_joined":
                n = int(ev["members"])
            elif ev["kind"] == "round_closed":
                n = len(ev["members"])
            else:
                continue
            sizes[ev["round"]] = max(sizes.get(ev["round"], 0), n)
    return sizes


def _spare_waited(
    logs: Mapping[str, Sequence[Event]],
    hosts: Mapping[str, str],
    host: str,
    ts: float,
    failed: int,
) -> bool:
    """A node of another host was there to take ``host``'s place at ``ts``:
    waiting, or already joined a round after the ``failed`` one."""
    steps = ("node_waiting", "round_joined", "workers_started")
    for agent, events in logs.items():
        if hosts.get(agent) == host:
            continue
        before = [e for e in events if e["kind"] in steps and e["ts"] <= ts]
        if not before:
            continue
        last = before[-1]
        if last["kind"] == "node_waiting":
            return True
        joined = [e for e in before if e["kind"] == "round_joined"]
        if (
            joined
            and joined[-1]["round"] > failed
            and not any(e["kind"] == "round_joined" and e["round"] == failed for e in events)
        ):
            return True
    return False


def _below_minimum(
    logs: Mapping[str, Sequence[Event]], low: int, hosts: Mapping[str, str]
) -> list[str]:
    """Rule 6: exclusions only where the job goes on (see the docstring)."""
    found: list[str] = []
    sizes = round_sizes(logs)
    for agent, events in logs.items():
        verdicts = [e for e in events if e["kind"] == "fault_verdict"]
        for ev in verdicts:
            if ev["verdict"] != "node_fault" or ev["action"] not in ("quarantine", "stays"):
                continue
            # The verdict's last failed round (else the latest of its rounds
            # whose members were logged).
            known = [r for r in [*ev["rounds"], ev["round"]] if r in sizes]
            if not known:
                found.append(f"{agent}: no member logged the rounds of {ev}")
                continue
            last = max(known)
            members = sizes[last]
            goes_on = members - 1 >= low
            if ev["action"] == "stays" and goes_on:
                found.append(f"{agent}: {ev['node']} stayed though {members - 1} others remain")
            elif (
                ev["action"] == "quarantine"
                and not goes_on
                and not _spare_waited(logs, hosts, ev["node"], ev["ts"], last)
            ):
                found.append(
                    f"{agent}: {ev['node']} excluded below --nnodes min {low} with no spare "
                    f"(round {last} had {members} members)"
                )
    return found
