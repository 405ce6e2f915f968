"""Goodput when a node is lost: elastrun's neighbour replica against torchrun
with ``torch.save`` every 50 steps, side by side in one run.

Two nodes on this machine (one worker each, loopback addresses of their own:
``--local-addr``), the realistic worker (bench/goodput_worker.py); at
``--kill-at`` seconds after the first step, the second node vanishes (its
launcher and its workers SIGKILLed at once) and a replacement node is started
at once; training goes on to ``--duration`` seconds. Per launcher:

* ``torchrun``: rank 0 ``torch.save`` every 50 steps into a folder both
  nodes share (as on a shared file system);
* ``elastrun``: every rank ``MemoryCheckpoint.save`` every step, each node's
  agent writing every 50th to its own disk folder and sending every
  ``--replicate-every``-th (default 5) to the next node as a replica.

Reported: the steps redone (the newest step before the loss minus the step
resumed from), the time from the loss to the first step after it (which
includes the replacement's start), and the newest step at the end.

Run: ``python -m bench.goodput_nodes [--duration 60 --kill-at 25]``. Writes
``bench/results/goodput-nodes-<time>/results.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.configs import ELASTRUN_TUNED, TORCHRUN_TUNED, LauncherConfig
from bench.goodput import START_BOUND, WORKER, _events
from bench.harness import kill_tree
from bench.paths import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ADDRS = {"a": "127.0.0.12", "b": "127.0.0.13", "c": "127.0.0.14"}


def start_node(
    cfg: LauncherConfig, name: str, port: int, folder: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    flags = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=goodput-nodes",
        "--max-restarts=10",
        f"--local-addr={ADDRS[name]}",
    ]
    argv = [*cfg.argv(flags, {"is_host": "1" if name == "a" else "0"})[:-1], str(WORKER)]
    log = open(folder / f"launcher-{name}.log", "wb")  # noqa: SIM115 - kept by the process
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **dict(cfg.env), **env},
        start_new_session=True,
        cwd=folder,
    )


def run_one(
    cfg: LauncherConfig, mode: str, folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    events = folder / "events.jsonl"
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def env(name: str) -> dict[str, str]:
        node_dir = folder / (name if mode == "memory" else "shared")
        node_dir.mkdir(exist_ok=True)
        return {
            "GP_MODE": mode,
            "GP_DIR": str(node_dir),
            "GP_EVENTS": str(events),
            "GP_REPLICATE": str(args.replicate_every),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        }

    try:
        for name in ("a", "b"):
            procs.append(start_node(cfg, name, port, folder, env(name)))
            time.sleep(0.5)  # a hosts the store
        deadline = time.monotonic() + START_BOUND
        while not any(e["ev"] == "step" for e in _events(events)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cfg.name}: no step within {START_BOUND:.0f}s")
            time.sleep(0.1)
        t_first = time.monotonic()
        time.sleep(max(0.0, t_first + args.kill_at - time.monotonic()))
        newest = max(e["step"] for e in _events(events) if e["ev"] == "step")
        t_kill = time.time()
        kill_tree([procs[1].pid])
        procs.append(start_node(cfg, "c", port, folder, env("c")))
        time.sleep(max(0.0, t_first + args.duration - time.monotonic()))
    finally:
        kill_tree([p.pid for p in procs])
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
    evs = _events(events)
    resumed = [e for e in evs if e["ev"] == "resume" and e["t"] >= t_kill]
    t_resume = min((e["t"] for e in resumed), default=float("inf"))
    after = [e for e in evs if e["ev"] == "step" and e["t"] >= t_resume and e["rank"] == 0]
    first_after = min(after, key=lambda e: e["t"], default=None)
    resumed_steps = sorted({int(e["step"]) for e in resumed})
    return {
        "newest_before": newest,
        "resumed": resumed_steps,
        "redone": newest - resumed_steps[-1] if resumed_steps else None,
        "blocked_s": None if first_after is None else first_after["t"] - t_kill,
        "final_step": max((e["step"] for e in evs if e["ev"] == "step"), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--kill-at", type=float, default=25.0)
    p.add_argument("--replicate-every", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or REPO / "bench" / "results" / f"goodput-nodes-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = {
        "torchrun": run_one(TORCHRUN_TUNED, "torchsave", out / "torchrun", args),
        "elastrun": run_one(ELASTRUN_TUNED, "memory", out / "elastrun", args),
    }
    lines = [
        "# Goodput when a node is lost",
        "",
        "2 nodes x 1 worker, the second node SIGKILLed (launcher and workers) "
        f"{args.kill_at:.0f} s after the first step and a replacement started; "
        f"{args.duration:.0f} s in all; machine: "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}.",
        "",
        "| launcher | checkpoint | newest step before the loss | resumed from | steps redone "
        "| loss to the first step after | newest step at the end |",
        "|---|---|---|---|---|---|---|",
    ]
    what = {
        "torchrun": "torch.save every 50 steps",
        "elastrun": f"memory every step, replica every {args.replicate_every}",
    }
    for name, r in runs.items():
        blocked = "-" if r["blocked_s"] is None else f"{r['blocked_s']:.1f} s"
        lines.append(
            f"| {name} | {what[name]} | {r['newest_before']} | {r['resumed']} | {r['redone']} "
            f"| {blocked} | {r['final_step']} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(runs, indent=1))
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
