"""What a memory checkpoint's save blocks, next to a plain memory copy of the
same bytes, on this machine (``python -m bench.memory_save``; run by ``make
bench``; docs/benchmarks.md).

One float32 tensor of ``--mib`` MiB (default 1024) is saved with
``MemoryCheckpoint.save`` once per ``--interval`` seconds (default 1), into a
private folder in ``/dev/shm`` as an agent makes it. Before each save, the
same bytes are copied into a preallocated (and already written) buffer with
``numpy.copyto`` and with ``torch``'s ``copy_``: the plain copies. The first
``slots`` saves allocate their slots and are reported apart; of the later
ones: the time each call blocked (median and max), how much of it was
waiting for the save before it (its hash and commit, in a thread of the
worker), and how long each hash and commit took. Each data digest in turn:
``xxh3-chunks`` (when ``xxhash`` is installed), ``sha256-chunks`` (the
fallback), and ``sha256`` in one pass (what every save hashed before chunk
digests: not a choice a user has; the benchmark sets it). The target: a
save blocks at most 1.3x the faster plain copy, and never waits for the
hash of the save before it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

import elastrun.train.memory as memory
from elastrun.train import MemoryCheckpoint
from elastrun.worker import snapshot_digest
from elastrun.worker.snapshot import ENV

TARGET = 1.3


def _copy_times(src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float]:
    a, b = src.numpy(), dst.numpy()
    t0 = time.perf_counter()
    np.copyto(b, a)
    t1 = time.perf_counter()
    dst.copy_(src)
    return t1 - t0, time.perf_counter() - t1


def run_digest(digest: str, mib: int, saves: int, interval: float) -> dict[str, Any]:
    """``saves`` saves of ``mib`` MiB with ``digest``, each beside the plain copies."""
    folder = tempfile.mkdtemp(prefix="elastrun-bench-", dir="/dev/shm")
    os.environ[ENV] = folder
    memory.preferred = lambda: digest  # type: ignore[attr-defined]  # the benchmark's choice
    src = torch.randn(mib << 18)
    dst = torch.zeros_like(src)  # written once: its pages are there, as a slot's are
    mem = MemoryCheckpoint(log=None)
    rows: list[dict[str, float]] = []
    try:
        start = time.monotonic()
        for step in range(saves):
            np_s, torch_s = _copy_times(src, dst)
            mem.save({"w": src}, step=step)
            rows.append(
                {
                    "numpy": np_s,
                    "torch": torch_s,
                    "blocked": mem.last_blocked_s,
                    "waited": mem.last_waited_s,
                    "commit": mem.last_commit_s,  # of the save before this one
                }
            )
            time.sleep(max(0.0, start + (step + 1) * interval - time.monotonic()))
        mem.wait()
        commits = [r["commit"] for r in rows[1:]] + [mem.last_commit_s]
    finally:
        mem.close()
        shutil.rmtree(folder, ignore_errors=True)
    slots = mem._slot_count
    later = rows[slots:]
    np_s = statistics.median(r["numpy"] for r in later)
    torch_s = statistics.median(r["torch"] for r in later)
    copy = min(np_s, torch_s)
    blocked = [r["blocked"] for r in later]
    return {
        "digest": digest,
        "first": max(r["blocked"] for r in rows[:slots]),
        "numpy": np_s,
        "torch": torch_s,
        "blocked": statistics.median(blocked),
        "blocked_max": max(blocked),
        "ratio": statistics.median(blocked) / copy,
        "ratio_max": max(blocked) / copy,
        "waited_max": max(r["waited"] for r in later),
        "commit": statistics.median(commits[slots:]),
        "commit_max": max(commits[slots:]),
    }


def report(results: list[dict[str, Any]], mib: int, interval: float, saves: int) -> str:
    lines = [
        f"One float32 tensor of {mib} MiB saved every {interval:g} s ({saves} saves, the first "
        f"ones into new slots; medians of the rest), machine: {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s):",
        "",
        "| digest | plain copy: numpy / torch | save blocked: median / max | blocked / copy "
        f"(target <= {TARGET}x): median / max | waited for the previous save, max | hash and "
        "commit in the background: median / max | first save into a new slot |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['digest']} | {r['numpy']:.3f} / {r['torch']:.3f} s | {r['blocked']:.3f} / "
            f"{r['blocked_max']:.3f} s | **{r['ratio']:.2f}x** / {r['ratio_max']:.2f}x | "
            f"{r['waited_max']:.3f} s | {r['commit']:.2f} / {r['commit_max']:.2f} s | "
            f"{r['first']:.2f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    p.add_argument("--saves", type=int, default=10, help="saves per digest (the first 3 allocate)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between saves")
    p.add_argument("--digests", default=None, help="comma-separated (default: all available)")
    args = p.parse_args(argv)
    if args.saves < 5 or args.mib < 1:
        p.error("--saves must be at least 5 and --mib at least 1")
    digests = [snapshot_digest.SHA256_CHUNKS, snapshot_digest.SHA256]
    if snapshot_digest.preferred() == snapshot_digest.XXH3_CHUNKS:
        digests.insert(0, snapshot_digest.XXH3_CHUNKS)
    if args.digests:
        digests = [d.strip() for d in args.digests.split(",")]
    results = [run_digest(d, args.mib, args.saves, args.interval) for d in digests]
    print(report(results, args.mib, args.interval, args.saves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
