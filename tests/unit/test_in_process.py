"""In-process restarts, the pure parts: the protocol's messages and their
bounds, the worker's port (a stale or repeated Abort or Enter is refused),
the collective-break rule, the wrapper outside elastrun, and what the next
round's hang diagnosis keeps of a kept process (its stacks file). End to end:
tests/integration/test_in_process.py, tests/faults/test_in_process_random.py."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from elastrun.agent.command import PythonScript
from elastrun.agent.hang_group import HangDiagnosis
from elastrun.agent.hooks import Core
from elastrun.agent.process import Worker
from elastrun.agent.spec import HangSettings, WorkerSpec
from elastrun.agent.workers import WorkerGroup
from elastrun.clock import SYSTEM_CLOCK
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.train import in_process
from elastrun.train.in_process import PORT_MODULE, collective_broken
from elastrun.worker import _messages as M
from elastrun.worker import _runner
from elastrun.worker._restart import Port
from tests.unit.test_env import _round


def roundtrip(message: M.Message) -> M.Message:
    return M.from_json(json.loads(M.encode_line(message)))


def test_the_messages_read_back_as_written() -> None:
    for message in (
        M.Restartable(round=3),
        M.Left(round=3, why="RuntimeError: Connection closed by peer"),
        M.Entered(round=4),
        M.Abort(round=3),
        M.Enter(round=4, env={"RANK": "1", "MASTER_PORT": "29500"}),
    ):
        assert roundtrip(message) == message


def test_an_enter_with_too_many_variables_or_non_strings_is_refused() -> None:
    many = {f"V{i}": "x" for i in range(M.MAX_ENTER_VARS + 1)}
    with pytest.raises(M.BadMessage, match="env"):
        roundtrip(M.Enter(round=1, env=many))
    raw = {"v": M.PROTOCOL, "kind": "enter", "round": 1, "env": {"RANK": 1}}
    with pytest.raises(M.BadMessage, match="env"):
        M.from_json(raw)


def test_a_long_reason_is_cut() -> None:
    left = roundtrip(M.Left(round=1, why="x" * 10_000))
    assert isinstance(left, M.Left) and len(left.why) == M.MAX_WHY


class Agent:
    """The agent's end of a port's channel (a real socket pair)."""

    def __init__(self) -> None:
        self.ours, theirs = socket.socketpair()
        self.channel = _runner.Channel(theirs.detach())
        self.got: list[M.Message] = []

    def send(self, message: M.Message) -> None:
        self.ours.sendall(M.encode_line(message))

    def read(self) -> M.Message:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = self.ours.recv(65536)
            assert chunk, "the channel closed"
            buf += chunk
        return M.from_json(json.loads(buf))


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent()
    yield a
    a.ours.close()


def wait_enter(port: Port) -> tuple[threading.Thread, list[dict[str, str] | None]]:
    out: list[dict[str, str] | None] = []
    t = threading.Thread(target=lambda: out.append(port.wait_enter()), daemon=True)
    t.start()
    return t, out


def test_the_port_acts_on_its_own_round_only(agent: Agent) -> None:
    port = Port(agent.channel, 5)
    aborted = threading.Event()
    port.on_abort = aborted.set
    port.entering()
    first = agent.read()
    assert first == M.Restartable(round=5)
    # A stale Abort (round 4), an Enter while inside: refused.
    agent.send(M.Abort(round=4))
    agent.send(M.Enter(round=6, env={"RANK": "0"}))
    agent.send(M.Abort(round=5))
    assert aborted.wait(30)
    assert port.aborted() and port.refused == 2
    port.leaving("aborted")
    assert agent.read() == M.Left(round=5, why="aborted")
    # An Enter of a round not newer than 5 is refused; the next one is taken.
    t, out = wait_enter(port)
    agent.send(M.Enter(round=5, env={"RANK": "9"}))
    agent.send(M.Enter(round=7, env={"RANK": "1"}))
    t.join(30)
    assert out == [{"RANK": "1"}] and port.round == 7 and port.refused == 3
    port.entering()
    assert agent.read() == M.Entered(round=7)
    assert not port.aborted()  # the last round's Abort does not carry over


def test_the_port_gives_up_when_the_agent_is_gone(agent: Agent) -> None:
    port = Port(agent.channel, 0)
    port.entering()
    agent.read()
    port.leaving("broken")
    t, out = wait_enter(port)
    agent.ours.close()
    t.join(30)
    assert out == [None]


def test_a_broken_collective_is_told_from_the_ranks_own_error() -> None:
    peer = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")
    assert collective_broken(peer)
    assert not collective_broken(ValueError("bad batch"))
    assert not collective_broken(KeyError("x"))
    assert not collective_broken(KeyboardInterrupt())


def test_outside_elastrun_the_function_runs_once() -> None:
    calls: list[int] = []

    @in_process
    def train(x: int) -> int:
        calls.append(x)
        if len(calls) == 1:
            raise RuntimeError("Connection closed by peer")
        return x

    with pytest.raises(RuntimeError):
        train(1)
    assert train(2) == 2 and calls == [1, 2]


def test_each_round_has_its_own_master_port() -> None:
    """No process of an earlier round can reach a later round's TCPStore at
    the address it knew (docs/in_process.md, *Safety*)."""
    import asyncio

    from elastrun.failure import FailureRecord
    from elastrun.names import RunId
    from elastrun.rendezvous.api import RendezvousSettings
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.store.memory import MemoryStore

    async def scenario() -> list[int]:
        settings = RendezvousSettings(
            run_id=RunId("J"),
            min_nodes=1,
            max_nodes=1,
            max_restarts=3,
            last_call_timeout=0.0,
            join_timeout=10.0,
            lease_ttl=5.0,
            host="a",
            addr="127.0.0.1",
        )
        h = DynamicRendezvous(MemoryStore(), settings, node_id="a")
        ports = []
        for _ in range(4):
            result = await h.next_round()
            ports.append(result.master_port)
            await h.request_restart(FailureRecord(rank=0, host="a", exitcode=1))
        await h.shutdown()
        return ports

    ports = asyncio.run(asyncio.wait_for(scenario(), 60.0))
    assert all(a != b for a, b in itertools.pairwise(ports)), ports


def test_a_reentered_function_is_judged_from_its_first_progress(tmp_path: Path) -> None:
    """The watchdog reads no progress from a kept process until it makes
    some in the new round (a record without a time is no beat)."""
    from elastrun.agent.watchdog import parse_beat
    from elastrun.worker._progress import Progress

    now = [100.0]
    progress = Progress(str(tmp_path / "heartbeat.json"), 0.1, clock=lambda: now[0])
    progress.heartbeat(5)
    assert parse_beat(progress.snapshot()) is not None
    progress.reentering()
    assert parse_beat(progress.snapshot()) is None
    now[0] = 130.0
    progress.heartbeat(6)
    beat = parse_beat(progress.snapshot())
    assert beat is not None and beat.monotonic == 130.0 and beat.step == 6


def test_a_kept_process_keeps_its_stacks_file_and_loses_its_last_round_s_progress(
    tmp_path: Path,
) -> None:
    """The next round's hang diagnosis removes a kept process's progress
    record of the last round (it is judged from its first progress in this
    one), never its stacks file: its runner's handler writes to that file's
    descriptor, and without the file the rank is never signalled, so a hang
    is blamed without its stack. A new worker's stale files go."""
    spec = WorkerSpec(
        command=PythonScript("train.py"),
        nproc=3,
        run_id=RunId("job7"),
        hang=HangSettings(timeout=10.0),
    )
    nothing = cast(Any, None)
    core = Core(spec, nothing, ListSink(), SYSTEM_CLOCK, nothing, nothing, lambda _line: None)

    def group(round_: int, kept: dict[int, Worker]) -> WorkerGroup:
        result = dataclasses.replace(_round(), round=round_)
        attempt_dir = tmp_path / str(round_)
        return WorkerGroup(
            spec,
            result,
            attempt=round_,
            attempt_dir=str(attempt_dir),
            keep_files=False,
            events=ListSink(),
            kept=kept,
        )

    def files(w: Worker) -> list[Path]:
        folder = Path(w.folder)
        folder.mkdir(parents=True, exist_ok=True)
        made = [folder / "stacks.txt", folder / "heartbeat.json"]
        for f in made:
            f.write_text("of the last round\n")
        return made

    survivor = group(5, {}).workers[0]
    survivor.popen = cast(Any, SimpleNamespace(pid=101))  # it ran in round 5
    its_stacks, its_progress = files(survivor)
    second = group(6, {0: survivor})
    new_stacks, new_progress = files(second.workers[1])  # an earlier run's, same folder
    hooks = HangDiagnosis(core).round(second)
    assert hooks.worker_env(survivor)["ELASTRUN_STACKS_FILE"] == str(its_stacks)
    hooks.worker_env(second.workers[1])
    assert its_stacks.exists() and not its_progress.exists()
    assert not new_stacks.exists() and not new_progress.exists()


def test_a_rank_that_leaves_destroys_no_process_group_before_the_entry_after_next(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper leaving (a broken collective) holds the groups it aborted:
    freeing the old round's frames, or the abort itself, never runs a group's
    destructor (it joins gloo's worker threads with the GIL held, and one
    that is ending a work waits for the GIL: the rank would never leave).
    They are destroyed at the entry after the next one."""
    import types
    import weakref

    dist = pytest.importorskip("torch.distributed")
    monkeypatch.setitem(sys.modules, "_elastrun_messages", M)
    port = Port(agent.channel, 0)
    monkeypatch.setitem(sys.modules, PORT_MODULE, types.SimpleNamespace(PORT=port))
    groups: list[weakref.ref[Any]] = []
    alive: list[list[bool]] = []

    @in_process
    def train() -> None:
        alive.append([g() is not None for g in groups])  # at each entry
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        groups.append(weakref.ref(dist.group.WORLD))
        if len(groups) < 3:
            raise RuntimeError("Connection closed by peer")
        dist.destroy_process_group()

    lines = agent.ours.makefile("rb")

    def read() -> M.Message:
        return M.from_json(json.loads(lines.readline()))

    assert read() == M.InProcess()  # the decorator's
    t = threading.Thread(target=train, daemon=True)
    t.start()
    for r in (0, 1):
        assert read() == (M.Restartable(round=0) if r == 0 else M.Entered(round=1))
        assert isinstance(read(), M.Left)
        gc.collect()
        assert [g() is not None for g in groups] == [True] * (r + 1)  # none destroyed
        agent.send(M.Enter(round=r + 1, env={}))
    assert read() == M.Entered(round=2)
    t.join(60)
    assert not t.is_alive()
    # Entry 2 found entry 1's group held; entry 3, only entry 2's.
    assert alive == [[], [True], [False, True]]
