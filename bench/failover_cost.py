"""What the store's candidate hosts cost a job with no failure
(docs/failover.md; the target: cold start and worker-crash recovery within 5 %
of a single endpoint's).

The same job, run with one ``--rdzv-endpoint`` (the first agent hosts the
store, ``is_host``) and with a list of three candidate hosts (each agent a
candidate by its ``--local-addr``: 127.0.0.1, .2, .3), in turn within each
repetition, the order swapped every other repetition (A B, B A, ...) so that
slow drifts of a loaded machine hit both alike. Three elastrun agents at
their defaults, ``--nnodes=3``, one worker each: the realistic benchmark
worker (bench/bench_worker.py: a model under DDP on gloo, an optimizer, a
data loader, checkpoints), each run with its own empty module cache.

Measured per run (seconds, one machine's monotonic clock):

* ``cold_start``: the first agent's launch to every rank's first step at
  world 3;
* ``crash_resumed``: a worker (rank 1) SIGKILLed after a few seconds of
  training, to every rank's first step after the restart;
* ``cold_workers_started``, ``crash_workers_started``: the same two, to the
  last agent's ``workers_started`` event (the launcher's part: rendezvous
  and store, and the wait for the warm interpreters, without the workers'
  own start, torch's import and gloo's init);
* ``cold_rendezvous``: the last agent's ``agent_started`` to the last
  agent's ``round_joined`` (the election of the store's host, then the
  rendezvous); ``crash_rendezvous``: the kill to the last agent's
  ``round_joined`` of the next round. What the candidate list can change,
  without the warm interpreters' preload (torch's import: CPU-bound, the
  noise of a loaded machine).

Reported: each mode's median and the ratio ``candidates / single`` of the
medians and of each repetition's pair, with the machine's load average at
each run (other work on the machine shows there).

Usage: python -m bench.failover_cost [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.base import Settings, count_steps, launcher_env, steps_after
from bench.configs import ELASTRUN_DEFAULT
from bench.harness import Run, all_ranks_time, free_port
from bench.paths import BenchFailure

ADDRS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
MODES = ("single", "candidates")
METRICS = (
    "cold_start",
    "crash_resumed",
    "cold_workers_started",
    "crash_workers_started",
    "cold_rendezvous",
    "crash_rendezvous",
)


def argv(mode: str, port: int, i: int, events: Path) -> list[str]:
    cfg = ELASTRUN_DEFAULT
    if mode == "single":
        endpoint, conf = f"{ADDRS[0]}:{port}", {"is_host": "1" if i == 0 else "0"}
    else:
        endpoint, conf = ",".join(f"{a}:{port}" for a in ADDRS), {}
    return cfg.argv(
        [
            f"--nnodes={len(ADDRS)}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id=cost{port}",
            f"--local-addr={ADDRS[i]}",
            "--max-restarts=3",
            f"--events-file={events}",
        ],
        conf,
    )


def one_run(mode: str, folder: Path, s: Settings) -> dict[str, float]:
    """One job: its cold start and its recovery from a worker's SIGKILL."""
    world = len(ADDRS)
    run = Run(folder, {"BENCH_STEP_INTERVAL": str(s.step_interval), "BENCH_TARGET_STEP": "0"})
    out: dict[str, float] = {"load1": os.getloadavg()[0]}
    try:
        port = free_port()
        env = launcher_env(ELASTRUN_DEFAULT)
        agents = [
            run.start_agent(
                f"agent-{i}",
                argv(mode, port, i, folder / f"agent-{i}.events.jsonl"),
                {**env, "BENCH_NODE": f"n{i}"},
            )
            for i in range(world)
        ]
        wall_first = time.time() - (time.monotonic() - min(a.t_launch for a in agents))
        t_first = min(a.t_launch for a in agents)
        t3 = run.wait(
            "training at world 3",
            lambda log: steps_after(log, 0.0, world),
            s.start_timeout,
            alive=agents,
        )
        out["cold_start"] = t3 - t_first
        run.wait(
            f"{s.crash_steps} steps",
            lambda log: count_steps(log, world) >= world * s.crash_steps,
            s.phase_timeout,
            alive=agents,
            stall=s.restart_stall,
        )
        victim = int(run.log.select("start", rank=1)[-1]["pid"])
        t_kill, wall_kill = time.monotonic(), time.time()
        os.kill(victim, signal.SIGKILL)
        t_back = run.wait(
            "every rank's first step after the restart",
            lambda log: all_ranks_time(
                [e for e in log.select("step", after=t_kill) if int(e["restart"]) >= 1], world
            ),
            s.phase_timeout,
            alive=agents,
            stall=s.restart_stall,
        )
        out["crash_resumed"] = t_back - t_kill
        run.stop()
        run.wait_exit(agents, s.exit_timeout)
        logs = [agent_events(folder / f"agent-{i}.events.jsonl") for i in range(world)]
        started = [[e["ts"] for e in log if e["kind"] == "workers_started"] for log in logs]
        out["cold_workers_started"] = max(min(ts) for ts in started) - wall_first
        after = max(min(t for t in ts if t > wall_kill) for ts in started)
        out["crash_workers_started"] = after - wall_kill
        joined = [[e for e in log if e["kind"] == "round_joined"] for log in logs]
        up = max(e["ts"] for log in logs for e in log if e["kind"] == "agent_started")
        out["cold_rendezvous"] = max(j[0]["ts"] for j in joined) - up
        again = max(min(e["ts"] for e in j if e["ts"] > wall_kill) for j in joined)
        out["crash_rendezvous"] = again - wall_kill
    finally:
        run.cleanup()
    return out


def agent_events(path: Path) -> list[dict[str, Any]]:
    """An agent's event log (``ts``: wall clock)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ratios(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    by_mode = {m: [r[metric] for r in runs if r["mode"] == m and metric in r] for m in MODES}
    if not all(by_mode.values()):
        return {"error": "no measurement in a mode"}
    med = {m: statistics.median(v) for m, v in by_mode.items()}
    pairs: dict[int, dict[str, float]] = {}
    for r in runs:
        if metric in r:
            pairs.setdefault(r["rep"], {})[r["mode"]] = r[metric]
    per_rep = [p["candidates"] / p["single"] for p in pairs.values() if len(p) == 2]
    return {
        "median_single": med["single"],
        "median_candidates": med["candidates"],
        "ratio_of_medians": med["candidates"] / med["single"],
        "ratio_per_rep": per_rep,
        "median_ratio_per_rep": statistics.median(per_rep) if per_rep else None,
        "single": by_mode["single"],
        "candidates": by_mode["candidates"],
    }


def _terminate(signum: int, _frame: object) -> None:
    # SIGTERM/SIGHUP as an exception: every run's cleanup still stops its agents.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv_: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    p = argparse.ArgumentParser(prog="python -m bench.failover_cost", description=__doc__)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the results here (JSON)")
    args = p.parse_args(argv_)
    s = Settings()
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="failover-cost-") as d:
        for rep in range(args.reps):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                try:
                    got = one_run(mode, Path(d) / f"{mode}-{rep}", s)
                except BenchFailure as exc:
                    failures.append(f"rep {rep} {mode}: {exc}")
                    print(f"rep {rep} {mode}: FAILED {exc}", flush=True)
                    continue
                runs.append({"rep": rep, "mode": mode, **got})
                vals = " ".join(f"{k}={v:.2f}" for k, v in got.items())
                print(f"rep {rep} {mode:<10} {vals}", flush=True)
    result: dict[str, Any] = {
        "runs": runs,
        "failures": failures,
        **{metric: ratios(runs, metric) for metric in METRICS},
        "cpus": os.cpu_count(),
    }
    for metric in METRICS:
        r = result[metric]
        if "error" not in r:
            print(
                f"{metric}: single {r['median_single']:.2f} s, candidates "
                f"{r['median_candidates']:.2f} s, ratio of medians {r['ratio_of_medians']:.3f}, "
                f"median of per-rep ratios {r['median_ratio_per_rep']:.3f}"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
