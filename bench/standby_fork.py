"""A replacement rank that starts set up already: a standby process against a
fork after the setup (``python -m bench.standby_fork``; run by ``make bench``;
docs/in_process.md, *Why standby processes*).

The two ways docs/in_process.md weighs, measured on the same setup, each from
the order to go (a line on the process's stdin, as the agent's order to enter)
to the end of the replacement's first training step (its line read back):

* **standby**: a process ran the setup and waits; on the order it trains;
* **fork**: a process ran the setup and waits; on the order it forks, and the
  child trains (what forking ranks from a warm interpreter that ran the
  script's rank-independent setup would do). Also reported: how long the
  ``fork()`` call itself took, and whether the child could train at all;
* **new process** (for scale): a process started on the order, which imports
  torch, runs the setup and trains (a replacement with neither).

The setup (bench/standby_fork_worker.py): ``--sizes`` MiB of data touched in
memory (a loaded data set or weights), a 4-layer MLP with its optimizer, and
one training step (which starts torch's intra-op threads, as a real setup
does). The first step after the order reads the data and updates the model,
so a forked child pays its copy-on-write faults there. Writes
``bench/results/standby-fork-<time>/results.md``.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import kill_tree
from bench.paths import BENCH_DIR

WORKER = [sys.executable, "-m", "bench.standby_fork_worker"]
# name -> the worker's flags
MODES = {
    "standby": ["--wait"],
    "standby, setup on one thread": ["--wait", "--one-thread"],
    "fork": ["--fork"],
    "fork, setup on one thread": ["--fork", "--one-thread"],
    "new process": ["--go"],
}


def _read_until(proc: subprocess.Popen[bytes], prefix: str, timeout: float) -> str:
    """The first line of ``proc``'s output that starts with ``prefix``;
    TimeoutError when none came within ``timeout`` seconds."""
    assert proc.stdout is not None
    fd, buf = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.decode(errors="replace").startswith(prefix):
                return line.decode(errors="replace").strip()
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no '{prefix}' line within {timeout:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise RuntimeError(f"the worker ended before '{prefix}' (exit {proc.wait()})")
        buf += chunk


Run = tuple[float, float | None] | None  # (order -> step, fork()) in s; None: no step


def one(mode: str, size_mb: int, timeout: float, hang: float) -> Run:
    """One replacement: (order -> first step done, the fork() call) in
    seconds, or None when no step came within ``hang`` seconds of the order."""
    argv = [*WORKER, "--size-mb", str(size_mb), *MODES[mode]]
    if mode == "new process":
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
        try:
            _read_until(proc, "stepped", timeout)
            return time.monotonic() - t0, None
        finally:
            kill_tree([proc.pid])
            proc.wait()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdin is not None
    try:
        _read_until(proc, "ready", timeout)
        t0 = time.monotonic()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        try:
            line = _read_until(proc, "stepped", hang)
        except TimeoutError:
            return None
        parts = line.split()
        return time.monotonic() - t0, float(parts[2]) if len(parts) > 2 else None
    finally:
        kill_tree([proc.pid])  # and a forked child, in the worker's process group
        proc.wait()


def _cell(runs: list[Run], hang: float) -> str:
    done = [r for r in runs if r is not None]
    if not done:
        return f"no step within {hang:g} s ({len(runs)} of {len(runs)})"
    text = f"{statistics.median(t for t, _ in done) * 1000:.0f} ms"
    forks = [f for _, f in done if f is not None]
    if forks:
        text += f" (fork() {statistics.median(forks) * 1000:.1f} ms)"
    if len(done) < len(runs):
        text += f"; {len(runs) - len(done)} of {len(runs)} no step within {hang:g} s"
    return text


def report(results: dict[tuple[str, int], list[Run]], sizes: list[int], hang: float) -> str:
    out = [
        "| setup's memory | " + " | ".join(f"{m}: order -> first step" for m in MODES) + " |",
        "|---" * (len(MODES) + 1) + "|",
    ]
    for size in sizes:
        cells = [_cell(results[(mode, size)], hang) for mode in MODES]
        out.append(f"| {size} MiB | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,4096", help="MiB of setup data, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0, help="per setup (s)")
    p.add_argument("--hang", type=float, default=20.0, help="an order's step is given (s)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or min(sizes) < 1 or args.repeats < 1:
        p.error("--sizes must be positive MiB counts and --repeats at least 1")
    results: dict[tuple[str, int], list[Run]] = {}
    for size in sizes:
        for mode in MODES:
            results[(mode, size)] = [
                one(mode, size, args.timeout, args.hang) for _ in range(args.repeats)
            ]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    text = (
        f"Replacement rank set up already: medians of {args.repeats} runs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load}\n\n"
        + report(results, sizes, args.hang)
    )
    results_dir = BENCH_DIR / "results" / f"standby-fork-{time.strftime('%Y%m%d-%H%M%S')}"
    results_dir.mkdir(parents=True, exist_ok=True)
    Path(results_dir / "results.md").write_text(text)
    print(text)
    print(f"written: {results_dir / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
