"""The goodput figure the agents account against an outside measurement.

Two runs of bench's realistic worker (bench/goodput_worker.py) under
elastrun (tuned, bench/configs.py) on ``--nodes`` nodes (default 2, one
worker each), each for ``--duration`` seconds (default 60) from the first
step at the full world, set up as bench/goodput.py sets them (its ``Run``):

* ``reference``: no failure and no checkpoint: the steps a failure-free run
  makes in that time (what goodput is the share of);
* ``faulty``: memory checkpoints every step, and a worker SIGKILLed every
  ``--kill-every`` seconds (default 10).

The worker's compute is padded to ``--interval`` seconds (default 0.1:
``GP_PACE=compute``; the pause stands in for a GPU's compute, so that the
step rate follows the machine's load as little as can be) and its checkpoint
call comes on top, as in a compute-bound script: a save costs the time it
blocks, which the agents count as lost (``saves``). Paced the other way
(whole steps, bench/goodput.py's default), a save hides in the pause and
costs no step, while the agents still count its time: the raw figures then
differ by the saves' share.

Both runs share this machine with whatever else runs: steps slowed by a load
that only one run met (compute past the interval) move the outside figure,
not the inside one (slow training is training). The report says how many
seconds each run's steps ran past the interval, so that such a run can be
told apart.

At the end every launcher is sent SIGTERM (the agents then account their
time to the end: the ``goodput`` event of agent/goodput.py), then killed
with what is left. Reported:

* outside: the faulty run's newest step over the reference's (useful steps
  against a failure-free run of the same length), and per node the steps its
  rank made over the reference's (a rank that trains alone while its peer
  restarts makes steps the other does not);
* inside: the figure each agent accounted (its ``goodput`` event), with its
  causes; group rank 0's (node ``a``, which hosts the store) is the job's,
  the one ``elastrun status`` shows;
* the difference from the node's own outside figure, in points (the target:
  within 2).

Run: ``python -m bench.goodput_accounting [--duration 60 --kill-every 10]``
(about 3 minutes; ``--quick``: 30 s runs, about 2 minutes). Writes
``bench/results/goodput-accounting-<time>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.configs import ELASTRUN_TUNED
from bench.goodput import Run, _events, _inject, _wait_full_world
from bench.goodput_summary import WORKER_KILL, schedule, summarize
from bench.paths import REPO

TERM_BOUND = 30.0  # s the agents get to end after SIGTERM


def _agent_figures(folder: Path) -> dict[str, dict[str, Any]]:
    """Each node's last ``goodput`` event (node name -> its fields)."""
    out = {}
    for path in sorted(folder.glob("agent-*.events.jsonl")):
        node = path.name.split("-")[1].split(".")[0]
        for e in _events(path):
            if e.get("kind") == "goodput":
                out[node] = e
    return out


def run_one(name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run: kills on the schedule (none for the reference), SIGTERM at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    mode = "none" if name == "reference" else "memory"
    run = Run(ELASTRUN_TUNED, mode, folder, args, pace="compute", interval=args.interval)
    plan = [] if name == "reference" else schedule(args.duration, args.kill_every, 0)
    try:
        for node in (chr(ord("a") + i) for i in range(args.nodes)):
            run.start(node)
        t_first = _wait_full_world(run, args.nodes * args.nproc)
        start = time.monotonic() - (time.time() - t_first)
        kills = 0
        for at, kind in plan:
            time.sleep(max(0.0, start + at - time.monotonic()))
            _inject(run, kind, kills)
            kills += kind == WORKER_KILL
        time.sleep(max(0.0, start + args.duration - time.monotonic()))
        t_end = time.time()
        for proc in run.nodes.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        for proc in run.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(TERM_BOUND)
    finally:
        run.stop_all()
    events = _events(run.events)
    numbers = summarize(events, run.disruptions, t_end)
    numbers["agents"] = _agent_figures(folder)
    numbers["node_steps"] = node_steps(events, t_end)
    numbers["slow_s"] = slow_seconds(events, t_end, args.interval)
    return numbers


def slow_seconds(events: list[dict[str, Any]], t_end: float, interval: float) -> float:
    """The seconds the steps' compute ran past ``interval`` (the machine's
    load), per rank, the largest."""
    over: dict[int, float] = {}
    for e in events:
        if e["ev"] == "step" and e["t"] <= t_end:
            r = int(e["rank"])
            over[r] = over.get(r, 0.0) + max(0.0, float(e["compute"]) - interval)
    return max(over.values(), default=0.0)


def node_steps(events: list[dict[str, Any]], t_end: float) -> dict[str, int]:
    """The steps each node's rank made by ``t_end`` (its rank: the one of its
    newest start; ranks are sticky). A rank that trains alone while its peer
    restarts makes steps the other does not."""
    rank_of = {str(e["node"]): int(e["rank"]) for e in events if e["ev"] == "resume"}
    return {
        node: sum(1 for e in events if e["ev"] == "step" and e["rank"] == r and e["t"] <= t_end)
        for node, r in rank_of.items()
    }


def report(ref: dict[str, Any], faulty: dict[str, Any], args: argparse.Namespace) -> str:
    outside = faulty["final_step"] / max(1, ref["final_step"])
    lines = [
        f"# Goodput accounted against measured ({args.nodes} nodes, {args.duration:.0f} s, "
        f"a worker SIGKILLed every {args.kill_every:g} s, memory checkpoints every step, "
        f"{1000 * args.interval:g} ms of compute per step; "
        "the reference: neither)",
        "",
        f"outside: {faulty['final_step']} steps against {ref['final_step']} failure-free "
        f"= {100 * outside:.1f}%; steps slowed past the interval by the load: "
        f"{faulty['slow_s']:.1f} s (faulty), {ref['slow_s']:.1f} s (reference)",
        "",
        "| node | run | accounted goodput | its rank's steps against the reference's "
        "| difference (points) | failures | steps redone | seconds per cause |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run_name, numbers in (("reference", ref), ("faulty", faulty)):
        for node, e in sorted(numbers["agents"].items()):
            g = e.get("goodput")
            mine = numbers["node_steps"].get(node, 0) / max(1, ref["node_steps"].get(node, 1))
            diff = "-" if g is None else f"{100 * (g - mine):+.1f}"
            causes = ", ".join(f"{k} {v:.1f}" for k, v in sorted(e["seconds"].items()))
            shown = "-" if g is None else f"{100 * g:.1f}%"
            lines.append(
                f"| {node} | {run_name} | {shown} | {100 * mine:.1f}% | {diff} | "
                f"{e['failures']} | {e['steps_redone']} | {causes} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of training per run")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between worker kills")
    p.add_argument("--nodes", type=int, default=2, help="nodes (loopback addresses), 2 to 8")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--interval", type=float, default=0.1, help="seconds of compute per step")
    p.add_argument("--quick", action="store_true", help="30 s runs (a kill every 10 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 30.0
    # What bench/goodput.py's Run reads besides.
    args.nproc, args.min_nodes, args.per_rank, args.replicate_every = 1, 0, False, 5
    args.setup_seconds = 0.0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "bench" / "results" / f"goodput-accounting-{stamp}"
    ref = run_one("reference", out / "reference", args)
    faulty = run_one("faulty", out / "faulty", args)
    text = report(ref, faulty, args)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"reference": ref, "faulty": faulty}, indent=1))
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
