"""Worker for the stdin tests: forked from the warm interpreter (it imports
torch, which the warm interpreter preloads).

Usage: stdin_worker.py OUTDIR. Prints ``rank R read 'text'`` (what this rank
read from stdin until end of file), writes OUTDIR/<rank>.read, then waits (at
most 60 s) for OUTDIR/finish and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch  # noqa: F401 - a script that imports torch is forked from the warm interpreter

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
data = sys.stdin.read()
print(f"rank {rank} read {data!r} from {os.readlink('/proc/self/fd/0')}", flush=True)
(out / f"{rank}.read").touch()
deadline = time.monotonic() + 60
while not (out / "finish").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
