"""Goodput under failures: elastrun's memory checkpoints against torchrun with
``torch.save`` every 50 steps, side by side in one run, and the time one
checkpoint of 1 GiB keeps training waiting.

Three runs of the same realistic worker (bench/goodput_worker.py), each on
``--nodes`` nodes (default 2; each an agent of its own with a loopback
address of its own, ``--local-addr``, one worker each: ``--nproc``),
``--nnodes=N-1:N`` (``--min-nodes``), ``--max-restarts=100``, node ``a``
hosting the rendezvous, each for ``--duration`` seconds (default 120) from
the first step at the full world:

* ``reference``: torchrun, no checkpoint, no failure: the steps a
  failure-free run makes in that time;
* ``torchrun``: torchrun (tuned as in bench/configs.py), rank 0 ``torch.save``
  every 50 steps into a folder all nodes share (as on a shared file system),
  every rank loads it at start: what users do today;
* ``elastrun``: elastrun (tuned), every rank ``MemoryCheckpoint.save`` every
  step (each node's agent writes every 50th to its own disk folder and sends
  every ``--replicate-every``-th to the next node as a replica).

In the last two, failures on one fixed schedule from the first step
(:func:`bench.goodput_summary.schedule`): a worker SIGKILLed every
``--kill-every`` seconds (default 30; the live workers in rank order, round
robin) and a node lost every ``--node-every`` seconds (default 90; its
launcher and its workers SIGKILLed at once, as when a machine vanishes,
then started again at once, as a scheduler restarts a pod; never node ``a``,
which hosts the rendezvous). Reported per launcher:

* effective training time ratio: the newest step reached at the end, over the
  reference's (1.0: no time lost to failures or checkpoints); the samples
  ratio counts each step at the world size it ran at (a step at a smaller
  world trains on fewer samples);
* per worker crash, node loss and rejoin (the restart when the restarted
  node joins again): the steps redone (the newest step before it minus the
  step resumed from) and the training paused (to the first step after it);
* training blocked per checkpoint: the mean time a checkpoint call kept the
  step waiting, as a share of a step (the median time from one step's end to
  the next's: ``GP_INTERVAL`` when the compute is shorter) and of a step's
  compute alone.

Every launcher started is SIGKILLed at the end of its run, with its process
group and those of all its descendants, and then every worker the run
recorded that is still alive (by pid), also when the run fails.

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

``--setup-heavy``: the setup-heavy worker under a worker SIGKILL every 10 s
(``--kill-every``; no node loss) for 60 s (``--duration``): each process
does ``--setup-seconds`` (3) of CPU work once before it trains (a script's
own setup: data, model, compilation), and a fourth run, ``elastrun
--in-process``, trains in ``elastrun.train.in_process`` (docs/in_process.md):
the ranks whose processes survive a kill enter the training again without
their setup. Goodput: each run's steps over the failure-free reference's.

Run: ``python -m bench.goodput [--duration 120 --kill-every 30 --node-every 90]``
(part of ``make bench``; about 8 minutes); ``--quick``: 40 s runs, a worker
kill at 12 s and a node loss at 24 s, small states (about 3 minutes), a smoke
check. Writes ``bench/results/goodput-<time>/results.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.configs import ELASTRUN_TUNED, TORCHRUN_TUNED, LauncherConfig
from bench.goodput_summary import (
    NODE_LOSS,
    WORKER_KILL,
    Disruption,
    report_lines,
    schedule,
    summarize,
)
from bench.harness import free_port, kill_tree
from bench.paths import REPO

WORKER = REPO / "bench" / "goodput_worker.py"
START_BOUND = 120.0  # s from launch to the first step at the full world
STOP_BOUND = 10.0  # s a killed launcher gets to be reaped
HOST = "a"


@dataclass
class Run:
    """One launcher's run: its nodes (name -> the launcher now running as
    that node), every launcher ever started, and the failures injected."""

    cfg: LauncherConfig
    mode: str
    folder: Path
    args: argparse.Namespace
    port: int = field(default_factory=free_port)
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    disruptions: list[Disruption] = field(default_factory=list)
    in_process: bool = False  # the worker trains in elastrun.train.in_process
    pace: str = "step"  # the worker's GP_PACE
    interval: float = 0.05  # the worker's GP_INTERVAL (s)

    @property
    def events(self) -> Path:
        return self.folder / "events.jsonl"

    def node_env(self, name: str) -> dict[str, str]:
        # elastrun: each node its own disk; torchrun: one folder all share
        node_dir = self.folder / (name if self.mode == "memory" else "shared")
        node_dir.mkdir(parents=True, exist_ok=True)
        return {
            **dict(self.cfg.env),
            "GP_MODE": self.mode,
            "GP_DIR": str(node_dir),
            "GP_EVENTS": str(self.events),
            "GP_NODE": name,
            "GP_SHARED": "0" if self.args.per_rank else "1",
            "GP_REPLICATE": str(self.args.replicate_every),
            "GP_SETUP": str(self.args.setup_seconds),
            "GP_IN_PROCESS": "1" if self.in_process else "0",
            "GP_PACE": self.pace,
            "GP_INTERVAL": str(self.interval),
            # the nodes share this machine's cores: one thread per worker
            # (elastrun's default; torchrun sets it only with several
            # workers per node), else each worker oversubscribes the CPUs
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        }

    def start(self, name: str) -> None:
        """Start (or start again, as a scheduler would) the node ``name``."""
        a = self.args
        low = a.min_nodes if a.min_nodes > 0 else max(1, a.nodes - 1)
        flags = [
            f"--nnodes={low}:{a.nodes}" if low < a.nodes else f"--nnodes={a.nodes}",
            f"--nproc-per-node={a.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=goodput",
            "--max-restarts=100",
            f"--local-addr={address(name)}",
        ]
        if self.cfg.launcher == "elastrun":  # where the time goes, per agent
            flags.append(f"--events-file={self.folder / f'agent-{name}.events.jsonl'}")
        argv = [*self.cfg.argv(flags, {"is_host": "1" if name == HOST else "0"})[:-1], str(WORKER)]
        n = sum(1 for p in self.folder.glob(f"launcher-{name}*.log"))
        with open(self.folder / f"launcher-{name}{'.' + str(n) if n else ''}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.node_env(name)},
                start_new_session=True,
                cwd=self.folder,
            )
        self.nodes[name] = proc
        self.started.append(proc)

    def stop_all(self) -> None:
        """SIGKILL every launcher started and all their descendants, then
        any worker of this run still alive (by pid, checked to be ours)."""
        kill_tree([p.pid for p in self.started])
        for p in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(STOP_BOUND)
        for e in _events(self.events):
            if e["ev"] == "resume" and _is_ours(int(e["pid"]), self.events):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(e["pid"]), signal.SIGKILL)


def address(name: str) -> str:
    """A node's own loopback address (``--local-addr``)."""
    return f"127.0.0.{20 + ord(name) - ord('a')}"


def _is_ours(pid: int, events: Path) -> bool:
    """Whether ``pid`` is a live worker writing to ``events`` (a pid reused
    by another process is not)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"GP_EVENTS={events}".encode() in environ.split(b"\0")


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _wait_full_world(run: Run, world: int) -> float:
    """Wall time of the first step at the full world (bounded)."""
    deadline = time.monotonic() + START_BOUND
    while True:
        full = [e for e in _events(run.events) if e["ev"] == "step" and e["world"] == world]
        if full:
            return min(e["t"] for e in full)  # type: ignore[no-any-return]
        dead = [n for n, p in run.nodes.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"node {dead[0]} exited" if dead else f"no step within {START_BOUND:.0f}s"
            raise RuntimeError(f"{run.cfg.name}: {why} (see {run.folder}/launcher-*.log)")
        time.sleep(0.1)


def _worker_victim(events: list[dict[str, Any]], k: int, path: Path) -> tuple[int, str] | None:
    """The k-th worker kill's victim: the live workers of the newest
    restart, taken in rank order round robin (pid, rank and node)."""
    newest: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "resume":
            newest[int(e["rank"])] = e
    alive = [e for _, e in sorted(newest.items()) if _is_ours(int(e["pid"]), path)]
    if not alive:
        return None
    e = alive[k % len(alive)]
    return int(e["pid"]), f"rank {e['rank']} on node {e['node']}"


def _inject(run: Run, kind: str, k: int) -> None:
    """One failure: a worker SIGKILLed, or a node lost (its launcher and its
    workers SIGKILLed at once) and started again at once."""
    evs = _events(run.events)
    newest = max((e["step"] for e in evs if e["ev"] == "step"), default=0)
    if kind == WORKER_KILL:
        victim = _worker_victim(evs, k, run.events)
        if victim is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim[0], signal.SIGKILL)
        run.disruptions.append(Disruption(kind, time.time(), newest, victim[1]))
        return
    others = sorted(n for n in run.nodes if n != HOST)  # the store's host is never lost
    name = others[k % len(others)]
    t = time.time()
    kill_tree([run.nodes[name].pid])
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.nodes[name].wait(STOP_BOUND)
    run.start(name)
    run.disruptions.append(Disruption(kind, t, newest, f"node {name}"))


def run_one(
    name: str,
    cfg: LauncherConfig,
    mode: str,
    folder: Path,
    args: argparse.Namespace,
    in_process: bool = False,
) -> dict[str, Any]:
    """One launcher's run under the schedule (none for the reference)."""
    folder.mkdir(parents=True, exist_ok=True)
    run = Run(cfg, mode, folder, args, in_process=in_process)
    plan = [] if name == "reference" else schedule(args.duration, args.kill_every, args.node_every)
    try:
        for node in (chr(ord("a") + i) for i in range(args.nodes)):
            run.start(node)
        t_first = _wait_full_world(run, args.nodes * args.nproc)
        start = time.monotonic() - (time.time() - t_first)  # the first step, monotonic
        counts = {WORKER_KILL: 0, NODE_LOSS: 0}
        for at, kind in plan:
            time.sleep(max(0.0, start + at - time.monotonic()))
            _inject(run, kind, counts[kind])
            counts[kind] += 1
        time.sleep(max(0.0, start + args.duration - time.monotonic()))
        t_end = time.time()
    finally:
        run.stop_all()
    (folder / "disruptions.json").write_text(json.dumps([vars(d) for d in run.disruptions]))
    return summarize(_events(run.events), run.disruptions, t_end)


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
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _measure(code, str(folder))
    finally:
        for p in folder.glob("ckpt-*"):
            p.unlink()


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
    return _measure(code)


def _measure(code: str, *args: str) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter with a memory-checkpoint folder of
    its own in /dev/shm (removed after): the JSON its last line prints."""
    shm = tempfile.mkdtemp(prefix="elastrun-goodput-", dir="/dev/shm")
    env = {**os.environ, "ELASTRUN_MEMORY_CHECKPOINT_DIR": shm, "PYTHONPATH": str(REPO / "src")}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
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
    world = args.nodes * args.nproc
    what = {**WHAT, IN_PROCESS: WHAT["elastrun"] + ", in_process"} if args.setup_heavy else WHAT
    low = args.min_nodes if args.min_nodes > 0 else max(1, args.nodes - 1)
    plan = schedule(args.duration, args.kill_every, args.node_every)
    lines = [
        "# Goodput under failures",
        "",
        f"{args.nodes} nodes x {args.nproc} worker(s) on loopback (`--nnodes={low}:{args.nodes}`), "
        f"{args.duration:.0f} s of training per run from the first step at the full world; "
        + (f"{args.setup_seconds:g} s of setup per process; " if args.setup_seconds else "")
        + "schedule: "
        + ", ".join(f"{kind} at {t:.0f} s" for t, kind in plan)
        + f"; machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end. "
        "Reference (torchrun, no checkpoint, no failure): "
        f"{runs['reference']['final_step']} steps.",
        "",
        *report_lines(runs, what, world),
    ]
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


WHAT = {"torchrun": "torch.save every 50 steps", "elastrun": "memory, every step"}
IN_PROCESS = "elastrun --in-process"  # --setup-heavy's fourth run


def replica_line(r: dict[str, float]) -> str:
    mib = r["bytes"] / 2**20
    return (
        f"A neighbour replica: one snapshot of {mib:.0f} MiB sent to a replica port on loopback "
        f"(signed, hashed on both ends) in {r['seconds']:.2f} s ({mib / r['seconds']:.0f} MiB/s), "
        "in the agent's background thread."
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None, help="seconds of training per run")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between worker kills")
    p.add_argument("--node-every", type=float, default=90.0, help="seconds between node losses")
    p.add_argument("--nodes", type=int, default=2, help="nodes (loopback addresses), 2 to 8")
    p.add_argument("--nproc", type=int, default=1, help="workers per node")
    p.add_argument("--min-nodes", type=int, default=0, help="--nnodes minimum (0: nodes - 1)")
    p.add_argument("--per-rank", action="store_true", help="per-rank memory states (replicas)")
    p.add_argument("--replicate-every", type=int, default=5, help="steps between replica marks")
    p.add_argument("--blocked-mib", type=int, default=1024, help="state size (0: skip)")
    p.add_argument("--replica-mib", type=int, default=256, help="replica size (0: skip)")
    p.add_argument("--replica-only", action="store_true", help="measure the replica only")
    p.add_argument("--quick", action="store_true", help="a short smoke run (about 3 minutes)")
    p.add_argument(
        "--setup-heavy",
        action="store_true",
        help="setup-heavy workers, a worker SIGKILL every 10 s for 60 s, and elastrun --in-process",
    )
    p.add_argument("--setup-seconds", type=float, default=None, help="CPU setup per process (s)")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    args = p.parse_args(argv)
    if args.setup_heavy:
        args.duration = 60.0 if args.duration is None else args.duration
        args.kill_every, args.node_every = 10.0, 0.0
        args.setup_seconds = 3.0 if args.setup_seconds is None else args.setup_seconds
        args.blocked_mib = args.replica_mib = 0
    args.duration = 120.0 if args.duration is None else args.duration
    args.setup_seconds = args.setup_seconds or 0.0
    if args.quick:
        args.duration, args.kill_every, args.node_every = 40.0, 12.0, 24.0
        args.blocked_mib, args.replica_mib = 64, 16
    if not 2 <= args.nodes <= 8 or args.nproc < 1:
        p.error("--nodes must be 2 to 8 and --nproc at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    replica = replica_transfer(args.replica_mib) if args.replica_mib > 0 else None
    if args.replica_only:
        print(replica_line(replica) if replica else "nothing measured")
        return 0
    out = args.out or REPO / "bench" / "results" / f"goodput-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.monotonic()
    runs = {
        "reference": run_one("reference", TORCHRUN_TUNED, "none", out / "reference", args),
        "torchrun": run_one("torchrun", TORCHRUN_TUNED, "torchsave", out / "torchrun", args),
        "elastrun": run_one("elastrun", ELASTRUN_TUNED, "memory", out / "elastrun", args),
    }
    if args.setup_heavy:
        runs[IN_PROCESS] = run_one(
            IN_PROCESS, ELASTRUN_TUNED, "memory", out / "in-process", args, in_process=True
        )
    blocked = blocked_1g(args.blocked_mib, out / "blocked") if args.blocked_mib > 0 else None
    text = report(runs, blocked, args, replica)
    text += f"\nWall time of the benchmark: {time.monotonic() - t0:.0f} s.\n"
    (out / "results.md").write_text(text)
    results = {"runs": runs, "blocked": blocked, "replica": replica}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
