"""Where the time of a hot-spare promotion goes, phase by phase.

``python -m bench.spare_phases bench/results/<timestamp>``: for each
``spare_loss`` run of elastrun in that folder, the moments (seconds after the
SIGKILL) at which the agents' event logs (``agent-*.events.jsonl``, written by
the benchmark) and the workers' events (``events.jsonl``) show each phase:

* ``survivor_failing``: the survivor's rank saw its collective break (its
  workers being stopped);
* ``survivor_exited``: that rank's interpreter finished its teardown;
* ``round_opened``: the next round opened (by the survivor's restart request);
* ``spare_joined``: the spare joined it;
* ``survivor_joined``: the survivor joined it (after its failure was reported
  and the job's root cause settled);
* ``round_closed``: the round closed with the spare (it waits for the lost
  node's presence to go, or for the survivor);
* ``workers_started``: both agents forked their workers (the later one);
* ``pg_ready``: both ranks' ``init_process_group()`` returned;
* ``first_step``: both ranks stepped at world 2 (what ``spare_loss`` measures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PHASES = (
    "survivor_failing",
    "survivor_exited",
    "round_opened",
    "spare_joined",
    "survivor_joined",
    "round_closed",
    "workers_started",
    "pg_ready",
    "first_step",
)


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def phases(run_dir: Path, kill_wall: float) -> dict[str, float]:
    """Each phase's moment, in seconds after the kill (absent when not seen)."""
    agent = {n: _lines(run_dir / f"agent-{n}.events.jsonl") for n in "ac"}
    after = {n: [e for e in evs if e.get("ts", 0) >= kill_wall] for n, evs in agent.items()}
    found: dict[str, float] = {}

    def first(name: str, node: str, kind: str) -> None:
        for e in after[node]:
            if e.get("kind") == kind:
                found.setdefault(name, e["ts"] - kill_wall)
                return

    first("survivor_failing", "a", "workers_stopping")
    first("survivor_exited", "a", "worker_exited")
    first("round_opened", "a", "round_opened")
    first("spare_joined", "c", "node_joined")
    first("survivor_joined", "a", "node_joined")
    first("round_closed", "c", "round_closed")
    starts = [
        next((e["ts"] for e in after[n] if e.get("kind") == "workers_started"), None) for n in "ac"
    ]
    if all(s is not None for s in starts):
        found["workers_started"] = max(s for s in starts if s is not None) - kill_wall
    workers = [e for e in _lines(run_dir / "events.jsonl") if e.get("wall", 0) >= kill_wall]
    for name, ev in (("pg_ready", "pg_ready"), ("first_step", "step")):
        seen = {e["node"]: e["wall"] for e in reversed(workers) if e.get("ev") == ev}
        if len(seen) >= 2 and all(int(e.get("world", 0)) == 2 for e in workers if e["ev"] == ev):
            found[name] = max(seen.values()) - kill_wall
    return found


def report(folder: Path) -> str:
    results = json.loads((folder / "results.json").read_text())
    rows = []
    for run in results.get("runs", []):
        info = run.get("info") or {}
        kill = info.get("kill_wall")
        if kill is None:
            continue
        name = f"{run['scenario']}-{run['config']}-rep{run['rep']}"
        got = phases(folder / "runs" / name, float(kill))
        cells = [f"{got[p]:.2f}" if p in got else "-" for p in PHASES]
        rows.append(f"| {name} | " + " | ".join(cells))
    head = "| run | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES)
    return head + "\n" + "\n".join(r + " |" for r in rows)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
