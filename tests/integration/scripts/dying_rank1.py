"""Worker: rank 1's process begins to end; rank 0 fails before that end is reported.

Usage: dying_rank1.py DIR

The state a rank killed by a signal is in for a few milliseconds: its main
thread gone (a zombie), its sockets closed, another thread still ending, so
the kernel does not report its exit yet. Here that window is held open:
rank 1's main thread exits by itself (the exit system call: that thread
only) while a second thread SIGKILLs the process LINGER seconds later. Rank
0 stands for a peer whose collective broke: it waits until rank 1's main
thread is gone, then raises. Run through elastrun's runner, rank 0's failure
reaches the agent (its Failing message) while rank 1's exit is not reported.
"""

import ctypes
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path

LINGER = 1.5  # s rank 1's last thread lives on after its main thread is gone
BOUND = 60.0  # s rank 0 waits for its cue at most
SYS_EXIT = {"x86_64": 60, "aarch64": 93}  # exit(2): the calling thread only


def main_thread_gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :][:1] == b"Z"


def rank1(folder: Path) -> None:
    def last_thread() -> None:
        time.sleep(LINGER)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=last_thread).start()
    (folder / "rank1.tmp").write_text(str(os.getpid()))
    (folder / "rank1.tmp").replace(folder / "rank1.pid")
    ctypes.CDLL(None, use_errno=True).syscall(SYS_EXIT[platform.machine()], 0)


def rank0(folder: Path) -> None:
    deadline = time.monotonic() + BOUND
    pid_file = folder / "rank1.pid"
    while not (pid_file.exists() and main_thread_gone(int(pid_file.read_text()))):
        if time.monotonic() > deadline:
            sys.exit("rank 1's main thread never ended")
        time.sleep(0.01)
    raise RuntimeError("Connection closed by peer: rank 1 is gone")


if __name__ == "__main__":
    (rank1 if os.environ["RANK"] == "1" else rank0)(Path(sys.argv[1]))
