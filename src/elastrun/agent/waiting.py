"""The console line that says what the agent waits for in the rendezvous.

The rendezvous only reports (:class:`~elastrun.rendezvous.api.WaitingStatus`,
through its ``progress`` callback, on each change); this printer shows it:

* on a terminal: one line redrawn in place (``\\r``) each second of the
  countdown and on each report, cleared when the wait ends;
* otherwise (a log file): a line on each change of the joined count, the state
  or the deadline, and every ``every`` seconds (10) while nothing changes.

Nothing is shown for waits shorter than ``quiet`` seconds (1): a recovery that
re-forms in 50 ms prints nothing. The timer is the printer's own (deadlines on
the injected clock); it never asks the rendezvous anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from typing import TextIO

from elastrun.clock import SYSTEM_CLOCK, Clock, duration_text, wait_until
from elastrun.rendezvous.api import WaitingStatus

__all__ = ["WaitingConsole", "describe"]


def _nodes(n: int) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} node" if n == 1 else f"{n} nodes"


def describe(status: WaitingStatus, left: float) -> str:
    """One line for ``status`` with ``left`` seconds to its deadline."""
    st = status
    what = "last call closes the round" if st.deadline == "last_call" else "join timeout"
    when = f"{what} in {duration_text(left, up=True)}"
    if st.state == "waiting":
        why = st.detail or f"round {st.round} is closed"
        if math.isinf(left):  # a hot spare: nothing counts down while the job runs
            return f"elastrun: waiting for the next round: {why}"
        return f"elastrun: waiting for the next round: {why}; {when}"
    seen = "" if st.live else " (as of this node's join)"
    if st.joined < st.min_nodes:
        count = f"{st.joined} of min {_nodes(st.min_nodes)} joined (max {st.max_nodes}){seen}"
    else:
        count = f"{_nodes(st.joined)} joined (min {st.min_nodes}, max {st.max_nodes}){seen}"
    return f"elastrun: rendezvous round {st.round}: {count}; {when}"


class WaitingConsole:
    """Prints rendezvous progress while :meth:`start`-ed (see the module doc)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        clock: Clock = SYSTEM_CLOCK,
        quiet: float = 1.0,
        every: float = 10.0,
    ) -> None:
        self.stream = stream
        self._tty = tty
        self.clock = clock
        self.quiet = quiet
        self.every = every
        self._status: WaitingStatus | None = None
        self._received = 0.0
        self._changed = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drawn = False

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        if self._tty is None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                return self._out().isatty()
            return False
        return self._tty

    # -- the progress callback ---------------------------------------------
    def update(self, status: WaitingStatus) -> None:
        old = self._status
        self._status, self._received = status, self.clock.monotonic()
        if old is None or (old.state, old.joined, old.deadline, old.round) != (
            status.state,
            status.joined,
            status.deadline,
            status.round,
        ):
            self._changed = True
        self._wake.set()

    # -- lifetime: around one next_round() -----------------------------------
    def start(self) -> None:
        self.stop()
        self._status, self._changed, self._drawn = None, False, False
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        if self._drawn:
            self._write("\r\x1b[K")
            self._drawn = False

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            out = self._out()
            out.write(text)
            out.flush()

    async def _sleep_until(self, deadline: float) -> None:
        with contextlib.suppress(TimeoutError):
            await wait_until(self._wake.wait(), deadline, self.clock)
        self._wake.clear()

    async def _run(self) -> None:
        started = self.clock.monotonic()
        while self.clock.monotonic() < started + self.quiet:
            await self._sleep_until(started + self.quiet)
        tty, last_print = self._is_tty(), -math.inf
        while True:
            now, st = self.clock.monotonic(), self._status
            next_at = math.inf
            if st is not None:
                left = st.seconds_left - (now - self._received)
                line = describe(st, left)
                if tty:
                    self._write("\r\x1b[K" + line)
                    self._drawn = True
                    # Redraw when the displayed second changes.
                    frac = left - math.floor(left) if not math.isinf(left) else 1.0
                    next_at = now + (frac if frac > 0.01 else 1.0)
                else:
                    # Nothing counting down (a hot spare waits as long as the job
                    # runs): a line on each change only, not one every 10 s.
                    periodic = not math.isinf(left)
                    if self._changed or (periodic and now >= last_print + self.every):
                        self._write(line + "\n")
                        last_print = now
                    next_at = last_print + self.every if periodic else math.inf
                self._changed = False
            await self._sleep_until(next_at)
