"""Every rank's Python stack when a hang is declared.

The worker runner registers ``faulthandler`` on ``SIGRTMIN+5`` (the stack
signal) with the worker's stacks file, and creates that file only once the
handler is in place (worker/_runner.py): the agent signals a worker only when
its file exists, since the signal's default action would end the process.
faulthandler writes from inside the signal handler, without the GIL, so a
worker stuck in a Python function, in a collective or in C code holding the
GIL still answers (C code shows its last Python frame).

:func:`collect` signals each worker, waits (bounded) until its file stops
growing and reads what was added. The rest is pure: :func:`top_frame` picks
the frame where a rank sits (its main thread's most recent call; the runner
writes the main thread's id at the head of the file), and :func:`in_torch`
tells a rank blocked in torch (a collective, or a backward pass whose
all-reduce waits: the usual state of the ranks that wait for a stuck peer)
from one stuck in code of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.rendezvous.notes import MAX_FRAMES as NOTE_MAX_FRAMES
from elastrun.rendezvous.notes import MAX_TEXT, RankStack

__all__ = [
    "MAX_STACK_BYTES",
    "STACK_SIGNAL",
    "Frame",
    "RankStacks",
    "collect",
    "in_torch",
    "main_thread",
    "ordered",
    "report",
    "top_frame",
]

STACK_SIGNAL = signal.SIGRTMIN + 5  # same as worker/_runner.py STACK_SIGNAL_OFFSET
STACKS_ENV = "ELASTRUN_STACKS_FILE"
MAX_STACK_BYTES = 64 * 1024  # what is read of one rank's dump
COLLECT_TIMEOUT = 2.0  # s to wait for every dump
SETTLE = 0.1  # a dump is complete when its file did not grow for this long
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.+?)\s*$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({self.file}:{self.line})"


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x(?P<id>[0-9a-fA-F]+)")
MAIN_HEADER = "# elastrun: main thread 0x"  # the runner's first line in the file


def frames(dump: str, main: int | None = None) -> list[Frame]:
    """The frames of one thread of a faulthandler dump, most recent first:
    the thread ``main`` (its id as faulthandler prints it), else the current
    thread, else the first."""
    blocks: list[tuple[int | None, bool, list[Frame]]] = []
    for line in dump.splitlines():
        t = _THREAD.match(line)
        if t is not None:
            blocks.append((int(t["id"], 16), line.startswith("Current"), []))
            continue
        m = _FRAME.match(line)
        if m is not None:
            if not blocks:
                blocks.append((None, False, []))
            blocks[-1][2].append(Frame(m["file"], int(m["line"]), m["func"]))
    for block in blocks:
        if main is not None and block[0] == main:
            return block[2]
    for block in blocks:
        if block[1]:
            return block[2]
    return blocks[0][2] if blocks else []


def top_frame(dump: str, main: int | None = None) -> Frame | None:
    """Where the rank sits: the most recent call of its main thread that is
    not elastrun's own code."""
    for f in frames(dump, main):
        if "/elastrun/worker/" not in f.file.replace(os.sep, "/"):
            return f
    return None


def in_torch(dump: str, main: int | None = None) -> bool:
    """Whether the rank's main thread sits in torch (a collective, a backward
    pass whose all-reduce waits for peers) rather than in code of its own."""
    top = top_frame(dump, main)
    return top is not None and "/torch/" in top.file.replace(os.sep, "/")


def main_thread(path: str) -> int | None:
    """The main thread's id the runner wrote at the head of its stacks file."""
    try:
        with open(path, "rb") as fp:
            head = fp.readline(200).decode("ascii", errors="replace")
    except OSError:
        return None
    if not head.startswith(MAIN_HEADER):
        return None
    try:
        return int(head[len(MAIN_HEADER) :].strip(), 16)
    except ValueError:
        return None


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as fp:
            fp.seek(max(0, offset))
            data = fp.read(MAX_STACK_BYTES)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


async def collect(
    workers: Mapping[int, tuple[int, str]],
    timeout: float = COLLECT_TIMEOUT,
    clock: Clock = SYSTEM_CLOCK,
) -> dict[int, str]:
    """Ask each worker ``key -> (pid, stacks file)`` for its stacks; returns
    ``key -> dump`` for those that answered within ``timeout``."""
    before: dict[int, int] = {}
    for key, (pid, path) in workers.items():
        size = _size(path)
        if size < 0:
            continue  # no handler registered: the signal would end it
        with contextlib.suppress(OSError):
            os.kill(pid, STACK_SIGNAL)
            before[key] = size
    deadline = clock.monotonic() + timeout
    sizes = dict(before)
    settled: set[int] = set()
    while len(settled) < len(before) and clock.monotonic() < deadline:
        await asyncio.sleep(SETTLE)
        for key, start in before.items():
            size = _size(workers[key][1])
            if size > start and size == sizes[key]:
                settled.add(key)  # grew, then stopped growing
            sizes[key] = size
    return {
        key: text for key in before if (text := _read_from(workers[key][1], before[key])).strip()
    }


def ordered(dumps: Mapping[int, tuple[str, int | None]], ranks: Sequence[int]) -> list[int]:
    """``ranks`` with the ones stuck in code of their own first (the likely
    culprits), then those waiting in torch, then those with no dump.
    ``dumps``: rank -> (dump, main thread id)."""

    def key(r: int) -> tuple[int, int]:
        got = dumps.get(r)
        if got is None or top_frame(*got) is None:
            return (2, r)
        return (1 if in_torch(*got) else 0, r)

    return sorted(ranks, key=key)


# ------------------------------------------------------------ the report

MAX_FRAMES = NOTE_MAX_FRAMES  # frames kept of one rank's main thread (most recent first)
MAX_LINE = MAX_TEXT


@dataclass(frozen=True)
class RankStacks(RankStack):
    """One rank's main-thread stack, as reported; the job notes' schema
    (:class:`~elastrun.rendezvous.notes.RankStack`: a node shares its ranks'
    stacks with the others), made from a faulthandler dump."""

    @classmethod
    def of(cls, rank: int, host: str, dump: str, main: int | None, hung: bool) -> RankStacks:
        own = [f for f in frames(dump, main) if "/elastrun/worker/" not in f.file]
        return cls(
            rank=rank,
            host=host[:MAX_LINE],
            frames=tuple(str(f)[:MAX_LINE] for f in own[:MAX_FRAMES]),
            in_torch=in_torch(dump, main),
            hung=hung,
        )


def report(stacks: Sequence[RankStacks], full_dumps: str | None = None) -> str:
    """The stacks part of a hang's failure summary: ranks stuck in code of
    their own first (the likely culprits, whichever node's watchdog fired
    first), with where each sits, then those waiting in torch for them."""
    if not stacks:
        return ""

    def order(s: RankStacks) -> tuple[int, int, int]:
        return (2 if not s.frames else 1 if s.in_torch else 0, 0 if s.hung else 1, s.rank)

    lines = ["Python stacks when the hang was declared (main thread, most recent call first):"]
    for s in sorted(stacks, key=order):
        where = s.frames[0] if s.frames else "(no Python frame: it was ending)"
        role = (
            "no stack"
            if not s.frames
            else "waiting in torch"
            if s.in_torch
            else "stuck in its own code"
        )
        judged = ", judged hung by the watchdog" if s.hung else ""
        lines.append(f"  rank {s.rank} on {s.host or '?'} [{role}{judged}] sits in {where}")
        shown = s.frames if not s.in_torch else s.frames[:6]
        lines.extend(f"      {f}" for f in shown)
        if len(shown) < len(s.frames):
            lines.append(f"      ... {len(s.frames) - len(shown)} more")
    if full_dumps:
        lines.append(f"every thread of every local rank: {full_dumps}")
    return "\n".join(lines)
