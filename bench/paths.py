"""Where the benchmark lives, and the one exception every part of it raises."""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORKER = BENCH_DIR / "bench_worker.py"


class BenchFailure(Exception):
    """A measured run did not reach the state it waited for (timeout, stuck,
    early exit, launcher unavailable). The harness records it as a failure."""
