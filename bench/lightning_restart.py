"""Lightning restarts: a worker SIGKILL -> the first step of every rank,
elastrun and torchrun side by side in one run.

``python -m bench.lightning_restart [--reps 3] [--nproc 2] [--train 20] [--out FILE]``

Each repetition runs torchrun, then elastrun, on the same Lightning worker
(bench/lightning_worker.py: an MLP under DDP, SGD, a DataLoader, ``last.ckpt``
every 10 steps and a resume from it): ``--standalone --nproc-per-node=N
--max-restarts=2 --monitor-interval=0.1`` (torchrun also with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which its restarts hang or
fail at torch 2.13, docs/benchmarks.md). After ``--train`` seconds of
training (a first run of the script on this machine: elastrun's module cache
starts empty), rank 1 is SIGKILLed; measured is the time from the kill to the
first step of the restarted attempt on every rank (the slowest rank), split
into the survivors' own exit (Lightning's SIGTERM handler, the same under
both launchers) and the rest (the launcher's restart, the new workers' start
up to their first step). For elastrun, whether the restarted workers came
from the per-rank warm interpreters (``warm_used`` events with ``per_rank``),
and the warm interpreters' memory (resident, proportional and private, from
``/proc/PID/smaps_rollup`` after the restart) are reported too.

Every wait is bounded; a launcher that does not get there is counted failed
with its reason; every process started is killed at the end of its run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("lightning_worker.py")
START_BOUND = 240.0  # s: launch -> training on every rank, for --train s
RESTART_BOUND = 120.0  # s: kill -> the first step of every rank
EXIT_BOUND = 60.0


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _wait(what: str, predicate: Any, bound: float, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited {proc.returncode} waiting for {what}")
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {bound:.0f}s waiting for {what}")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _smaps(pid: int) -> dict[str, float] | None:
    """Resident, proportional and private memory of ``pid`` (MiB)."""
    fields: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fp:
            for line in fp:
                name, _, rest = line.partition(":")
                if rest.strip().endswith("kB"):
                    fields[name] = int(rest.split()[0]) / 1024
    except (OSError, ValueError):
        return None
    private = fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)
    return {
        "rss": round(fields.get("Rss", 0.0), 1),
        "pss": round(fields.get("Pss", 0.0), 1),
        "private": round(private, 1),
    }


def _zygote_memory(agent_log: Path) -> dict[str, dict[str, float]]:
    """The memory of every warm interpreter still running, by role."""
    out = {}
    for e in _lines(agent_log):
        if e["kind"] == "warm_started" and (mem := _smaps(int(e["pid"]))) is not None:
            out["shared" if e["local_rank"] is None else f"rank {e['local_rank']}"] = mem
    return out


def _argv(launcher: str, nproc: int, folder: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env |= {"BENCH_DIR": str(folder), "PYTHONUNBUFFERED": "1"}
    # Two restarts allowed: after the one measured, the warm interpreters are kept (and measured).
    flags = ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=2"]
    flags.append("--monitor-interval=0.1")
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        module = "torch.distributed.run"
    else:
        env["ELASTRUN_CACHE_DIR"] = str(folder / "cache")  # the script's first run here
        flags.append(f"--events-file={folder / 'agent.jsonl'}")
        module = "elastrun"
    return [sys.executable, "-m", module, *flags, str(WORKER)], env


def one_run(launcher: str, nproc: int, train: float, folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    argv, env = _argv(launcher, nproc, folder)
    events = folder / "events.jsonl"
    with open(folder / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    result: dict[str, Any] = {"launcher": launcher}
    try:

        def trained() -> dict[int, dict[str, Any]] | None:
            steps = [e for e in _lines(events) if e["kind"] == "step" and e["restart"] == 0]
            first = {e["rank"] for e in steps}
            if len(first) < nproc or time.time() - min(e["t"] for e in steps) < train:
                return None
            return {e["rank"]: e for e in steps}

        last = _wait(f"{train:g}s of training on {nproc} ranks", trained, START_BOUND, proc)
        victim = last[1]["pid"]
        survivors = [e["pid"] for rank, e in last.items() if rank != 1]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        stopped: list[float] = []

        def resumed() -> float | None:
            if not stopped and not any(_alive(p) for p in survivors):
                stopped.append(time.time())
            again: dict[int, float] = {}
            for e in _lines(events):
                if e["kind"] == "step" and e["restart"] == 1:
                    again.setdefault(e["rank"], e["t"])
            return max(again.values()) if len(again) == nproc else None

        first = _wait("the first step after the kill", resumed, RESTART_BOUND, proc)
        result["kill_to_first_step_s"] = round(first - t_kill, 3)
        if stopped:
            # The survivors' own exit (Lightning's SIGTERM handler: a broadcast
            # to the dead rank), then the launcher's part.
            result["survivors_stopped_s"] = round(stopped[0] - t_kill, 3)
            result["stopped_to_first_step_s"] = round(first - stopped[0], 3)
        if launcher == "elastrun":
            result["warm_memory_mb"] = _zygote_memory(folder / "agent.jsonl")
        (folder / "stop").touch()
        _wait("the launcher's exit", lambda: proc.poll() is not None, EXIT_BOUND, proc)
        result["exit_code"] = proc.returncode
    except RuntimeError as failure:
        result["error"] = str(failure)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for e in _lines(events):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(e["pid"]), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    banners = [(e["restart"], e["rank"]) for e in _lines(events) if e["kind"] == "banner"]
    result["rank_zero_banners"] = banners
    if launcher == "elastrun":
        agent = _lines(folder / "agent.jsonl")
        again = {
            p
            for e in agent
            if e["kind"] == "workers_started" and e["restart_count"] == 1
            for p in e["pids"]
        }
        result["restarted_per_rank_warm"] = sum(
            1 for e in agent if e["kind"] == "warm_used" and e["pid"] in again and e["per_rank"]
        )
        result["warm_rss_mb"] = {
            ("shared" if e["local_rank"] is None else f"rank {e['local_rank']}"): e["rss_mb"]
            for e in agent
            if e["kind"] == "warm_ready"
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train", type=float, default=20.0, help="s of training before the kill")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-lightning-"))
    runs = []
    load0 = os.getloadavg()
    for rep in range(args.reps):
        for launcher in ("torchrun", "elastrun"):
            r = one_run(launcher, args.nproc, args.train, root / f"{launcher}-{rep}")
            r["rep"] = rep
            print(json.dumps(r), flush=True)
            runs.append(r)
    summary: dict[str, Any] = {"load_before": load0, "load_after": os.getloadavg(), "runs": runs}
    for launcher in ("torchrun", "elastrun"):
        times = [
            r["kill_to_first_step_s"]
            for r in runs
            if r["launcher"] == launcher and "kill_to_first_step_s" in r
        ]
        summary[launcher] = {
            "ok": len(times),
            "runs": args.reps,
            "median_s": statistics.median(times) if times else None,
            "all_s": times,
        }
    for launcher in ("torchrun", "elastrun"):
        part = [
            r["stopped_to_first_step_s"]
            for r in runs
            if r["launcher"] == launcher and "stopped_to_first_step_s" in r
        ]
        summary[launcher]["stopped_to_first_step_median_s"] = (
            statistics.median(part) if part else None
        )
    t, e = summary["torchrun"]["median_s"], summary["elastrun"]["median_s"]
    summary["ratio"] = round(e / t, 3) if t and e else None
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
