"""Simulated rendezvous participants (elastrun only): runs
``bench/rdzv_bench.py`` when it exists and parses its table."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from typing import Any

from bench.paths import BENCH_DIR, REPO

SIMULATED_SIZES = (64, 256, 1024)
_SIM_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s*$")


def parse_simulated(stdout: str) -> list[dict[str, float]]:
    """Rows of ``bench/rdzv_bench.py``'s table: agents, rendezvous s
    (median), exit barrier s."""
    rows = []
    for line in stdout.splitlines():
        m = _SIM_ROW.match(line)
        if m:
            rows.append(
                {
                    "participants": float(m.group(1)),
                    "rendezvous_s": float(m.group(2)),
                    "exit_barrier_s": float(m.group(3)),
                }
            )
    return rows


def available() -> bool:
    return (BENCH_DIR / "rdzv_bench.py").exists()


def simulated_rdzv(reps: int, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``bench/rdzv_bench.py`` (simulated participants on elastrun's
    embedded store) when it exists. Returns ``{"status": ..., "rows": [...]}``."""
    if not available():
        return {"status": "not available (bench/rdzv_bench.py is missing)"}
    sizes = ",".join(str(n) for n in SIMULATED_SIZES)
    cmd = [sys.executable, "-m", "bench.rdzv_bench", "--sizes", sizes, "--reps", str(reps)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: no answer within {timeout:.0f}s"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its helper processes share its group
        proc.wait()
    rows = parse_simulated(out)
    if proc.returncode != 0 or not rows:
        tail = (out.strip().splitlines() or [""])[-1]
        return {"status": f"failed: exit {proc.returncode}: {tail[:200]}", "rows": rows}
    return {"status": f"ran: `{' '.join(cmd[1:])}`", "rows": rows}
