"""exit_begun: a process whose exit has begun though it is not reaped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from elastrun.agent.process import exit_begun


def test_a_running_process_has_not_begun_to_end() -> None:
    assert not exit_begun(os.getpid())


def test_an_unreaped_exited_child_has_begun_to_end() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        # Its exit reported (a zombie until reaped), looked at without reaping.
        while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < deadline, "the child never ended"
            time.sleep(0.01)
        assert exit_begun(child.pid)
    finally:
        child.wait()
    assert not exit_begun(child.pid)  # reaped: no such process


def test_no_such_process() -> None:
    assert not exit_begun(2**22 + 1)  # above the largest pid the kernel gives
