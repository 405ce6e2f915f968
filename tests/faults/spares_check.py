"""The invariants of hot spares, checked from the agents' event logs (pure).

Given every agent's event log (``--events-file``), what the test did to which
agent (SIGKILLed at a time; cut off from the network between two times) and
the allowed world sizes, :func:`violations` lists every breach of:

1. every round's world size (nodes) is an allowed size, and its group ranks
   are distinct and below it;
2. a member of the previous round keeps its group rank (the world keeps its
   size here, so every survivor can);
3. a node that was not a member of the previous round (a promoted spare)
   takes exactly the rank of a previous member that is gone, and its
   ``spare_promoted`` event names that member;
4. at most one training generation at any moment: two nodes' workers of
   different rounds never run at the same time, unless the older ones are on
   a node cut off from every other at that moment (they can reach no peer:
   their collectives are broken, and their agent stops them once it sees its
   lease lost);
5. every workers' start is matched by their end (each worker's exit is
   logged), or their agent was SIGKILLed (its orphan guard kills them; the
   test checks they are gone);
6. a node that lost its lease registers again (``lease_regained``) only once
   every worker it had started before is gone: it never rejoins the job, as
   a spare or a member, with workers of its old membership still running.

Times are the events' ``ts`` (wall clock of the one machine that runs every
namespace), so the logs of different agents compare.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Event = Mapping[str, Any]


@dataclass
class Generation:
    """One agent's workers of one round: from their start to the last exit."""

    agent: str
    round: int
    start: float
    pids: frozenset[int]
    end: float = math.inf


@dataclass
class Faults:
    """What the test did: agents SIGKILLed (when), agents cut off (from, to)."""

    killed: dict[str, float] = field(default_factory=dict)
    cut: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def was_cut(self, agent: str, at: float) -> bool:
        return any(lo <= at <= hi for lo, hi in self.cut.get(agent, ()))


def memberships(logs: Mapping[str, Sequence[Event]]) -> dict[int, dict[str, int]]:
    """Round -> {node id: group rank}: the decider's ``round_closed`` (the
    whole round) merged with each member's own ``round_joined``."""
    rounds: dict[int, dict[str, int]] = {}
    for events in logs.values():
        for ev in events:
            if ev["kind"] == "round_closed":
                rounds.setdefault(ev["round"], {}).update(ev["ranks"])
            elif ev["kind"] == "round_joined":
                rounds.setdefault(ev["round"], {})[ev["node_id"]] = ev["group_rank"]
    return rounds


def generations(logs: Mapping[str, Sequence[Event]], faults: Faults) -> list[Generation]:
    gens: list[Generation] = []
    for agent, events in logs.items():
        exits: dict[int, float] = {}
        for ev in events:
            if ev["kind"] == "worker_exited":
                exits[int(ev["pid"])] = float(ev["ts"])
        for ev in events:
            if ev["kind"] != "workers_started":
                continue
            pids = frozenset(int(p) for p in ev["pids"])
            gen = Generation(agent, int(ev["round"]), float(ev["ts"]), pids)
            if pids and pids <= exits.keys():
                gen.end = max(exits[p] for p in pids)
            elif agent in faults.killed and faults.killed[agent] >= gen.start:
                gen.end = faults.killed[agent]
            gens.append(gen)
    return gens


def _sizes(
    rounds: dict[int, dict[str, int]], sizes: Mapping[int, int], allowed: set[int]
) -> list[str]:
    out = []
    for r, ranks in sorted(rounds.items()):
        size = sizes.get(r, len(ranks))
        if size not in allowed:
            out.append(f"round {r}: world of {size} nodes, not an allowed size {sorted(allowed)}")
        if len(set(ranks.values())) != len(ranks) or any(not 0 <= g < size for g in ranks.values()):
            out.append(f"round {r}: group ranks {ranks} are not distinct ranks below {size}")
    return out


def _ranks(logs: Mapping[str, Sequence[Event]], rounds: dict[int, dict[str, int]]) -> list[str]:
    out = []
    promoted = {
        (ev["round"], ev["node_id"]): ev.get("replaces")
        for events in logs.values()
        for ev in events
        if ev["kind"] == "spare_promoted"
    }
    order = sorted(rounds)
    for before, r in itertools.pairwise(order):
        prev, now = rounds[before], rounds[r]
        lost = {rank: nid for nid, rank in prev.items() if nid not in now}
        for nid, rank in now.items():
            if nid in prev:
                if prev[nid] != rank:
                    out.append(f"round {r}: survivor {nid} moved from rank {prev[nid]} to {rank}")
                continue
            if rank not in lost:
                out.append(f"round {r}: {nid} (new) took rank {rank}, no lost member's {lost}")
            elif (r, nid) in promoted and promoted[(r, nid)] != lost[rank]:
                out.append(
                    f"round {r}: {nid} says it replaces {promoted[(r, nid)]}, "
                    f"but rank {rank} was {lost[rank]}'s"
                )
    return out


def _overlaps(gens: list[Generation], faults: Faults) -> list[str]:
    out = []
    for g in gens:
        if g.end == math.inf:
            out.append(f"{g.agent}: workers of round {g.round} never ended (no exit logged)")
    for old in gens:
        for new in gens:
            if new.round <= old.round or new.agent == old.agent:
                continue
            lo, hi = max(old.start, new.start), min(old.end, new.end)
            if lo < hi and not faults.was_cut(old.agent, lo):
                out.append(
                    f"two generations at once: {old.agent}'s round {old.round} "
                    f"[{old.start:.3f}, {old.end:.3f}] and {new.agent}'s round {new.round} "
                    f"[{new.start:.3f}, {new.end:.3f}], and {old.agent} was not cut off"
                )
    return out


def _rejoins(logs: Mapping[str, Sequence[Event]], gens: list[Generation]) -> list[str]:
    out = []
    for agent, events in logs.items():
        for ev in events:
            if ev["kind"] != "lease_regained":
                continue
            at = float(ev["ts"])
            for g in gens:
                if g.agent == agent and g.start < at < g.end:
                    out.append(
                        f"{agent} registered again at {at:.3f} while its workers of round "
                        f"{g.round} [{g.start:.3f}, {g.end:.3f}] still ran"
                    )
    return out


def violations(logs: Mapping[str, Sequence[Event]], faults: Faults, allowed: set[int]) -> list[str]:
    """Every breach of the module's invariants; empty when the run was sound."""
    rounds = memberships(logs)
    sizes = {
        ev["round"]: ev["group_world_size"]
        for events in logs.values()
        for ev in events
        if ev["kind"] == "round_joined"
    }
    gens = generations(logs, faults)
    return [
        *_sizes(rounds, sizes, allowed),
        *_ranks(logs, rounds),
        *_overlaps(gens, faults),
        *_rejoins(logs, gens),
    ]
