"""Recompilation after a restart of a ``torch.compile``\\d model: torchrun,
elastrun restarting every worker, and elastrun with in-process restarts,
side by side in one run (``python -m bench.compile_restart``; run by
``make bench``; docs/benchmarks.md, docs/in_process.md).

Each launcher runs bench/compile_worker.py with ``--nproc`` workers (default
3) on one node (``--standalone``, tuned as in bench/configs.py): every
process compiles its model in its setup (``--backend``, default
``inductor``; a backend wrapper counts every graph compiled), then trains
``--steps`` steps with a memory checkpoint every step; the last rank
SIGKILLs itself after step ``--kill-at``. Reported per launcher, from the
workers' event files:

* the time from the kill to the first step after it on every rank (the
  slowest rank's);
* per rank after the restart: whether its process was kept (the same pid
  before and after) and how many graphs that process compiled after the
  kill (a kept process: its count at the end minus its count at the kill;
  a new one: all of its own);
* the seconds each process started after the kill spends in its setup
  (its imports of ``torch._dynamo`` and the compilation; the median).

Every launcher is SIGKILLed with its process tree at the end of its run or
after ``--timeout`` seconds. Writes ``bench/results/compile-<time>/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.configs import ELASTRUN_TUNED, TORCHRUN_TUNED, LauncherConfig
from bench.harness import kill_tree
from bench.paths import BENCH_DIR, REPO

WORKER = REPO / "bench" / "compile_worker.py"
LAUNCHERS: tuple[tuple[str, LauncherConfig, bool], ...] = (
    ("torchrun", TORCHRUN_TUNED, False),
    ("elastrun (restart all)", ELASTRUN_TUNED, False),
    ("elastrun --in-process", ELASTRUN_TUNED, True),
)


@dataclass(frozen=True)
class RankAfter:
    """One rank after the restart: its process, kept or not, and the graphs
    that process compiled after the kill."""

    rank: int
    pid: int
    kept: bool
    compiled: int


@dataclass(frozen=True)
class Outcome:
    """One launcher's run, as its workers' events tell it."""

    name: str
    returncode: int | None
    recovery_s: float | None  # the kill -> the first step after it on every rank
    ranks: tuple[RankAfter, ...]
    setup_s: tuple[float, ...]  # each new process's setup after the kill (dynamo, compiling)


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def outcome(name: str, returncode: int | None, events: list[dict[str, Any]]) -> Outcome:
    """What the events say: the recovery and each rank's compilations after
    the kill (pure: tests/unit/test_compile_restart.py)."""
    kill = next((e for e in events if e["ev"] == "kill"), None)
    steps = [e for e in events if e["ev"] == "step"]
    if kill is None:
        return Outcome(name, returncode, None, (), ())
    setup_s = tuple(e["seconds"] for e in events if e["ev"] == "setup" and e["t"] > kill["t"])
    before = {int(e["rank"]): int(e["pid"]) for e in steps if e["restart"] == 0}
    at_kill: dict[int, int] = {}  # pid -> its compilations at its last step before the kill
    for e in steps:
        if e["restart"] == 0 and e["t"] <= kill["t"]:
            at_kill[int(e["pid"])] = int(e["compiles"])
    after = [e for e in steps if e["restart"] >= 1]
    ranks = []
    firsts = []
    for rank in sorted({int(e["rank"]) for e in after}):
        mine = [e for e in after if e["rank"] == rank]
        pid = int(mine[-1]["pid"])
        kept = before.get(rank) == pid
        final = max(int(e["compiles"]) for e in mine)
        ranks.append(RankAfter(rank, pid, kept, final - at_kill.get(pid, 0) if kept else final))
        firsts.append(min(e["t"] for e in mine))
    recovery = max(firsts) - kill["t"] if firsts else None
    return Outcome(name, returncode, recovery, tuple(ranks), setup_s)


def run_one(
    name: str, cfg: LauncherConfig, in_process: bool, args: argparse.Namespace, folder: Path
) -> Outcome:
    """Run the worker under ``cfg`` in the new folder ``folder`` until it
    ends (or ``args.timeout``)."""
    folder.mkdir(parents=True)
    flags = ["--standalone", f"--nproc-per-node={args.nproc}", "--max-restarts=2"]
    env = {
        **os.environ,
        **dict(cfg.env),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "CW_BACKEND": args.backend,
        "CW_EVENTS": str(folder / "events.jsonl"),
        "CW_STEPS": str(args.steps),
        "CW_KILL_AT": str(args.kill_at),
        "CW_CKPT": str(folder / "ckpt"),
        "CW_IN_PROCESS": "1" if in_process else "0",
    }
    with open(folder / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            [*cfg.argv(flags)[:-1], str(WORKER)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=folder,
            start_new_session=True,
        )
    try:
        returncode: int | None = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        kill_tree([proc.pid])
        proc.wait(10)
    return outcome(name, returncode, read_events(folder / "events.jsonl"))


def _row(o: Outcome, ref: Outcome) -> str:
    if o.recovery_s is None:
        rec = "failed"
    elif ref.recovery_s:
        rec = f"{o.recovery_s:.1f} s ({o.recovery_s / ref.recovery_s:.2f}x)"
    else:
        rec = f"{o.recovery_s:.1f} s"
    per_rank = ", ".join(f"{r.rank}: {r.compiled} ({'kept' if r.kept else 'new'})" for r in o.ranks)
    recompiled = sum(r.compiled > 0 for r in o.ranks)
    kept_recompiled = sum(r.compiled > 0 for r in o.ranks if r.kept)
    kept = sum(r.kept for r in o.ranks)
    setup = f"{statistics.median(o.setup_s):.1f} s" if o.setup_s else "-"
    return (
        f"| {o.name} | {rec} | {recompiled} of {len(o.ranks)} | {kept} "
        f"| {kept_recompiled} | {per_rank or '-'} | {setup} | {o.returncode} |"
    )


def report(runs: list[list[Outcome]], args: argparse.Namespace) -> str:
    load = os.getloadavg()
    out = [
        "# Recompilation after a restart of a torch.compile'd model",
        "",
        f"{args.nproc} workers, backend `{args.backend}`; the last rank SIGKILLed after step "
        f"{args.kill_at} of {args.steps}; {len(runs)} repetition(s). Load average at the end: "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs. Graphs compiled "
        "after the kill, per rank (a kept process: after its count at the kill; a new one: "
        "all of its own). Ratios: to torchrun's of the same repetition.",
        "",
        "| launcher | SIGKILL -> every rank's first step | ranks that compiled after the kill "
        "| processes kept | kept processes that compiled again | graphs compiled after the "
        "kill, per rank | a new process's setup (median) | exit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [_row(o, rep[0]) for rep in runs for o in rep]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--kill-at", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1, help="repetitions (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="per launcher run (s)")
    args = p.parse_args(argv)
    if not 0 < args.kill_at < args.steps or args.nproc < 2:
        p.error("need 0 < --kill-at < --steps and --nproc >= 2")
    results = BENCH_DIR / "results" / f"compile-{time.strftime('%Y%m%d-%H%M%S')}"
    results.mkdir(parents=True, exist_ok=True)
    runs: list[list[Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="elastrun-compile-") as tmp:
        for rep in range(args.repeats):
            runs.append([])
            for i, (name, cfg, in_process) in enumerate(LAUNCHERS):
                folder = Path(tmp) / f"{rep}-{i}"
                runs[-1].append(run_one(name, cfg, in_process, args, folder))
                for f in ("events.jsonl", "launcher.log"):
                    if (folder / f).exists():
                        (results / f"{rep}-{i}-{f}").write_bytes((folder / f).read_bytes())
    text = report(runs, args)
    (results / "results.md").write_text(text)
    print(text)
    print(f"written: {results / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
