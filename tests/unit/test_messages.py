"""The typed messages between the agent and the processes it starts
(worker/_messages.py), and the agent's bounded, typed reading of them
(agent/channel.py): real sockets, no agent."""

from __future__ import annotations

import ast
import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.channel import MAX_CHANNEL_BYTES, RunnerChannel, decode
from elastrun.worker import _messages as M

WORKER = Path(M.__file__).parent

EVERY = [
    M.Modules("optimizer_step", ("json", "torch.optim"), "3.11.7", "2.13.0"),
    M.Modules("timer", (), "3.12.1", None),
    M.ProgressFailed("/l/0/heartbeat.json", "[Errno 28] No space left on device"),
    M.Progress({"v": 1, "monotonic": 12.5, "step": 3}, "[Errno 30] Read-only file system"),
    M.Progress(None, "x"),
    M.Go(),
    M.Preload(("numpy", "torch.optim")),
    M.Fork({"RANK": "3", "PATH": "/bin"}, ("--lr", "1"), index=1, count=2),
    M.Ready(5, (("bad", "ImportError: no"),), 1024, 1.5, None, "3.11.7", "2.13.0"),
    M.Ready(0, stopped="time budget of 120 s spent"),
    M.Forked((1234, None, 1236)),
    M.Unsafe(("pkg",), "pkg started a thread"),
    M.Unsafe(("pkg",), "pkg reads RANK when it is imported", "RANK"),
]


@pytest.mark.parametrize("message", EVERY, ids=lambda m: m.KIND)
def test_every_message_reads_back_as_written(message: M.Message) -> None:
    wire = json.loads(M.encode(message))
    assert wire["v"] == M.PROTOCOL and wire["kind"] == message.KIND
    assert M.from_json(wire) == message
    assert M.encode_line(message) == M.encode(message) + b"\n"
    # As the agent reads it from a worker: bounded, then typed.
    assert decode(M.encode(message), max_bytes=1 << 16, what="m") == message


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([], "not a JSON object"),
        ({"kind": "go"}, "protocol version"),
        ({"v": 2, "kind": "go"}, "protocol version"),
        ({"v": M.PROTOCOL, "kind": "shell"}, "unknown kind"),
        ({"v": M.PROTOCOL}, "unknown kind"),
        ({"v": M.PROTOCOL, "kind": "modules", "why": "x", "modules": "json"}, "modules"),
        ({"v": M.PROTOCOL, "kind": "modules", "why": "x", "modules": ["a", 1]}, "modules"),
        ({"v": M.PROTOCOL, "kind": "modules", "modules": []}, "why"),
        ({"v": M.PROTOCOL, "kind": "progress", "beat": [1], "error": "e"}, "beat"),
        ({"v": M.PROTOCOL, "kind": "forked", "pids": ["1"]}, "pids"),
        ({"v": M.PROTOCOL, "kind": "forked", "pids": [True]}, "pids"),
        ({"v": M.PROTOCOL, "kind": "fork", "env": {"A": 1}, "args": [], "index": 0, "count": 1},
         "env"),
        ({"v": M.PROTOCOL, "kind": "fork", "env": {}, "args": [], "index": "0", "count": 1},
         "index"),
        ({"v": M.PROTOCOL, "kind": "ready", "loaded": 1, "failed": [["a"]], "rss_kb": 0,
          "preload_s": 0}, "failed"),
        ({"v": M.PROTOCOL, "kind": "unsafe", "modules": ["a"], "why": None}, "why"),
    ],
)  # fmt: skip
def test_anything_else_is_refused_with_the_field_named(data: Any, problem: str) -> None:
    with pytest.raises(M.BadMessage, match=problem):
        M.from_json(data)


def test_the_forked_pids_are_pids() -> None:
    # A pid of 0 or below would signal a process group or every process.
    wire = {"v": M.PROTOCOL, "kind": "forked", "pids": [0, -1, 7]}
    assert M.from_json(wire) == M.Forked((None, None, 7))


def test_the_agent_drops_what_is_too_big_too_deep_or_not_json() -> None:
    big = M.encode(M.Modules("timer", tuple(f"m{i}" for i in range(5000))))
    assert decode(big, max_bytes=1000, what="m") is None
    assert decode(b"[" * 10_000 + b"]" * 10_000, max_bytes=1 << 20, what="m") is None
    assert decode(b"not json", max_bytes=100, what="m") is None
    assert decode(b'{"v": 3, "kind": "nope"}', max_bytes=100, what="m") is None


def test_the_zygote_s_preload_plan() -> None:
    plan = M.PreloadPlan(("torch", "numpy"), "3.11.7", None, ("RANK",), 1)
    assert M.PreloadPlan.from_text(json.dumps(plan.to_json())) == plan
    # Anything else: nothing ahead of time (the zygote still serves forks).
    assert M.PreloadPlan.from_text("") == M.PreloadPlan()
    assert M.PreloadPlan.from_text('{"modules": "torch"}') == M.PreloadPlan()
    assert M.PreloadPlan.from_text(json.dumps({**plan.to_json(), "base": -3})).base == 0


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module not in BY_PATH:
            out.add(str(node.module).split(".")[0])
    return out


# Foundation modules (standard library only) that a worker-side file imports in
# the package and loads by its path outside it.
BY_PATH = {"elastrun.fields"}


@pytest.mark.parametrize(
    "name", ["_messages", "_runner", "_zygote", "_progress", "_modnames", "_settle"]
)
def test_the_worker_side_is_standard_library_only(name: str) -> None:
    # Run by path in the worker's interpreter, where elastrun may not be importable.
    foreign = _imports(WORKER / f"{name}.py") - set(sys.stdlib_module_names) - {"__future__"}
    assert not foreign, foreign


def test_the_messages_load_by_path_without_elastrun(tmp_path: Path) -> None:
    # As the runner and the zygote load them: by path, elastrun not importable.
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location("
        f"'_elastrun_messages', {str(WORKER / '_messages.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert 'elastrun' not in sys.modules, 'elastrun imported'\n"
        "for data in ({'v': m.PROTOCOL, 'kind': 'modules', 'modules': []}, {'v': 9}):\n"
        "    try:\n"
        "        m.from_json(data)\n"
        "    except m.BadMessage as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "a message: why is missing",
        f"a message has protocol version 9; this elastrun reads version {M.PROTOCOL}",
    ]


# -- the runner's channel, as the agent reads it -----------------------------------


class Seen:
    def __init__(self) -> None:
        self.messages: list[M.Message] = []
        self.closed = asyncio.Event()
        self.got = asyncio.Event()

    def message(self, m: M.Message) -> None:
        self.messages.append(m)
        self.got.set()


async def _watched(now: list[float]) -> tuple[RunnerChannel, socket.socket, Seen]:
    ours, theirs = socket.socketpair()
    channel, seen = RunnerChannel(ours), Seen()
    channel.watch(lambda: now[0], seen.message, seen.closed.set)
    return channel, theirs, seen


def test_the_channel_delivers_typed_messages_and_drops_the_rest() -> None:
    async def main() -> list[M.Message]:
        channel, theirs, seen = await _watched([0.0])
        modules = M.Modules("optimizer_step", ("json",), "3.11.7", None)
        # A line split across two writes, garbage, an unknown kind, then a message.
        wire = M.encode_line(modules)
        theirs.sendall(wire[:5])
        theirs.sendall(wire[5:] + b"garbage\n" + b'{"v": 3, "kind": "nope"}\n')
        theirs.sendall(M.encode_line(M.ProgressFailed("/p", "full")))
        for _ in range(100):
            if len(seen.messages) >= 2:
                break
            seen.got.clear()
            await asyncio.wait_for(seen.got.wait(), 5.0)
        theirs.close()
        await asyncio.wait_for(seen.closed.wait(), 5.0)  # end of file: closed
        assert not channel.open
        return seen.messages

    assert asyncio.run(main()) == [
        M.Modules("optimizer_step", ("json",), "3.11.7", None),
        M.ProgressFailed("/p", "full"),
    ]


def test_a_worker_that_sends_too_much_loses_its_channel() -> None:
    async def main() -> bool:
        channel, theirs, seen = await _watched([0.0])
        theirs.setblocking(False)
        chunk = b"x" * 65536  # no newline: it would all be held
        sent = 0
        for _ in range(2000):  # at most ~20 s of full buffers
            if sent > MAX_CHANNEL_BYTES + len(chunk) or seen.closed.is_set():
                break
            try:
                sent += theirs.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(seen.closed.wait(), 5.0)
        theirs.close()
        return channel.open

    assert asyncio.run(main()) is False


def test_go_is_what_a_forked_worker_waits_for() -> None:
    ours, theirs = socket.socketpair()
    try:
        RunnerChannel(ours).go()
        assert M.from_json(json.loads(theirs.recv(1024))) == M.Go()
    finally:
        ours.close()
        theirs.close()
