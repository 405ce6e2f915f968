"""Worker for the hang watchdog tests: reports progress with elastrun.train.heartbeat.

Usage: heartbeat_worker.py OUTDIR MODE
MODE hang:   on the first attempt rank 1 heartbeats steps 0..4, writes OUTDIR/hung.<rank>,
             then sleeps forever; the other ranks keep heartbeating. On a restart every
             rank heartbeats a few steps and exits 0.
MODE slow:   heartbeat every SLOW_EVERY s (slower than the rate limit, faster than the
             hang timeout) for RUN_FOR s, then exit 0.
MODE silent: never heartbeat; sleep RUN_FOR s, then exit 0.
Every rank writes OUTDIR/<restart>.<rank>.done when it finishes normally.
"""

import os
import sys
import time

from elastrun.train import heartbeat

outdir, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
SLOW_EVERY = float(os.environ.get("SLOW_EVERY", "1.5"))
RUN_FOR = float(os.environ.get("RUN_FOR", "8"))


def done() -> None:
    with open(os.path.join(outdir, f"{restart}.{rank}.done"), "w") as fp:
        fp.write("ok")


if mode == "hang":
    if restart == 0 and rank == 1:
        for step in range(5):
            heartbeat(step)
            time.sleep(1.1)  # above the rate limit: every step is written
        with open(os.path.join(outdir, f"hung.{rank}"), "w") as fp:
            fp.write(str(time.monotonic()))
        time.sleep(600)
    elif restart == 0:
        step = 0
        while True:  # stopped by the agent when rank 1 is found hung
            heartbeat(step)
            step += 1
            time.sleep(0.2)
    else:
        for step in range(3):
            heartbeat(step)
            time.sleep(0.2)
        done()
elif mode == "slow":
    end = time.monotonic() + RUN_FOR
    step = 0
    while time.monotonic() < end:
        heartbeat(step)
        step += 1
        time.sleep(SLOW_EVERY)
    done()
elif mode == "silent":
    time.sleep(RUN_FOR)
    done()
else:
    sys.exit(f"unknown mode {mode}")
