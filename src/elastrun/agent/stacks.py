"""Every rank's Python stack when a hang is declared.

The worker runner registers ``faulthandler`` on the stack signal
(``--stack-signal``, default ``SIGRTMIN+5``; ``ELASTRUN_STACK_SIGNAL`` tells
the runner its number) with the worker's stacks file, and creates that file
only once the handler is in place (worker/_runner.py): the agent signals a
worker only when its file exists, since the signal's default action would
end the process. faulthandler writes from inside the signal handler, without
the GIL, so a worker stuck in a Python function, in a collective or in C
code holding the GIL still answers (C code shows its last Python frame).

A script may change the signal's disposition afterwards (``SIG_DFL``, as a
script that resets every real-time signal does, or ``SIG_IGN``). So before
signalling a rank, :func:`collect` checks that the signal is still caught
in that process (``SigCgt`` in ``/proc/PID/status``). If it is not, that
rank's stacks are skipped with the reason (:class:`Collected`), and the
signal is never sent: its default action would kill a healthy rank. A
script that installs a handler of its own for the signal has it called; the
remedy is another ``--stack-signal``. A rank that dies of the signal anyway
(the disposition changed between the check and the signal) is the agent's
doing, never a root cause (agent/workers.py).

:func:`collect` signals each worker, waits (bounded) until its file stops
growing and reads what was added. The file is read with
``elastrun.safefs.read_regular``: no link followed, never blocked by a
FIFO, bounded. The rest is pure: :func:`top_frame` picks
the frame where a rank sits (its main thread's most recent call; the runner
writes the main thread's id at the head of the file), :func:`in_torch`
tells a rank blocked in torch (a collective, or a backward pass whose
all-reduce waits: the usual state of the ranks that wait for a stuck peer)
from one stuck in code of its own, and :func:`hung_rank` names the rank a
hang is blamed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.frozen import frozen
from elastrun.procs import signal_name
from elastrun.rendezvous.notes import MAX_FRAMES as NOTE_MAX_FRAMES
from elastrun.rendezvous.notes import MAX_TEXT, RankStack
from elastrun.safefs import read_regular

__all__ = [
    "MAX_STACK_BYTES",
    "STACK_SIGNAL",
    "Collected",
    "Frame",
    "RankStacks",
    "collect",
    "hung_rank",
    "in_own_code",
    "in_torch",
    "main_thread",
    "report",
    "signal_caught",
    "top_frame",
]

STACK_SIGNAL = signal.SIGRTMIN + 5  # the default; same as worker/_runner.py STACK_SIGNAL_OFFSET
STACKS_ENV = "ELASTRUN_STACKS_FILE"
STACK_SIGNAL_ENV = "ELASTRUN_STACK_SIGNAL"  # its number, for the runner
MAX_STACK_BYTES = 64 * 1024  # what is read of one rank's dump
COLLECT_TIMEOUT = 2.0  # s to wait for every dump
SETTLE = 0.1  # a dump is complete when its file did not grow for this long
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.+?)\s*$')


@frozen
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
        head = read_regular(path, 200, partial=True).split(b"\n", 1)[0]
    except OSError:
        return None
    text = head.decode("ascii", errors="replace")
    if not text.startswith(MAIN_HEADER):
        return None
    try:
        return int(text[len(MAIN_HEADER) :].strip(), 16)
    except ValueError:
        return None


def _size(path: str) -> int:
    """The stacks file's size; -1 when it is missing or not a regular file
    (a link or a FIFO planted there is never read, its rank never signalled)."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def _not_regular(path: str) -> str | None:
    """Why the stacks file at ``path`` is not one the runner made (None: it
    is a regular file, or missing: the runner registered no handler)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file (a FIFO?)"
    return f"its stacks file {path} is {kind}, so it was not signalled"


def _read_from(path: str, offset: int) -> str:
    try:
        data = read_regular(path, MAX_STACK_BYTES, offset=max(0, offset), partial=True)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def signal_caught(pid: int, signum: int) -> bool | None:
    """Whether process ``pid`` catches ``signum`` (a handler installed, not
    the default action nor "ignore"): ``SigCgt`` in ``/proc/PID/status``.
    None when that cannot be read (no such process, one that exited, not Linux)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fp:
            status = fp.read(16384)
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(b"State:") and line.split()[1:2] in ([b"Z"], [b"X"]):
            return None  # exited: it has no handlers any more
        if line.startswith(b"SigCgt:"):
            try:
                mask = int(line.split(b":", 1)[1].strip(), 16)
            except ValueError:
                return None
            return bool(mask >> (signum - 1) & 1)
    return None


@dataclass
class Collected:
    """What :func:`collect` got: ``key -> dump`` of the ranks that answered,
    and ``key -> why`` of those it did not signal."""

    dumps: dict[int, str] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)


def _why_not(pid: int, signum: int) -> str | None:
    caught = signal_caught(pid, signum)
    if caught is None:
        return "its process status cannot be read (it was ending)"
    if not caught:
        return (
            f"the script changed the handler of {signal_name(signum)} (the signal is not "
            "caught any more: its default action would end the process), so it was not "
            "sent; choose another with --stack-signal"
        )
    return None


async def collect(
    workers: Mapping[int, tuple[int, str]],
    timeout: float = COLLECT_TIMEOUT,
    clock: Clock = SYSTEM_CLOCK,
    signum: int = STACK_SIGNAL,
    on_signal: Callable[[int], None] | None = None,
) -> Collected:
    """Ask each worker ``key -> (pid, stacks file)`` for its stacks with
    ``signum``; the dumps of those that answered within ``timeout``, and why
    the others were not asked. ``on_signal(key)`` is called just before a
    worker is signalled."""
    out = Collected()
    before: dict[int, int] = {}
    for key, (pid, path) in workers.items():
        size = _size(path)
        if size < 0:  # no handler registered (the signal would end it), or not ours
            problem = _not_regular(path)
            if problem is not None:
                out.skipped[key] = problem
            continue
        why = _why_not(pid, signum)
        if why is not None:
            out.skipped[key] = why
            continue
        if on_signal is not None:
            on_signal(key)
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
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
    for key, start in before.items():
        text = _read_from(workers[key][1], start)
        if text.strip():
            out.dumps[key] = text
    return out


def in_own_code(dump: str | None, main: int | None = None) -> bool:
    """Whether a rank's stack shows it in code of its own (not in torch, not
    ending: a frame to show). False without a dump."""
    return dump is not None and top_frame(dump, main) is not None and not in_torch(dump, main)


def hung_rank(
    judged: int,
    dumps: Mapping[int, tuple[str, int | None]],
    idle: Mapping[int, float | None],
    timeout: float,
) -> int:
    """The rank a hang is blamed on: ``judged`` (the one whose timeout
    expired first) when its stack shows it in code of its own; otherwise
    (it waits in torch, or it has no stack) the first rank whose stack shows
    it in code of its own and that made no progress for at least half the
    timeout; with none, ``judged``. ``dumps``: rank -> (dump, main thread id)
    of the ranks whose stacks were collected now; ``idle``: rank -> seconds
    since its last progress in this round (None or absent: unknown, never the
    culprit). The peers that wait for a hung rank stopped progressing with
    it, so their timeouts expire with its own: which timer fired first says
    nothing, the stacks do."""
    if in_own_code(*dumps.get(judged, (None, None))):
        return judged
    for r in sorted(dumps):
        seconds = idle.get(r)
        if in_own_code(*dumps[r]) and seconds is not None and seconds >= timeout / 2:
            return r
    return judged


# ------------------------------------------------------------ the report

MAX_FRAMES = NOTE_MAX_FRAMES  # frames kept of one rank's main thread (most recent first)
MAX_LINE = MAX_TEXT


@frozen
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
