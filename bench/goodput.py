"""Goodput under failures: elastrun's memory checkpoints against torchrun with
``torch.save`` every 50 steps, side by side in one run, and the time one
checkpoint of 1 GiB keeps training waiting.

Three runs of the same realistic worker (bench/goodput_worker.py), 2 workers
on this machine, each for ``--duration`` seconds of training:

* ``reference``: torchrun, no checkpoint, no failure: the steps a
  failure-free run makes in that time;
* ``torchrun``: torchrun (tuned as in bench/configs.py), rank 0 ``torch.save``
  every 50 steps;
* ``elastrun``: elastrun (tuned), every rank ``MemoryCheckpoint.save`` every
  step (the agent writes every 50th to disk);

in the last two, local rank 1 is SIGKILLed every ``--kill-every`` seconds
(a fixed schedule from the first step). Reported per launcher:

* effective training time ratio: the newest step reached at the end, over the
  reference's (1.0: no time lost to failures or checkpoints);
* steps redone per failure: the newest step before the kill minus the step
  resumed from;
* training blocked per checkpoint: the mean time a checkpoint call kept the
  step waiting, as a share of a step (the median time from one step's end to
  the next's: ``GP_INTERVAL`` when the compute is shorter) and of a step's
  compute alone.

``--blocked-mib`` (default 1024): one process saves a state of that size
(one float32 tensor) four times with ``MemoryCheckpoint.save`` into a
private folder in /dev/shm (the first save allocates the slot, later ones
reuse theirs; each after the previous one's background hash is done, as
when a training step lies between them) and with ``torch.save`` to a file
on local disk; reported: the time each call blocked, and the ratio.

``--replica-mib`` (default 256): the cost of a neighbour replica, one snapshot
of that size saved with ``MemoryCheckpoint.save`` and sent by
``elastrun.agent.replica.send_snapshot`` to a real replica port on loopback
(the agent's code on both ends, with a key): the time the transfer takes and
its throughput (the network between two nodes is slower than loopback;
this is the floor of what the agent's background thread spends per marked
snapshot).

Node loss (several nodes and a replacement node): bench/goodput_nodes.py.

Run: ``python -m bench.goodput [--duration 90 --kill-every 30 --blocked-mib 1024]``
(part of ``make bench``). Writes ``bench/results/goodput-<time>/results.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.configs import ELASTRUN_TUNED, TORCHRUN_TUNED, LauncherConfig
from bench.harness import kill_tree
from bench.paths import REPO

WORKER = REPO / "bench" / "goodput_worker.py"
START_BOUND = 120.0  # s from launch to the first step
NPROC = 2


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _victim(events: list[dict[str, Any]]) -> int | None:
    """The pid of local rank 1's current worker (rank 1 on one node)."""
    resumes = [e for e in events if e["ev"] == "resume" and e["rank"] == 1]
    return int(resumes[-1]["pid"]) if resumes else None


def run_one(
    name: str, cfg: LauncherConfig, mode: str, folder: Path, duration: float, kill_every: float
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    events = folder / "events.jsonl"
    flags = ["--standalone", f"--nproc-per-node={NPROC}", "--max-restarts=100"]
    argv = [*cfg.argv(flags)[:-1], str(WORKER)]
    env = {
        **os.environ,
        **dict(cfg.env),
        "GP_MODE": mode,
        "GP_DIR": str(folder),
        "GP_EVENTS": str(events),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
    }
    with open(folder / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=folder
        )
    kills: list[tuple[float, int]] = []  # (time, newest step before the kill)
    try:
        deadline = time.monotonic() + START_BOUND
        while not [e for e in _events(events) if e["ev"] == "step"]:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{name}: no step within {START_BOUND:.0f}s (see launcher.log)")
            time.sleep(0.1)
        t_first = time.monotonic()
        next_kill = t_first + kill_every if kill_every > 0 else float("inf")
        end = t_first + duration
        while time.monotonic() < end:
            time.sleep(0.05)
            if next_kill <= time.monotonic() < end - 1.0:  # none in the run's last second
                evs = _events(events)
                pid = _victim(evs)
                newest = max((e["step"] for e in evs if e["ev"] == "step"), default=0)
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    kills.append((time.time(), newest))
                next_kill += kill_every
    finally:
        kill_tree([proc.pid])
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    return summarize(_events(events), kills)


def summarize(events: list[dict[str, Any]], kills: list[tuple[float, int]]) -> dict[str, Any]:
    steps = [e for e in events if e["ev"] == "step" and e["rank"] == 0]
    resumes = [e for e in events if e["ev"] == "resume" and e["rank"] == 0 and e["restart"] > 0]
    redone = []
    for t_kill, newest in kills:
        after = [e for e in resumes if e["t"] >= t_kill - 1.0]
        if after:
            redone.append(max(0, newest - int(after[0]["step"])))
    saved = [e for e in steps if e.get("saved")]
    compute = statistics.median(e["compute"] for e in steps) if steps else 0.0
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(steps) if b["step"] == a["step"] + 1]
    interval = statistics.median(gaps) if gaps else 0.0
    blocked = statistics.mean(e["blocked"] for e in saved) if saved else 0.0
    return {
        "final_step": max((e["step"] for e in steps), default=0),
        "failures": len(kills),
        "resumed": len(resumes),
        "steps_redone": redone,
        "checkpoints": len(saved),
        "blocked_s": blocked,
        "step_compute_s": compute,
        "step_s": interval,
    }


def blocked_1g(mib: int, folder: Path) -> dict[str, float]:
    """The time one checkpoint of ``mib`` MiB blocks: memory vs torch.save."""
    code = f"""
import json, os, sys, time, torch
from elastrun.train import MemoryCheckpoint
state = {{"w": torch.randn({mib} << 18)}}
mem = MemoryCheckpoint(log=None)
times = []
for step in range(4):
    mem.wait()  # the previous save's hash done, as after a training step
    mem.save(state, step=step)
    times.append(mem.last_blocked_s)
mem.close()
disk = []
for step in range(2):
    path = sys.argv[1] + f"/ckpt-{{step}}.pt"
    t0 = time.perf_counter()
    torch.save(state, path + ".tmp"); os.replace(path + ".tmp", path)
    disk.append(time.perf_counter() - t0)
print(json.dumps({{"memory_first": times[0], "memory": min(times[1:]), "torch_save": min(disk)}}))
"""
    shm = tempfile.mkdtemp(prefix="elastrun-goodput-", dir="/dev/shm")
    env = {**os.environ, "ELASTRUN_MEMORY_CHECKPOINT_DIR": shm, "PYTHONPATH": str(REPO / "src")}
    folder.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        for p in folder.glob("ckpt-*"):
            p.unlink()
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def replica_transfer(mib: int) -> dict[str, float]:
    """One snapshot of ``mib`` MiB sent to a real replica port on loopback."""
    code = f"""
import asyncio, json, os, tempfile, threading, time, torch
from elastrun.agent.replica import ReplicaHold, replica_key, send_snapshot
from elastrun.safefs import private_dir
from elastrun.train import MemoryCheckpoint
from elastrun.worker.snapshot import open_slot, slot_names
mem = MemoryCheckpoint(log=None)
mem.save({{"w": torch.randn({mib} << 18)}}, step=1)
mem.close()
folder = os.environ["ELASTRUN_MEMORY_CHECKPOINT_DIR"]
path = max((os.path.join(folder, n) for n in slot_names(folder)), key=os.path.getsize)
key = replica_key("bench-token", "bench")
loop = asyncio.new_event_loop()
hold = ReplicaHold(private_dir(os.path.join(folder, "replica")), run="bench", key=key,
                   max_bytes=1 << 40)
port = loop.run_until_complete(hold.serve("127.0.0.1"))
threading.Thread(target=loop.run_forever, daemon=True).start()
view = open_slot(path)
t0 = time.perf_counter()
send_snapshot(("127.0.0.1", port), view, run="bench", node="bench", key=key)
took = time.perf_counter() - t0
print(json.dumps({{"bytes": view.size, "seconds": took}}))
view.close()
"""
    shm = tempfile.mkdtemp(prefix="elastrun-goodput-", dir="/dev/shm")
    env = {**os.environ, "ELASTRUN_MEMORY_CHECKPOINT_DIR": shm, "PYTHONPATH": str(REPO / "src")}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def report(
    runs: dict[str, dict[str, Any]],
    blocked: dict[str, float] | None,
    args: argparse.Namespace,
    replica: dict[str, float] | None = None,
) -> str:
    ref = runs["reference"]["final_step"] or 1
    lines = [
        "# Goodput under failures",
        "",
        f"{NPROC} workers, {args.duration:.0f} s of training per run, local rank 1 SIGKILLed "
        f"every {args.kill_every:.0f} s; machine: {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}. Reference (torchrun, no checkpoint, no failure): "
        f"{runs['reference']['final_step']} steps.",
        "",
        "| launcher | checkpoint | failures | effective training time ratio | steps redone "
        "per failure (each) | blocked per checkpoint | share of a step (of its compute) |",
        "|---|---|---|---|---|---|---|",
    ]
    what = {"torchrun": "torch.save every 50 steps", "elastrun": "memory, every step"}
    for name in ("torchrun", "elastrun"):
        r = runs[name]
        redone = r["steps_redone"]
        mean = f"{statistics.mean(redone):.1f} ({', '.join(map(str, redone))})" if redone else "-"
        share = r["blocked_s"] / r["step_s"] if r["step_s"] else 0.0
        of_compute = r["blocked_s"] / r["step_compute_s"] if r["step_compute_s"] else 0.0
        lines.append(
            f"| {name} | {what[name]} | {r['failures']} | {r['final_step'] / ref:.3f} | {mean} | "
            f"{r['blocked_s'] * 1e3:.2f} ms | {share:.1%} ({of_compute:.1%}) |"
        )
    if blocked is not None:
        lines += [
            "",
            f"One checkpoint of {args.blocked_mib} MiB (one float32 tensor), time the call blocks:",
            "",
            "| torch.save to local disk | memory, first save (allocates) | memory, later saves "
            "| memory / torch.save |",
            "|---|---|---|---|",
            f"| {blocked['torch_save']:.2f} s | {blocked['memory_first']:.2f} s | "
            f"{blocked['memory']:.2f} s | {blocked['memory'] / blocked['torch_save']:.2f}x |",
        ]
    if replica is not None:
        lines += ["", replica_line(replica)]
    return "\n".join(lines) + "\n"


def replica_line(r: dict[str, float]) -> str:
    mib = r["bytes"] / 2**20
    return (
        f"A neighbour replica: one snapshot of {mib:.0f} MiB sent to a replica port on loopback "
        f"(signed, hashed on both ends) in {r['seconds']:.2f} s ({mib / r['seconds']:.0f} MiB/s), "
        "in the agent's background thread."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=90.0, help="seconds of training per run")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between worker kills")
    p.add_argument("--blocked-mib", type=int, default=1024, help="state size (0: skip)")
    p.add_argument("--replica-mib", type=int, default=256, help="replica size (0: skip)")
    p.add_argument("--replica-only", action="store_true", help="measure the replica only")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    args = p.parse_args(argv)
    replica = replica_transfer(args.replica_mib) if args.replica_mib > 0 else None
    if args.replica_only:
        print(replica_line(replica) if replica else "nothing measured")
        return 0
    out = args.out or REPO / "bench" / "results" / f"goodput-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = {
        "reference": run_one(
            "reference", TORCHRUN_TUNED, "none", out / "reference", args.duration, 0
        ),
        "torchrun": run_one(
            "torchrun",
            TORCHRUN_TUNED,
            "torchsave",
            out / "torchrun",
            args.duration,
            args.kill_every,
        ),
        "elastrun": run_one(
            "elastrun", ELASTRUN_TUNED, "memory", out / "elastrun", args.duration, args.kill_every
        ),
    }
    blocked = blocked_1g(args.blocked_mib, out / "blocked") if args.blocked_mib > 0 else None
    text = report(runs, blocked, args, replica)
    (out / "results.md").write_text(text)
    results = {"runs": runs, "blocked": blocked, "replica": replica}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
