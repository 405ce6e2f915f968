"""Process plumbing for the benchmarks: agents as subprocesses in their own
process groups, the workers' event log, bounded waits (with detection of a
run that is stuck), node kills and memory sampling.

Every process the harness starts gets its own session; at the end of a run the
harness kills each agent's process group and the process group of every
process descended from it (torchrun starts its workers in sessions of their
own), so nothing outlives a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.paths import REPO, WORKER, BenchFailure

POLL_S = 0.02
# elastrun's warm interpreter (the zygote workers are forked from) runs
# this script; their command line also names the worker script.
WARM_MARK = "elastrun/worker/_runner.py"
WARM_SETTLED_S = 1.0  # a warm interpreter whose peak RSS has not grown for this long is done

Event = dict[str, Any]


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) for every process we can see."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def descendants(root: int, table: Mapping[int, tuple[int, int]] | None = None) -> list[int]:
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def read_status_kib(pid: int, key: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (``VmHWM``, ``VmRSS``), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def kill_tree(root_pids: Iterable[int]) -> None:
    """SIGKILL the process groups of the given processes and of all their
    descendants (a node that vanishes at once)."""
    table = _proc_table()
    groups: set[int] = set()
    pids: set[int] = set()
    for root in root_pids:
        for pid in [root, *descendants(root, table)]:
            if pid in table:
                pids.add(pid)
                groups.add(table[pid][1])
    groups.discard(os.getpgrp())
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for pid in pids:  # members of a group we must not kill (none expected)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if table[pid][1] == os.getpgrp():
                os.kill(pid, signal.SIGKILL)


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    t_launch: float
    t_exit: float | None = None
    known_pids: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.t_exit is not None else None

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        kept = [ln for ln in text.splitlines() if ln.strip()]
        return "\n".join(kept[-lines:])

    def remember_tree(self) -> None:
        """Note the agent's descendants now, to find them again after the
        agent itself has gone."""
        if self.t_exit is None:
            self.known_pids.update(descendants(self.pid))


class EventLog:
    """Incremental reader of the workers' JSON-lines event file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[Event] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[Event]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line.strip():
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))
        return self.events

    def select(self, ev: str, after: float = 0.0, **match: Any) -> list[Event]:
        return [
            e
            for e in self.events
            if e.get("ev") == ev
            and e.get("t", 0.0) > after
            and all(e.get(k) == v for k, v in match.items())
        ]


def first_per_rank(events: Iterable[Event]) -> dict[int, Event]:
    out: dict[int, Event] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        out.setdefault(int(e["rank"]), e)
    return out


def all_ranks_time(events: Iterable[Event], world: int) -> float | None:
    """The time by which every rank in ``[0, world)`` had an event, or None."""
    first = first_per_rank(events)
    if any(r not in first for r in range(world)):
        return None
    return max(float(first[r]["t"]) for r in range(world))


class Run:
    """One measured run: a folder, its agents and the workers' events."""

    def __init__(self, folder: Path, worker_env: Mapping[str, str]) -> None:
        self.dir = folder
        # A folder left by an earlier run with the same --out holds its events
        # and checkpoint: they would be read as this run's.
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.events_path = self.dir / "events.jsonl"
        self.log = EventLog(self.events_path)
        self.agents: list[Agent] = []
        self.worker_env = {
            "BENCH_EVENTS": str(self.events_path),
            "BENCH_DIR": str(self.dir),
            "PYTHONUNBUFFERED": "1",
            **worker_env,
        }
        self.mem_pids: dict[int, int] = {}  # agent + helpers: pid -> highest VmHWM (KiB)
        self.warm_pids: dict[int, int] = {}  # warm interpreters: pid -> highest VmHWM (KiB)
        self._warm_grew: dict[int, float] = {}  # pid -> when its VmHWM last grew
        self.mem_root: Agent | None = None
        self._mem_next = 0.0

    # -- processes

    def start_agent(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Agent:
        log_path = self.dir / f"{name}.log"
        full_env = {**os.environ, **self.worker_env, **(env or {})}
        # elastrun's module cache: one per run, shared by its agents (one machine),
        # empty at the run's start: the first launch is the script's first run here.
        full_env.setdefault("ELASTRUN_CACHE_DIR", str(self.dir / "module-cache"))
        with log_path.open("wb") as log:
            t_launch = time.monotonic()
            proc = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=REPO,
                start_new_session=True,
            )
        agent = Agent(name, proc, log_path, t_launch)
        (self.dir / f"{name}.cmd").write_text(" ".join(argv) + "\n")

        def waiter() -> None:
            proc.wait()
            agent.t_exit = time.monotonic()

        threading.Thread(target=waiter, daemon=True).start()
        self.agents.append(agent)
        return agent

    def kill_node(self, agent: Agent) -> float:
        """SIGKILL an agent, its process group and every descendant's group;
        returns the time of the kill."""
        agent.remember_tree()
        pids = [agent.pid, *agent.known_pids]
        t = time.monotonic()
        kill_tree(pids)
        return t

    def kill_agent(self, agent: Agent) -> float:
        """SIGKILL the agent's own process only (its children are left to
        it: an OOM kill); returns the time of the kill. Whatever outlives it
        is killed by :meth:`cleanup`."""
        agent.remember_tree()
        t = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGKILL)
        return t

    def stop(self) -> None:
        """Ask the workers to finish (they stop together at the next step)."""
        (self.dir / "stop").write_text("stop\n")

    def cleanup(self) -> None:
        roots: list[int] = []
        for agent in self.agents:
            agent.remember_tree()
            roots += [agent.pid, *agent.known_pids]
        self.log.poll()
        table = _proc_table()
        for e in self.log.events:  # workers started by an agent that is gone
            pid = int(e.get("pid", -1))
            if pid in table and _cmdline_has(pid, str(WORKER)):
                roots.append(pid)
        kill_tree(roots)
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(10)

    # -- waiting

    def wait(
        self,
        what: str,
        predicate: Callable[[EventLog], Any],
        timeout: float,
        alive: Sequence[Agent] = (),
        stall: float | None = None,
    ) -> Any:
        """Poll until ``predicate(log)`` is truthy; fail on timeout, when an
        agent in ``alive`` exits first, or (``stall``) when no worker wrote an
        event for ``stall`` seconds: the run is stuck."""
        start = time.monotonic()
        deadline = start + timeout
        seen, last_event = len(self.log.events), start
        while True:
            self.log.poll()
            self._sample_memory()
            value = predicate(self.log)
            if value:
                return value
            for agent in alive:
                if agent.t_exit is not None:
                    raise BenchFailure(
                        f"{agent.name} exited {agent.proc.returncode} while waiting for {what}"
                        + _tail(agent)
                    )
            now = time.monotonic()
            if len(self.log.events) != seen:
                seen, last_event = len(self.log.events), now
            if stall is not None and now - last_event > stall:
                raise BenchFailure(
                    f"stuck: no worker event for {stall:.0f}s (bound) while waiting for {what}"
                    f" ({now - start:.0f}s after it began)"
                )
            if now > deadline:
                raise BenchFailure(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(POLL_S)

    def wait_exit(self, agents: Sequence[Agent], timeout: float) -> float:
        """Wait for the agents to exit 0; returns the last exit time."""
        self.wait(
            "launcher exit",
            lambda _log: all(a.t_exit is not None for a in agents),
            timeout,
        )
        for agent in agents:
            if agent.proc.returncode != 0:
                raise BenchFailure(f"{agent.name} exited {agent.proc.returncode}" + _tail(agent))
        return max(a.t_exit or 0.0 for a in agents)

    # -- memory

    def track_memory(self, agent: Agent) -> None:
        self.mem_root = agent

    def _sample_memory(self) -> None:
        """Peak RSS of the tracked agent and its non-worker descendants;
        warm interpreters (the agent's children with ``WARM_MARK`` in the command
        line, not yet a worker) are kept apart in ``warm_pids``."""
        agent = self.mem_root
        if agent is None or agent.t_exit is not None or time.monotonic() < self._mem_next:
            return
        now = time.monotonic()
        self._mem_next = now + 0.1
        workers = {int(e["pid"]) for e in self.log.events if e.get("ev") == "start"}
        for pid in workers & self.warm_pids.keys():  # a warm interpreter that became a worker
            del self.warm_pids[pid]
            self._warm_grew.pop(pid, None)
        table = _proc_table()
        for pid in [agent.pid, *descendants(agent.pid, table)]:
            if pid in workers:
                continue
            cmdline = _cmdline(pid) if pid != agent.pid else ""
            if WARM_MARK in cmdline:
                if table.get(pid, (0, 0))[0] != agent.pid:
                    continue  # a worker's child, or a zygote's short-lived fork
                hwm = read_status_kib(pid, "VmHWM")
                if hwm is not None and hwm > self.warm_pids.get(pid, -1):
                    self.warm_pids[pid] = hwm
                    self._warm_grew[pid] = now
            elif str(WORKER) not in cmdline:
                hwm = read_status_kib(pid, "VmHWM")
                if hwm is not None:
                    self.mem_pids[pid] = max(hwm, self.mem_pids.get(pid, 0))

    def warm_settled(self) -> bool:
        """True when every live warm interpreter seen has torch loaded and its peak RSS
        has stopped growing (vacuously true without any)."""
        now = time.monotonic()
        for pid in self.warm_pids:
            if not Path(f"/proc/{pid}").exists():
                continue  # gone (discarded or reaped): its peak is final
            if now - self._warm_grew.get(pid, now) < WARM_SETTLED_S:
                return False
            if not _maps_have(pid, b"libtorch"):
                return False
        return True


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _cmdline_has(pid: int, needle: str) -> bool:
    return needle in _cmdline(pid)


def _maps_have(pid: int, needle: bytes) -> bool:
    """Whether a file mapped into the process has ``needle`` in its path."""
    try:
        return needle in Path(f"/proc/{pid}/maps").read_bytes()
    except OSError:
        return False


def _tail(agent: Agent) -> str:
    """The last lines of an agent's output (usually the error), one line."""
    lines = [ln.strip()[-240:] for ln in agent.log_tail(2).splitlines()]
    return f"; log ends: {' | '.join(lines)}" if lines else ""


def physical_floor(folder: Path, nproc: int, timeout: float) -> dict[str, float]:
    """Start ``nproc`` workers directly (no launcher) on a gloo process group:
    the time to python start + import torch + process-group init + one step."""
    run = Run(folder, {"BENCH_TARGET_STEP": "1"})
    port = free_port()
    procs: list[Agent] = []
    try:
        for rank in range(nproc):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            procs.append(run.start_agent(f"rank{rank}", [sys.executable, str(WORKER)], env))
        t0 = procs[0].t_launch
        t_step = run.wait(
            "first step on all ranks (no launcher)",
            lambda log: all_ranks_time(log.select("step"), nproc),
            timeout,
        )
        imported = all_ranks_time(run.log.select("imported"), nproc) or 0.0
        pg = all_ranks_time(run.log.select("pg_ready"), nproc) or 0.0
        started = all_ranks_time(run.log.select("start"), nproc) or 0.0
        run.wait_exit(procs, timeout)
        return {
            "python_started": started - t0,
            "torch_imported": imported - t0,
            "pg_ready": pg - t0,
            "first_step": t_step - t0,
        }
    finally:
        run.cleanup()
