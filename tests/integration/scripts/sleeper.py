"""Worker: writes its pid (and its child's) to PIDDIR, then sleeps.

Usage: sleeper.py PIDDIR [--ignore-term] [--child] [--term-marker]
--ignore-term: ignore SIGTERM (the agent must SIGKILL it after the grace).
--child: start a grandchild (sleep) in the same process group.
--term-marker: on SIGTERM write PIDDIR/<rank>.term, then exit 0.
--usr1-marker: on SIGUSR1 write PIDDIR/<rank>.usr1 and go on.
"""

import os
import signal
import subprocess
import sys
import time

piddir = sys.argv[1]
args = sys.argv[2:]
rank = os.environ.get("RANK", "x")
if "--ignore-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--term-marker" in args:

    def on_term(signum, frame):
        with open(os.path.join(piddir, f"{rank}.term"), "w") as fp:
            fp.write(str(signum))
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
if "--usr1-marker" in args:

    def on_usr1(signum, frame):
        with open(os.path.join(piddir, f"{rank}.usr1"), "w") as fp:
            fp.write(str(signum))

    signal.signal(signal.SIGUSR1, on_usr1)
lines = [str(os.getpid())]
if "--child" in args:
    child = subprocess.Popen(["sleep", "600"])
    lines.append(str(child.pid))
tmp = os.path.join(piddir, f".{rank}.tmp")
with open(tmp, "w") as fp:
    fp.write("\n".join(lines))
os.replace(tmp, os.path.join(piddir, f"{rank}.pids"))
print(f"sleeper rank {rank} ready", flush=True)
time.sleep(600)
