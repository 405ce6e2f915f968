"""Helpers for end-to-end tests: real agents (the ``elastrun`` command) as
subprocesses in their own process groups, and the step log of
``scripts/elastic_worker.py``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import kill_group, pid_alive, wait_for

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ELASTRUN = [sys.executable, "-m", "elastrun"]


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill_group(self, sig: signal.Signals = signal.SIGKILL) -> None:
        kill_group(self.proc.pid, sig)

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

    def start_agent(
        self,
        name: str,
        flags: list[str],
        script: str = "elastic_worker.py",
        env_extra: dict[str, str] | None = None,
    ) -> Agent:
        log_path = self.dir / f"agent-{name}.log"
        env = dict(
            os.environ, ELASTIC_TEST_DIR=str(self.dir), ELASTIC_TEST_NODE=name, PYTHONUNBUFFERED="1"
        )
        env.update(env_extra or {})
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

    def events(self, name: str) -> list[dict[str, Any]]:
        """Agent ``name``'s event log, where its flags put it
        (``--events-file={dir}/events-{name}.jsonl``); a torn last line is skipped."""
        path = self.dir / f"events-{name}.jsonl"
        out = []
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def kinds(self, name: str, kind: str) -> list[dict[str, Any]]:
        """Agent ``name``'s events of ``kind``."""
        return [e for e in self.events(name) if e["kind"] == kind]

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
    except BaseException:
        # What each agent said, in the failed test's report (pytest shows its output).
        for agent in j.agents:
            print(f"----- agent {agent.name} (last 4000 characters) -----")
            print(agent.output()[-4000:])
        raise
    finally:
        j.cleanup()


def node_name(name: str) -> dict[str, str]:
    """The environment that names an agent's node ``name`` (several on one machine)."""
    return {"ELASTRUN_HOST_NAME": name}


BOUND = 90.0  # generous: a loaded 2-core machine


def steps_after(
    j: Job, t0_index: int, pred: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    return [s for s in j.steps()[t0_index:] if pred(s)]


def crash_and_train_again(j: Job, world: int) -> None:
    """Rank 1's worker crashes; wait until the job trains at ``world`` on its
    first restart."""
    mark = len(j.steps())
    j.touch("crash_rank_1")
    wait_for(
        lambda: steps_after(j, mark, lambda s: s["restart"] == 1 and s["world"] == world),
        BOUND,
        f"training at world {world} after the crash",
    )


def check_finished(j: Job, tmp_path: Path, *agents: Agent) -> list[int]:
    """Finish the job: every agent exits 0, no step redone, the checkpoint
    holds the last step, no worker left alive. Returns rank 0's steps."""
    j.touch("finish")
    for agent in agents:
        assert agent.wait(BOUND) == 0, agent.output()[-3000:]
    rank0 = [s["step"] for s in j.steps() if s["rank"] == 0]
    assert rank0 == sorted(rank0) and len(set(rank0)) == len(rank0), "a step was redone"
    ckpt = json.loads((tmp_path / "ckpt.json").read_text())["step"]
    assert ckpt == rank0[-1]
    assert not any(pid_alive(s["pid"]) for s in j.steps())
    return rank0


def join_loss_and_crash(
    j: Job, tmp_path: Path, flags: Callable[[str], list[str]], label: str = ""
) -> None:
    """The elastic scenario: agents a and b train; c joins (world 3); c is
    SIGKILLed with its workers (world 2 again); a worker crash consumes one
    restart; the job finishes. ``flags(name)`` gives each agent's flags."""
    a = j.start_agent("a", flags("a"))
    b = j.start_agent("b", flags("b"))
    wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")

    mark = len(j.steps())
    t = time.monotonic()
    c = j.start_agent("c", flags("c"))
    wait_for(lambda: steps_after(j, mark, lambda s: s["world"] == 3), BOUND, "world 3")
    print(f"{label}scale-up: world 3 after {time.monotonic() - t:.1f}s")

    c_pids = {s["pid"] for s in j.steps() if s["world"] == 3 and s["group_rank"] == 2}
    mark = len(j.steps())
    t = time.monotonic()
    c.kill_group()
    wait_for(lambda: steps_after(j, mark, lambda s: s["world"] == 2), BOUND, "world 2 again")
    print(f"{label}node loss: world 2 after {time.monotonic() - t:.1f}s")
    assert not any(pid_alive(p) for p in c_pids), "the killed node's workers survived"

    restarts_before = max(s["restart"] for s in j.steps())
    mark = len(j.steps())
    j.touch("crash_rank_1")
    wait_for(
        lambda: steps_after(j, mark, lambda s: s["restart"] > restarts_before),
        BOUND,
        "training after the worker crash",
    )
    check_finished(j, tmp_path, a, b)
    # Only the crash counted as a restart; the join and the loss did not.
    assert max(s["restart"] for s in j.steps()) == restarts_before + 1
