"""A worker for the launcher-input tests (no torch: the agent is what is tested).

Prints one line ``WORKER run_id=... restart=... rank=... pid=...``, then by
its first argument:

* ``ok``: exit 0;
* ``fail``: exit 1;
* ``fail-once DIR``: exit 1 the first time any worker of the job runs this
  (a marker file in DIR), exit 0 after;
* ``wait DIR``: wait (at most 120 s) for DIR/finish, then exit 0;
* ``fail-once-wait DIR``: ``fail-once``, then ``wait`` on later runs;
* ``chatty N``: print N lines of 70 bytes to stdout, then exit 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

e = os.environ
print(
    f"WORKER run_id={e['TORCHELASTIC_RUN_ID']} restart={e['TORCHELASTIC_RESTART_COUNT']} "
    f"rank={e['RANK']} pid={os.getpid()}",
    flush=True,
)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail":
    sys.exit(1)
if mode in ("fail-once", "fail-once-wait"):
    marker = Path(sys.argv[2]) / "failed-once"
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        if mode == "fail-once":
            sys.exit(0)
        mode = "wait"
    else:
        sys.exit(1)
if mode == "wait":
    finish = Path(sys.argv[2]) / "finish"
    deadline = time.monotonic() + 120
    while not finish.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0 if finish.exists() else 3)
if mode == "chatty":
    for i in range(int(sys.argv[2])):
        print(f"line {i:08d} " + "x" * 55, flush=i % 200 == 0)
