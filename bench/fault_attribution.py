"""``python -m bench.fault_attribution [--duration S | --quick] [--out DIR]``: fault
attribution side by side with torchrun (docs/benchmarks.md, *Fault attribution*).

The goodput window is ``--duration`` seconds: by default 300 (``make
bench``), the 5 minutes the target names; ``--quick`` makes it 60.

Two scenarios, on loopback nodes (agents on this machine, one worker each, the
realistic bench worker), each run with elastrun and with torchrun (tuned:
bench/configs.py), ``--max-restarts=3``:

* **script bug**: 2 nodes; rank 1 raises ``ValueError`` at global step 8
  after every start (checkpoints every 5 steps, so every restart gets there
  again). Measured: the time from launch until every agent exited, the
  workers' starts, the exit codes, and whether the output names the
  exception and the step.
* **bad node**: ``--nnodes=2:3`` and 4 agents (3 train, the fourth, started
  once they train, waits as a spare); once the spare waits (elastrun: its
  ``node_waiting`` event; torchrun: 30 s) the workers of node b raise a
  CUDA-like error 3 + restart steps after every start. elastrun runs with
  ``--quarantine-time=600``. Measured over ``--duration`` seconds from then:
  node b's failures, the time from b's second failure until the job trains
  at full size again (elastrun's event logs: the root cause's
  ``worker_exited``, then the spare's first step), whether the job is alive
  at the end, and the goodput: the steps trained, against the same run
  without the fault (elastrun; its steps per second times the duration).

Every process is stopped by its process group at the end of each run.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.configs import ELASTRUN_TUNED, TORCHRUN_TUNED, LauncherConfig
from bench.harness import free_port, kill_tree
from bench.paths import BENCH_DIR

START_TIMEOUT = 240.0  # s for a run to reach its first step at full size
BUG_TIMEOUT = 600.0  # s for the script-bug run to end
WINDOW = 300.0  # s: the goodput window the target names (5 minutes)
QUICK_WINDOW = 60.0


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Job:
    folder: Path
    cfg: LauncherConfig
    port: int = field(default_factory=free_port)
    nodes: list[Node] = field(default_factory=list)

    @property
    def events(self) -> Path:
        return self.folder / "events.jsonl"

    def start(self, name: str, nnodes: str, extra: list[str], env: dict[str, str]) -> Node:
        host = not self.nodes
        flags = [
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id=faults{self.port}",
            "--max-restarts=3",
        ]
        conf = {"is_host": "1" if host else "0", "join_timeout": "120"}
        if self.cfg.launcher == "elastrun":
            flags += [f"--events-file={self.folder / f'agent-{name}.jsonl'}", *extra]
        log = self.folder / f"agent-{name}.log"
        environ = {
            **os.environ,
            **dict(self.cfg.env),
            **env,
            "BENCH_EVENTS": str(self.events),
            "BENCH_DIR": str(self.folder),
            "BENCH_NODE": name,
            "ELASTRUN_HOST_NAME": name,
            "BENCH_CKPT_EVERY": "5",
            "PYTHONUNBUFFERED": "1",
        }
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.cfg.argv(flags, conf),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,
            )
        node = Node(name, proc, log)
        self.nodes.append(node)
        return node

    def worker_events(self) -> list[dict[str, Any]]:
        return _lines(self.events)

    def agent_events(self, name: str) -> list[dict[str, Any]]:
        return _lines(self.folder / f"agent-{name}.jsonl")

    def first_step(self, world: int, after: float = 0.0, node: str | None = None) -> float | None:
        for e in self.worker_events():
            if (
                e.get("ev") == "step"
                and e.get("world") == world
                and e["wall"] >= after
                and (node is None or e.get("node") == node)
            ):
                return float(e["wall"])
        return None

    def spare_waits(self, name: str) -> bool:
        return any(
            e.get("kind") == "node_waiting" and e.get("spare") for e in self.agent_events(name)
        )

    def wait_for(self, what: str, check: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(0.2)
        raise TimeoutError(f"{self.cfg.name}: {what} not within {timeout:.0f} s")

    def stop(self) -> None:
        kill_tree([n.proc.pid for n in self.nodes])
        for n in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(10)


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def script_bug(folder: Path, cfg: LauncherConfig) -> dict[str, Any]:
    job = Job(folder, cfg)
    env = {"BENCH_FAULT": "bug", "BENCH_FAULT_STEP": "8"}
    t0 = time.time()
    try:
        a = job.start("a", "2", [], env)
        b = job.start("b", "2", [], env)
        job.wait_for("every agent exited", lambda: a.proc.poll() is not None
                     and b.proc.poll() is not None, BUG_TIMEOUT)  # fmt: skip
        ended = time.time()
    finally:
        job.stop()
    starts = {e["restart"] for e in job.worker_events() if e.get("ev") == "pg_ready"}
    said = [ln for ln in a.output().splitlines() if "script fault" in ln]
    return {
        "seconds_to_end": round(ended - t0, 1),
        "worker_starts": len(starts),
        "exit_codes": [a.proc.returncode, b.proc.returncode],
        "verdict_line": said[-1] if said else None,
        "last_error_line": next(
            (ln for ln in reversed(a.output().splitlines()) if "ValueError" in ln), None
        ),
    }


def bad_node(folder: Path, cfg: LauncherConfig, duration: float, fault: bool) -> dict[str, Any]:
    job = Job(folder, cfg)
    env = {"BENCH_FAULT": "bad_node", "BENCH_FAULT_NODE": "b"} if fault else {}
    extra = ["--quarantine-time=600"]
    try:
        for name in ("a", "b", "c"):
            job.start(name, "2:3", extra, env)
        job.wait_for("training at world 3", lambda: job.first_step(3), START_TIMEOUT)
        job.start("s", "2:3", extra, env)  # the spare
        if cfg.launcher == "elastrun":  # ready: its warm interpreter loaded, waiting
            job.wait_for("the spare waiting", lambda: job.spare_waits("s"), START_TIMEOUT)
        else:  # torchrun says nothing: as long as elastrun's spare took, at most
            time.sleep(30)
        t_full = time.time()
        (folder / "faults_on").write_text("")  # node b fails from now on
        end = t_full + duration
        while time.time() < end and any(n.proc.poll() is None for n in job.nodes[:1]):
            time.sleep(0.5)
        alive = job.nodes[0].proc.poll() is None
    finally:
        job.stop()
    steps = [e for e in job.worker_events() if e.get("ev") == "step" and e.get("rank") == 0]
    in_window = [e for e in steps if t_full <= e["wall"] <= t_full + duration]
    trained = len(in_window)
    out: dict[str, Any] = {
        "steps_trained": trained,
        "alive_at_end": alive,
        "worker_starts": len({e["restart"] for e in job.worker_events() if e.get("ev") == "start"}),
    }
    if cfg.launcher == "elastrun" and fault:
        exits = [
            e
            for e in job.agent_events("b")
            if e.get("kind") == "worker_exited" and e.get("cause") == "root_cause"
        ]
        out["b_failures"] = len(exits)
        quarantined = [e for e in job.agent_events("b") if e.get("kind") == "node_quarantined"]
        out["b_quarantined"] = bool(quarantined)
        if len(exits) >= 2:
            second = float(exits[1]["ts"])
            back = job.first_step(3, after=second, node="s")
            out["full_size_again_s"] = None if back is None else round(back - second, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fault_attribution", description=__doc__)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"goodput window (s; default {WINDOW:g}, {QUICK_WINDOW:g} with --quick)",
    )
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_WINDOW:g} s goodput window")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--scenarios", default="bug,bad_node")
    args = p.parse_args(argv)
    if args.duration is None:
        args.duration = QUICK_WINDOW if args.quick else WINDOW
    if args.duration <= 0:
        p.error(f"--duration must be positive, not {args.duration:g}")
    out = args.out or BENCH_DIR / "results" / f"faults-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"duration_s": args.duration}
    wanted = args.scenarios.split(",")
    for cfg in (ELASTRUN_TUNED, TORCHRUN_TUNED):
        if "bug" in wanted:
            folder = out / f"bug-{cfg.name}"
            folder.mkdir()
            results[f"bug/{cfg.name}"] = script_bug(folder, cfg)
            print(json.dumps({f"bug/{cfg.name}": results[f"bug/{cfg.name}"]}), flush=True)
        if "bad_node" in wanted:
            folder = out / f"bad_node-{cfg.name}"
            folder.mkdir()
            results[f"bad_node/{cfg.name}"] = bad_node(folder, cfg, args.duration, True)
            print(json.dumps({f"bad_node/{cfg.name}": results[f"bad_node/{cfg.name}"]}), flush=True)
    if "bad_node" in wanted:
        folder = out / "no_fault-elastrun"
        folder.mkdir()
        base = bad_node(folder, ELASTRUN_TUNED, args.duration, False)
        results["no_fault/elastrun-tuned"] = base
        for cfg in (ELASTRUN_TUNED, TORCHRUN_TUNED):
            got = results[f"bad_node/{cfg.name}"]
            ratio = got["steps_trained"] / max(1, base["steps_trained"])
            got["goodput_vs_no_fault"] = round(ratio, 3)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
