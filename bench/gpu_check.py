"""``python -m bench.gpu_check``: the GPU paths, on the first GPU machine.

Runs, each under ``elastrun --standalone`` on this machine, one worker per
GPU (``--nproc-per-node``, default ``gpu``), and prints one table (markdown,
for docs/benchmarks.md, *GPUs*):

* ``example``: examples/train.py on NCCL (``--device cuda``), one epoch;
* ``memckpt``: a state of 1 and 10 GiB per rank (``--sizes``) saved into a
  memory checkpoint every step; the last rank is SIGKILLed after a save, and
  the restarted ranks load it back from memory (bench/gpu_check_worker.py):
  time blocked per save, commit time, load time, the step resumed;
* ``warm``: examples/train.py SIGKILLed at a step with memory checkpoints,
  warm (the default) and ``--no-warm``: the time from the worker's death to
  the next workers' start, from the event log, and the whole run's time;
* ``peer``: an NCCL all-reduce loop whose last rank is SIGKILLed inside the
  collective (needs 2 GPUs or more): the time until the survivors were
  stopped and the group restarted, and that the restart finished.

Each run is bounded (``--timeout``); a run that fails or hangs is a row that
says so, never the end of the check. ``--device cpu`` runs the same on the
CPU with gloo (a dry run of the script, with small ``--sizes``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.paths import BENCH_DIR, REPO

CHECKS = ("example", "memckpt", "warm", "peer")
WORKER = BENCH_DIR / "gpu_check_worker.py"
EXAMPLE = REPO / "examples" / "train.py"
PREFIX = "GPUCHECK "
ELASTRUN = str(Path(sys.executable).with_name("elastrun"))


@dataclass(frozen=True)
class Run:
    """One elastrun run of the check: its row's name and setting, the
    arguments after ``elastrun``, the worker's extra environment and the
    run's folder (logs, event log, the example's checkpoints)."""

    check: str
    setting: str
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    folder: Path = Path()


@dataclass(frozen=True)
class Row:
    check: str
    setting: str
    result: str  # "ok", or what failed
    numbers: str = ""


def _sizes(text: str) -> tuple[float, ...]:
    try:
        sizes = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of GiB: {text!r}") from None
    if not sizes or any(s <= 0 or s > 1024 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be in (0, 1024] GiB: {text!r}")
    return sizes


def _checks(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check {', '.join(unknown) or '(none)'}: choose from {', '.join(CHECKS)}"
        )
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    p.add_argument(
        "--checks", type=_checks, default=CHECKS, help=f"comma-separated: {','.join(CHECKS)}"
    )
    p.add_argument(
        "--sizes", type=_sizes, default=(1.0, 10.0), help="GiB per rank for memckpt (1,10)"
    )
    p.add_argument(
        "--nproc", default="gpu", help="workers per node: a number or gpu (default: one per GPU)"
    )
    p.add_argument("--steps", type=int, default=6, help="steps of the memckpt and peer runs")
    p.add_argument("--kill-at", type=int, default=3, help="the step the last rank is killed at")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run with gloo"
    )
    p.add_argument("--out", type=Path, default=None, help="a folder for each run's logs")
    ns = p.parse_args(argv)
    if not 0 <= ns.kill_at < ns.steps - 1:
        p.error(f"--kill-at must be in [0, --steps - 1): {ns.kill_at} with {ns.steps} steps")
    if ns.nproc != "gpu" and not (ns.nproc.isdigit() and int(ns.nproc) >= 1):
        p.error(f"--nproc must be a number >= 1 or gpu: {ns.nproc!r}")
    return ns


def plan(ns: argparse.Namespace, out: Path) -> list[Run]:
    """The runs ``ns`` asks for, in order, each with its folder under ``out``."""
    base = ("--standalone", f"--nproc-per-node={ns.nproc}", "--max-restarts=1")
    device = ("--device", ns.device)
    env = {"GPUCHECK_DEVICE": ns.device, "GPUCHECK_STEPS": str(ns.steps)}
    env["GPUCHECK_KILL_AT"] = str(ns.kill_at)
    runs: list[Run] = []

    def add(check: str, setting: str, args: tuple[str, ...], extra: dict[str, str]) -> None:
        folder = out / f"{len(runs):02d}-{check}"
        if check in ("example", "warm"):  # its own checkpoints: never a previous run's
            args = (*args, f"--checkpoint-dir={folder / 'ckpt'}")
        runs.append(Run(check, setting, args, extra, folder))

    for check in ns.checks:
        if check == "example":
            add(check, "1 epoch", (*base, str(EXAMPLE), *device, "--epochs=1"), {})
        elif check == "memckpt":
            for gb in ns.sizes:
                extra = {**env, "GPUCHECK_MODE": "memckpt", "GPUCHECK_GB": repr(gb)}
                add(check, f"{gb:g} GiB per rank", (*base, str(WORKER)), extra)
        elif check == "warm":
            # Step 3 of the first epoch: reached at any world size.
            crash = ("--crash-at-step=3", "--crash-how=sigkill", "--memory-checkpoint")
            for how in ("--warm", "--no-warm"):
                args = (*base, how, str(EXAMPLE), *device, "--epochs=2", *crash)
                add(check, how.removeprefix("--"), args, {})
        elif check == "peer":
            add(
                check,
                "SIGKILL in all_reduce",
                (*base, str(WORKER)),
                {**env, "GPUCHECK_MODE": "peer"},
            )
    return runs


def records(stdout: str) -> list[dict[str, Any]]:
    """The workers' ``GPUCHECK`` lines (with or without elastrun's prefix)."""
    out = []
    for line in stdout.splitlines():
        at = line.find(PREFIX)
        if at < 0:
            continue
        try:
            value = json.loads(line[at + len(PREFIX) :])
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def death(events: list[dict[str, Any]]) -> float | None:
    """When the first worker died (the event log's wall clock)."""
    return next((e["ts"] for e in events if e.get("kind") == "worker_exited"), None)


def restart_gap(events: list[dict[str, Any]]) -> float | None:
    """Seconds from the first worker's death to the next workers' start (a
    cold worker imports after that; a warm one before)."""
    died = death(events)
    if died is None:
        return None
    later = [e["ts"] for e in events if e.get("kind") == "workers_started" and e["ts"] > died]
    return round(min(later) - died, 3) if later else None


def summarize(
    run: Run,
    rc: int | None,
    recs: list[dict[str, Any]],
    gap: float | None,
    died: float | None = None,
) -> Row:
    """The table's row for ``run``: its exit code, its workers' records, its
    restart gap and when the first worker died."""
    if rc is None:
        return Row(run.check, run.setting, "timed out")
    if rc != 0:
        return Row(run.check, run.setting, f"failed (exit {rc})")
    parts = []
    if gap is not None:
        parts.append(f"death to workers started {gap:.2f} s")
    later = [r for r in recs if r.get("attempt", 0) > 0]
    resumed = [r["first_step_at"] for r in later if isinstance(r.get("first_step_at"), float)]
    if died is not None and resumed:
        parts.append(f"death to first step {max(resumed) - died:.2f} s")
    if run.check == "memckpt":
        # The first attempt's ranks are killed or stopped before they print: the restarted ones'.
        blocked = [r["save_blocked_median_s"] for r in recs if "save_blocked_median_s" in r]
        commit = [r["commit_median_s"] for r in recs if "commit_median_s" in r]
        if blocked:
            parts.append(f"save blocked {max(blocked):.3f} s (median; slowest rank)")
        if commit:
            parts.append(f"commit {max(commit):.3f} s")
        loads = [r["load_s"] for r in later if "load_s" in r]
        if loads:
            parts.append(f"load {max(loads):.3f} s")
        steps = sorted({r.get("first_step") for r in later}, key=str)
        parts.append(f"resumed at step {','.join(map(str, steps)) or '?'}")
        if any(r.get("in_memory") is False for r in recs):
            return Row(run.check, run.setting, "fell back to disk", "; ".join(parts))
        expected = int(run.env.get("GPUCHECK_KILL_AT", "-2")) + 1
        if resumed_at := [s for s in {r.get("first_step") for r in later} if s != expected]:
            return Row(
                run.check, run.setting, f"resumed at {resumed_at}, not {expected}", "; ".join(parts)
            )
    if run.check == "peer":
        done = all(r.get("last_step") is not None for r in later) and bool(later)
        if not done:
            return Row(run.check, run.setting, "no restart finished", "; ".join(parts))
    return Row(run.check, run.setting, "ok", "; ".join(parts))


def render_table(rows: Sequence[Row]) -> str:
    """The markdown table of ``rows``."""
    lines = ["| check | setting | result | numbers |", "|---|---|---|---|"]
    for r in rows:
        cells = (r.check, r.setting, r.result, r.numbers or "-")
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def execute(run: Run, ns: argparse.Namespace) -> Row:
    """Run ``run`` (bounded) and read its row."""
    folder = run.folder
    folder.mkdir(parents=True, exist_ok=True)
    events = folder / "events.jsonl"
    env = {**os.environ, **run.env}
    argv = [ELASTRUN, f"--events-file={events}", *run.args]
    t0 = time.monotonic()
    rc: int | None
    try:
        proc = subprocess.run(  # noqa: PLW1510 - the exit code is the row's
            argv,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=ns.timeout,
            start_new_session=True,
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
    (folder / "stdout.txt").write_text(out)
    (folder / "stderr.txt").write_text(err)
    evs = []
    if events.exists():
        evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    row = summarize(run, rc, records(out), restart_gap(evs), death(evs))
    took = f"wall {time.monotonic() - t0:.1f} s"
    return Row(row.check, row.setting, row.result, f"{row.numbers}; {took}".lstrip("; "))


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    out = ns.out or BENCH_DIR / "results" / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    rows = []
    for run in plan(ns, out):
        print(f"gpu_check: {run.check} ({run.setting})...", file=sys.stderr, flush=True)
        rows.append(execute(run, ns))
    print(render_table(rows))
    print(f"\nlogs: {out}", file=sys.stderr)
    return 0 if all(r.result == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
