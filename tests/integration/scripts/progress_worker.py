"""Worker for the progress-fault tests: progress through elastrun.train.heartbeat
(no torch), each rank marking where it is in OUTDIR.

Usage: progress_worker.py OUTDIR MODE [ARG]

* ``steady SECONDS``: heartbeat every 0.2 s; once OUTDIR/go exists (at most
  60 s), for SECONDS more; then write OUTDIR/<rank>.done and exit 0. Writes
  OUTDIR/<rank>.beating after its first heartbeats.
* ``fill DISK``: as ``steady 15``, but rank 0 first fills the file system of
  the folder DISK (a file DISK/filler written until it is full), topping it
  up every 0.5 s, and writes OUTDIR/go itself.
* ``stop-after-go``: as ``steady``, except that rank 1 stops reporting
  progress once OUTDIR/go exists (it sleeps, at most 600 s: a hang).
* ``silent``: write OUTDIR/<rank>.started, never report progress, sleep (at
  most 600 s).
* ``hang-rank1``: rank 1 heartbeats 5 times, writes OUTDIR/hung.1 and
  sleeps (at most 600 s); the other ranks heartbeat until stopped.
* ``sigdfl``: as ``hang-rank1``, but rank 0 first sets SIGRTMIN+5 (the
  default stack signal) to its default action, as a script that resets
  every real-time signal would.
* ``sigdie``: as ``hang-rank1``, but rank 0 catches SIGRTMIN+5 with a handler
  that restores the default action and signals itself again: it passes the
  agent's check, then dies of the signal.
* ``stdin``: print what this rank read from stdin, as ``rank R read 'text'``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from elastrun.train import heartbeat

out = Path(sys.argv[1])
mode = sys.argv[2]
arg = sys.argv[3] if len(sys.argv) > 3 else ""
rank = int(os.environ["RANK"])


def wait_file(path: Path, bound: float, beat: bool = True) -> None:
    deadline = time.monotonic() + bound
    step = 0
    while not path.exists() and time.monotonic() < deadline:
        if beat:
            heartbeat(step)
            step += 1
        time.sleep(0.2)


def beat_for(seconds: float, first: int = 0) -> None:
    end = time.monotonic() + seconds
    step = first
    while time.monotonic() < end:
        heartbeat(step)
        step += 1
        time.sleep(0.2)


def fill(folder: Path) -> None:
    """Write ``folder/filler`` until the file system is full."""
    chunk = b"x" * 4096
    try:
        with open(folder / "filler", "ab", buffering=0) as f:
            while True:
                f.write(chunk)
    except OSError:
        pass


if mode in ("steady", "stop-after-go"):
    beat_for(1.0)
    (out / f"{rank}.beating").touch()
    wait_file(out / "go", 60)
    if mode == "stop-after-go" and rank == 1:
        time.sleep(600)
    beat_for(float(arg or 15), first=1000)
    (out / f"{rank}.done").touch()
elif mode == "fill":
    beat_for(2.0)
    if rank == 0:
        fill(Path(arg))
        (out / "go").touch()
    wait_file(out / "go", 60)
    end = time.monotonic() + 15
    step = 1000
    while time.monotonic() < end:
        heartbeat(step)
        step += 1
        if rank == 0 and step % 3 == 0:
            fill(Path(arg))  # what a removed file freed is taken again
        time.sleep(0.2)
    (out / f"{rank}.done").touch()
elif mode == "silent":
    (out / f"{rank}.started").touch()
    time.sleep(600)
elif mode in ("hang-rank1", "sigdfl", "sigdie"):
    if mode == "sigdfl" and rank == 0:
        signal.signal(signal.SIGRTMIN + 5, signal.SIG_DFL)
    if mode == "sigdie" and rank == 0:

        def die(signum: int, _frame: object) -> None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGRTMIN + 5, die)
    (out / f"{rank}.started").touch()
    if rank == 1:
        for step in range(5):
            heartbeat(step)
            time.sleep(0.3)
        (out / "hung.1").touch()
        time.sleep(600)
    step = 0
    while True:  # stopped by the agent when rank 1 is found hung
        heartbeat(step)
        step += 1
        time.sleep(0.2)
elif mode == "stdin":
    data = sys.stdin.read()
    print(f"rank {rank} read {data!r}", flush=True)
else:
    sys.exit(f"unknown mode {mode}")
