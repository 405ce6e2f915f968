"""Worker with descendants, for the "no orphans" test.

Usage: tree_worker.py PIDDIR
Starts a child in its own process group (same group: killed with it) and one
in a process group of its own (same session), then writes every pid of its
tree to PIDDIR/<rank>.pids and sleeps.
"""

import os
import subprocess
import sys
import time

piddir = sys.argv[1]
rank = os.environ.get("RANK", "x")
same_group = subprocess.Popen(["sleep", "600"])
own_group = subprocess.Popen(["sleep", "600"], process_group=0)
pids = [os.getpid(), same_group.pid, own_group.pid]
tmp = os.path.join(piddir, f".{rank}.tmp")
with open(tmp, "w") as fp:
    fp.write("\n".join(str(p) for p in pids))
os.replace(tmp, os.path.join(piddir, f"{rank}.pids"))
time.sleep(600)
