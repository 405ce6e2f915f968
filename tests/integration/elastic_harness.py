"""Helpers for end-to-end tests: real agents (the ``elastrun`` command) as
subprocesses in their own process groups, and the step log of
``scripts/elastic_worker.py``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ELASTRUN = [sys.executable, "-m", "elastrun"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return False


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill_group(self, sig: signal.Signals = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} still running after {timeout:.0f}s:\n{self.output()[-3000:]}"
            ) from None


@dataclass
class Job:
    dir: Path
    agents: list[Agent] = field(default_factory=list)

    def start_agent(self, name: str, flags: list[str], script: str = "elastic_worker.py") -> Agent:
        log_path = self.dir / f"agent-{name}.log"
        env = dict(os.environ, ELASTIC_TEST_DIR=str(self.dir), PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*ELASTRUN, *flags, str(SCRIPTS / script)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        agent = Agent(name, proc, log_path)
        self.agents.append(agent)
        return agent

    def steps(self) -> list[dict[str, Any]]:
        path = self.dir / "steps.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def touch(self, name: str) -> None:
        (self.dir / name).write_text("")

    def cleanup(self) -> None:
        for agent in self.agents:
            agent.kill_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(10)
        # Workers live in their own process groups: kill any the log knows of.
        for record in self.steps():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(record["pid"]), signal.SIGKILL)


@contextlib.contextmanager
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.cleanup()
