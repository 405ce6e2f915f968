"""Recovery of a setup-heavy worker: torchrun, elastrun restarting every
worker, and elastrun with in-process restarts, side by side in one run
(``python -m bench.in_process_restart``; run by ``make bench``;
docs/benchmarks.md, docs/in_process.md).

Each launcher runs ``examples/train.py`` with ``--nproc`` workers (default 3)
on one node (``--standalone``, tuned as in bench/configs.py), each worker
doing ``--setup-seconds`` (default 3) of CPU work after its imports (the
script's own setup: data, model, compilation), a checkpoint every step
(``--memory-checkpoint``: the agent's memory under elastrun, the disk under
torchrun) and two faults in one run:

* hard fault: the last rank SIGKILLs itself at step ``--crash-at-step``
  (default 150, about 10 s into the job: a standby rank is ready by then);
* soft fault: rank 0 raises an exception at step ``--raise-at-step`` (default
  250) of the run after that restart.

Times come from the launcher's output, each line stamped when read: from the
fault's line (the worker prints it just before it dies or raises) to the
first training step after it (rank 0's step line past the fault's step).
Reported per launcher: both recovery times, their ratio to torchrun's, and
the processes started after each fault (the ``setup done`` lines: one per
process start), so whether the survivors kept their processes (their pids
from those lines). Every launcher is SIGKILLed with its process tree at the
end of its run or after ``--timeout`` seconds. Writes
``bench/results/in-process-<time>/results.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.configs import ELASTRUN_TUNED, TORCHRUN_TUNED, LauncherConfig
from bench.harness import kill_tree
from bench.paths import BENCH_DIR, REPO

EXAMPLE = REPO / "examples" / "train.py"
# A worker's own lines (elastrun prefixes them with [node:local_rank], torchrun
# does not), not the worker output that elastrun's failure summary quotes.
WORKER_LINE = r"^(?:\[[^\]\s]+\]: )?"
STEP = re.compile(WORKER_LINE + r"epoch \d+ step (\d+) ")
SETUP = re.compile(WORKER_LINE + r"setup done: pid (\d+)")
# Not anchored: torchrun's workers share one unprefixed output, where the line may follow
# another worker's on the same line; the first match is the worker's own (elastrun's failure
# summary quotes it later).
KILLED = re.compile(r"\[rank \d+\] injected failure at step")
RANK0_PID = re.compile(WORKER_LINE + r"=> start: .* pid (\d+)$")
RAISED = re.compile(WORKER_LINE + r"\[rank \d+\] injected exception at step")


@dataclass
class Line:
    t: float
    text: str


@dataclass
class Outcome:
    """One launcher's run: its output lines (stamped) and what they show."""

    name: str
    lines: list[Line] = field(default_factory=list)
    returncode: int | None = None

    def first(self, pattern: re.Pattern[str]) -> Line | None:
        return next((ln for ln in self.lines if pattern.search(ln.text)), None)

    def recovery(self, fault_line: re.Pattern[str], step: int) -> float | None:
        """Seconds from the fault's line to the first step past ``step``."""
        fault = self.first(fault_line)
        if fault is None:
            return None
        for ln in self.lines:
            m = STEP.search(ln.text)
            if ln.t >= fault.t and m and int(m.group(1)) > step:
                return ln.t - fault.t
        return None

    def setups(self, after: float, before: float = float("inf")) -> list[int]:
        """Pids of the processes that finished their setup in the window."""
        return [
            int(m.group(1))
            for ln in self.lines
            if after <= ln.t < before and (m := SETUP.search(ln.text))
        ]


def run_one(
    name: str, cfg: LauncherConfig, extra: list[str], args: argparse.Namespace, folder: Path
) -> Outcome:
    """Run the example under ``cfg`` (in the new folder ``folder``) until it
    ends (or ``args.timeout``)."""
    run_dir = folder
    run_dir.mkdir(parents=True)
    flags = ["--standalone", f"--nproc-per-node={args.nproc}", "--max-restarts=3"]
    argv = [
        *cfg.argv(flags)[:-1],
        str(EXAMPLE),
        *("--epochs", str(args.epochs), "--log-every", "1", "--memory-checkpoint"),
        *("--checkpoint-dir", str(run_dir / "ckpt"), "--setup-seconds", str(args.setup_seconds)),
        *("--crash-at-step", str(args.crash_at_step), "--crash-how", "sigkill"),
        *("--raise-at-step", str(args.raise_at_step)),
        *extra,
    ]
    env = {**os.environ, **dict(cfg.env), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    out = Outcome(name)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=run_dir,
        start_new_session=True,
    )

    def read() -> None:
        assert proc.stdout is not None
        with open(run_dir / "launcher.log", "w") as log:
            for raw in proc.stdout:
                text = raw.decode(errors="replace")
                out.lines.append(Line(time.monotonic(), text.rstrip("\n")))
                log.write(text)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out.returncode = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        out.returncode = None
    finally:
        kill_tree([proc.pid])
        proc.wait(10)
        reader.join(10)
    return out


LAUNCHERS: tuple[tuple[str, LauncherConfig, list[str]], ...] = (
    ("torchrun", TORCHRUN_TUNED, []),
    ("elastrun (restart all)", ELASTRUN_TUNED, []),
    ("elastrun --in-process", ELASTRUN_TUNED, ["--in-process"]),
)


def _row(o: Outcome, ref: Outcome, args: argparse.Namespace) -> str:
    """One run's table row; ratios to ``ref`` (torchrun of the same repetition)."""

    def cell(fault: re.Pattern[str], step: int) -> str:
        v, r = o.recovery(fault, step), ref.recovery(fault, step)
        if v is None:
            return "failed"
        return f"{v:.1f} s ({v / r:.2f}x)" if r else f"{v:.1f} s"

    kill, raised = o.first(KILLED), o.first(RAISED)
    t_k = kill.t if kill else float("inf")
    t_r = raised.t if raised else float("inf")
    starts = [(ln.t, int(m.group(1))) for ln in o.lines if (m := RANK0_PID.search(ln.text))]
    before = [pid for t, pid in starts if t < t_k]
    after = [pid for t, pid in starts if t_k <= t < t_r]
    same = "?" if not (before and after) else "yes" if before[-1] == after[0] else "no"
    return (
        f"| {o.name} | {cell(KILLED, args.crash_at_step)} "
        f"| {len(o.setups(t_k, t_r))} of {args.nproc} | {same} "
        f"| {cell(RAISED, args.raise_at_step)} | {len(o.setups(t_r))} of {args.nproc} "
        f"| {o.returncode} |"
    )


def _median(runs: list[list[Outcome]], i: int, fault: re.Pattern[str], step: int) -> float | None:
    found = [v for rep in runs if (v := rep[i].recovery(fault, step)) is not None]
    return statistics.median(found) if found else None


def report(runs: list[list[Outcome]], args: argparse.Namespace) -> str:
    """Every run's row (each repetition: the launchers in turn), then the
    medians of each launcher and their ratios to torchrun's."""
    load = os.getloadavg()
    out = [
        "# Recovery of a setup-heavy worker",
        "",
        f"{args.nproc} workers, {args.setup_seconds:g} s of setup per process after its imports; "
        f"SIGKILL of the last rank at step {args.crash_at_step}, an exception in rank 0 at "
        f"step {args.raise_at_step}; {len(runs)} repetition(s). Load average at the end: "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs. Processes "
        "started: `setup done` lines after the fault; rank 0's pid: from its `=> start` lines "
        "before and after the SIGKILL (rank 0 survives it). Ratios: to torchrun's of the same "
        "repetition.",
        "",
        "| launcher | SIGKILL -> first step | processes started | rank 0's pid kept "
        "| exception -> first step | processes started | exit |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [_row(o, rep[0], args) for rep in runs for o in rep]
    out += ["", "| launcher | SIGKILL -> first step, median | exception -> first step, median |"]
    out.append("|---|---|---|")
    for i, name in enumerate(o.name for o in runs[0]):
        cells = []
        for fault, step in ((KILLED, args.crash_at_step), (RAISED, args.raise_at_step)):
            v, ref = _median(runs, i, fault, step), _median(runs, 0, fault, step)
            ratio = f" ({v / ref:.2f}x)" if v is not None and ref else ""
            cells.append("failed" if v is None else f"{v:.1f} s{ratio}")
        out.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--setup-seconds", type=float, default=3.0)
    # The faults come about 10 s into the job (and 7 s after the first restart):
    # a standby rank is then ready (6-9 s after the script wraps its function on
    # a loaded 2-core machine), as it would be in a job that trains for hours.
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--crash-at-step", type=int, default=150)
    p.add_argument("--raise-at-step", type=int, default=250)
    p.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="per launcher run (s)")
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = BENCH_DIR / "results" / f"in-process-{stamp}"
    results.mkdir(parents=True, exist_ok=True)
    runs: list[list[Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="elastrun-inproc-") as tmp:
        for rep in range(args.repeats):
            runs.append([])
            for i, (name, cfg, extra) in enumerate(LAUNCHERS):
                o = run_one(name, cfg, extra, args, Path(tmp) / f"{rep}-{i}")
                runs[-1].append(o)
                (results / f"{rep}-{i}.log").write_text(
                    "\n".join(f"{ln.t:.3f} {ln.text}" for ln in o.lines) + "\n"
                )
    text = report(runs, args)
    (results / "results.md").write_text(text)
    print(text)
    print(f"written: {results / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
