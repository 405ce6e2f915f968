"""The goodput benchmark's arithmetic (bench/goodput.py): the failure schedule,
and what a run's worker events say about it (steps redone and the pause per
failure, the effective training time ratio, the time a checkpoint blocks).

Pure functions over the events the worker writes (bench/goodput_worker.py)
and the disruptions the benchmark injected; no process is started here.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]

WORKER_KILL = "worker crash"
NODE_LOSS = "node loss"
REJOIN = "rejoin"  # the restart when the lost node's replacement joins
KINDS = (WORKER_KILL, NODE_LOSS, REJOIN)
# A restart's pause, in order: the worker's phases (bench/goodput_worker.py)
PHASES = (
    ("script", "failure to the new worker's first line (stop, rendezvous, spawn)"),
    ("start", "its imports (and its own setup, --setup-seconds)"),
    ("process_group", "process group"),
    ("model", "data, model, DDP"),
    ("checkpoint", "checkpoint load"),
)


@dataclass(frozen=True)
class Disruption:
    """One failure injected: its kind, when (wall clock), the newest step
    any rank had ended just before it, and what was killed."""

    kind: str
    t: float
    newest: int
    target: str


def schedule(duration: float, kill_every: float, node_every: float) -> list[tuple[float, str]]:
    """The failures of a run, as (seconds after the first step, kind): a
    worker SIGKILL every ``kill_every`` seconds and a node lost every
    ``node_every`` seconds (a node loss replaces the worker kill due at the
    same time); none in the last ``kill_every / 2`` seconds (the restart it
    causes would not be measured). ``0`` turns either off."""
    out: dict[float, str] = {}
    last = duration - kill_every / 2 if kill_every > 0 else duration - node_every / 2
    for every, kind in ((kill_every, WORKER_KILL), (node_every, NODE_LOSS)):
        if every <= 0:
            continue
        for k in itertools.count(1):
            t = round(k * every, 6)
            if t > last:
                break
            out[t] = kind  # the node loss, written second, wins a tie
    return sorted(out.items())


def _rank0(events: list[Event], ev: str) -> list[Event]:
    return sorted((e for e in events if e["ev"] == ev and e["rank"] == 0), key=lambda e: e["t"])


def _resume_kinds(
    resumes: list[Event], disruptions: list[Disruption]
) -> list[tuple[str, Disruption, Event]]:
    """Each restart after the start, with the failure it answers: the first
    restart after a failure is that failure's; a later one before the next
    failure is the lost node's replacement joining (``rejoin``) after a node
    loss, else one more restart of the same failure (counted under it)."""
    out: list[tuple[str, Disruption, Event]] = []
    for i, d in enumerate(disruptions):
        until = disruptions[i + 1].t - 0.5 if i + 1 < len(disruptions) else float("inf")
        mine = [r for r in resumes if d.t - 0.5 <= r["t"] < until]
        for j, r in enumerate(mine):
            kind = d.kind if j == 0 or d.kind != NODE_LOSS else REJOIN
            out.append((kind, d, r))
    return out


def _per_failure(
    steps: list[Event], resumes: list[Event], disruptions: list[Disruption]
) -> dict[str, dict[str, list[float]]]:
    """Per kind: the steps each restart redid (the newest step before it
    minus the step it resumed from) and the training it paused (from the
    failure, or for a rejoin from the last step before it, to the first step
    after the restart); under ``phases``, where each restart's pause went
    (one list per phase, then ``first step``)."""
    out: dict[str, dict[str, list[float]]] = {k: {"redone": [], "pause": []} for k in KINDS}
    phases: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    out["phases"] = phases | {"first step": []}
    for kind, d, r in _resume_kinds(resumes, disruptions):
        before = [e for e in steps if e["t"] < r["t"]]
        newest = max((e["step"] for e in before), default=0)
        since = max((e["t"] for e in before), default=d.t)
        if kind != REJOIN:
            newest, since = max(newest, d.newest), d.t
        out[kind]["redone"].append(max(0, newest - int(r["step"])))
        after = next((e for e in steps if e["t"] >= r["t"]), None)
        if after is None:
            continue
        out[kind]["pause"].append(after["t"] - since)
        times = r.get("phases") or {}
        if all(name in times for name, _ in PHASES):
            # A phase over before the failure (a standby's start and setup,
            # done ahead) paused nothing: 0, and the next counts from the failure.
            prev = since
            for name, _ in PHASES:
                at = max(times[name], prev)
                out["phases"][name].append(at - prev)
                prev = at
            out["phases"]["first step"].append(after["t"] - prev)
    return out


def _useful(steps: list[Event]) -> tuple[int, int]:
    """The newest step reached, and the samples it stands for: each step
    counted once, at the world size of its last run (steps redone count
    once), in units of one rank's batch."""
    world_of: dict[int, int] = {}
    for e in steps:
        world_of[int(e["step"])] = int(e.get("world", 1))
    final = max(world_of, default=0)
    return final, sum(world_of.values())


def summarize(
    events: list[Event], disruptions: list[Disruption], t_end: float = float("inf")
) -> dict[str, Any]:
    """A run's numbers: its newest step by ``t_end``, the samples they stand
    for, per failure kind the steps redone and the pause, and the time a
    checkpoint call blocked the step."""
    steps = [e for e in _rank0(events, "step") if e["t"] <= t_end]
    first = min((e["t"] for e in steps), default=0.0)
    resumes = [e for e in _rank0(events, "resume") if e["t"] > first]
    final, samples = _useful(steps)
    saved = [e for e in steps if e.get("saved")]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(steps) if b["step"] == a["step"] + 1]
    return {
        "final_step": final,
        "samples": samples,
        "failures": {k: sum(d.kind == k for d in disruptions) for k in KINDS},
        "per_failure": _per_failure(steps, resumes, disruptions),
        "checkpoints": len(saved),
        "blocked_s": statistics.mean(e["blocked"] for e in saved) if saved else 0.0,
        "step_compute_s": statistics.median(e["compute"] for e in steps) if steps else 0.0,
        "step_s": statistics.median(gaps) if gaps else 0.0,
        "smaller_world_s": _smaller_world_s(steps),
    }


def _smaller_world_s(steps: list[Event]) -> float:
    """Seconds of training at a world smaller than the largest seen."""
    full = max((int(e.get("world", 1)) for e in steps), default=1)
    return sum(
        float(b["t"]) - float(a["t"])
        for a, b in itertools.pairwise(steps)
        if int(b.get("world", 1)) < full and b["step"] == a["step"] + 1
    )


def _each(values: list[float], fmt: str, unit: str = "") -> str:
    """The mean, then each value: ``1.5 s (1.0, 2.0)``; ``-`` for none."""
    if not values:
        return "-"
    each = ", ".join(fmt.format(v) for v in values)
    return f"{fmt.format(statistics.mean(values))}{unit} ({each})"


def report_lines(runs: dict[str, dict[str, Any]], what: dict[str, str], world: int) -> list[str]:
    """The two tables of the goodput report: the totals, then per failure
    kind the steps redone and the pause."""
    ref = runs["reference"]
    ref_steps, ref_samples = ref["final_step"] or 1, (ref["final_step"] or 1) * world
    lines = [
        "| launcher | checkpoint | worker crashes | node losses | effective training time "
        "ratio (steps) | samples ratio | time at a smaller world | blocked per checkpoint "
        "| share of a step (of its compute) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, how in what.items():
        r = runs[name]
        share = r["blocked_s"] / r["step_s"] if r["step_s"] else 0.0
        of_compute = r["blocked_s"] / r["step_compute_s"] if r["step_compute_s"] else 0.0
        lines.append(
            f"| {name} | {how} | {r['failures'][WORKER_KILL]} | {r['failures'][NODE_LOSS]} "
            f"| {r['final_step'] / ref_steps:.3f} | {r['samples'] / ref_samples:.3f} "
            f"| {r['smaller_world_s']:.1f} s | {r['blocked_s'] * 1e3:.2f} ms "
            f"| {share:.1%} ({of_compute:.1%}) |"
        )
    lines += [
        "",
        "| launcher | steps redone per worker crash (each) | per node loss | on the "
        "replacement's rejoin | pause per worker crash (each) | per node loss | per rejoin |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in what:
        pf = runs[name]["per_failure"]
        redone = [_each(pf[k]["redone"], "{:.1f}") for k in KINDS]
        pause = [_each(pf[k]["pause"], "{:.1f}", " s") for k in KINDS]
        lines.append(f"| {name} | {' | '.join(redone)} | {' | '.join(pause)} |")
    heads = [label for _, label in PHASES] + ["to the first step"]
    lines += [
        "",
        "Where a restart's pause goes (mean over every restart above, seconds):",
        "",
        "| launcher | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for name in what:
        ph = runs[name]["per_failure"]["phases"]
        cells = [f"{statistics.mean(v):.2f}" if v else "-" for v in ph.values()]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines
