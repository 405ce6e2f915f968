"""The worker's end of in-process restarts (stdlib only).

Loaded by the runner beside it (as ``_elastrun_restart``), which calls
:func:`install` with its channel to the agent and the round the process was
started in (``ELASTRUN_ROUND``, removed from the script's environment).
``elastrun.train.in_process`` finds the :data:`PORT` here (by the module's
name in ``sys.modules``: a worker the runner did not start has none, and its
function runs once, as without the wrapper).

The protocol (the messages: ``_messages.py``; the agent's side:
``agent/in_process.py``)::

    worker -> agent  InProcess           the script wrapped a function (once)
                     Restartable(round)  first entry into the function
                     Left(round, why)    left it (collective broken or aborted)
                     Entered(round)      entered it again
                     StandbyReady        (a standby) reached the function, waits
    agent -> worker  Abort(round)        leave round's function now
                     Enter(round, env)   enter it again for a newer round

A standby (``ELASTRUN_STANDBY=1``, agent/standby.py) starts with no rank and
no round (-1): at its first call of the wrapped function it says
``StandbyReady`` and waits for the ``Enter`` that gives it a rank; the
variables its rank names for the runner itself (its progress file, its stacks
file) are taken up then (the runner's ``late`` setup), before the function
is entered.

A thread reads the agent's messages. ``Abort`` for the round the process is
in calls the wrapper's abort (which aborts the process group, so that the
script's collectives end at once); an ``Abort`` or an ``Enter`` for any other
round is refused (counted in :attr:`Port.refused`): a process never acts on a
round it is not in, and never enters a round older than or equal to one it
was in.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import Any

ROUND_ENV = "ELASTRUN_ROUND"  # the round the worker was started in (the agent sets it)
STANDBY_ENV = "ELASTRUN_STANDBY"  # "1": a standby, started without a rank (agent/standby.py)
# A file of module names (one a line) a standby imports once its script reached
# its function, before it says it is ready: what the workers imported when the
# script last ran (the warm interpreter's list), torch's lazy imports among them
# (the first optimizer alone imports torch._dynamo: seconds).
PRELOAD_ENV = "ELASTRUN_STANDBY_PRELOAD"
PRELOAD_BUDGET = 120.0  # s of such imports, at most
MAX_PRELOAD_BYTES = 1 << 20
MAX_LINE = 1 << 16  # one message from the agent, at most

PORT: Port | None = None


def _messages() -> Any:
    import sys

    return sys.modules["_elastrun_messages"]


class Port:
    """The in-process restart protocol over the runner's channel."""

    def __init__(
        self,
        channel: Any,
        round_: int,
        standby: bool = False,
        late: Callable[[], None] = lambda: None,
        preload: str | None = None,
    ) -> None:
        self.channel = channel  # the runner's Channel: send(message)
        self.round = round_  # the round the process is in
        self.standby = standby  # no rank yet: it stands by at its first entry
        self.late = late  # the runner's setup from the rank's variables (a standby's)
        self.preload = preload  # a standby's file of modules to import while it waits
        self._told = False  # Restartable sent
        self._wrapped = False  # InProcess sent
        self.inside = False  # inside the function (an Abort may act)
        self.refused = 0  # stale or unexpected messages, ignored
        self.on_abort: Callable[[], None] = lambda: None
        self._lock = threading.Condition()
        self._aborted = False  # an Abort came for the current round
        self._enter: Any = None  # the Enter waited for
        self._closed = False
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------ the wrapper's calls
    def entering(self) -> None:
        """Into the function (first time: tells the agent it is restartable)."""
        M = _messages()
        with self._lock:
            first, self._told = not self._told, True
            self.inside, self._aborted = True, False
            r = self.round
        self._listen()
        if first:
            self.channel.send(M.Restartable(round=r))
        else:
            self.channel.send(M.Entered(round=r))

    def _listen(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="elastrun-restart", daemon=True)
            self._reader.start()

    def wrapped(self) -> None:
        """The script wrapped a function: tell the agent once (a worker's:
        its standbys may start now, while this process does its setup)."""
        with self._lock:
            first, self._wrapped = not self._wrapped, True
        if first and not self.standby:
            self.channel.send(_messages().InProcess())

    def stand_by(self) -> dict[str, str] | None:
        """A standby at its function: tell the agent it is ready and wait for
        a rank (the ``Enter``'s variables; None when the agent is gone)."""
        self._import_ahead()
        self._listen()
        self.channel.send(_messages().StandbyReady())
        env = self.wait_enter()
        self.standby = False
        return env

    def aborted(self) -> bool:
        with self._lock:
            return self._aborted

    def leaving(self, why: str) -> None:
        """Out of the function (its process group aborted): tell the agent."""
        with self._lock:
            self.inside = False
            r = self.round
        self.channel.send(_messages().Left(round=r, why=why))

    def wait_enter(self) -> dict[str, str] | None:
        """Block until the agent says to enter a newer round: its variables
        (the round taken); None when the channel is gone (the agent ended)."""
        with self._lock:
            while self._enter is None and not self._closed:
                self._lock.wait()
            enter, self._enter = self._enter, None
            if enter is None:
                return None
            self.round = enter.round
            return dict(enter.env)

    def _import_ahead(self) -> None:
        """The modules of ``preload`` (bounded: bytes, time); one that fails
        is skipped."""
        if not self.preload:
            return
        import importlib
        import time

        try:
            with open(self.preload, "rb") as f:
                names = f.read(MAX_PRELOAD_BYTES).decode("ascii", "replace").split()
        except OSError:
            return
        deadline = time.monotonic() + PRELOAD_BUDGET
        for name in names:
            if time.monotonic() > deadline:
                break
            with contextlib.suppress(Exception, SystemExit):
                importlib.import_module(name)

    # ------------------------------------------------------------ the agent's messages
    def _read(self) -> None:
        fd = self.channel.fd
        buf = b""
        while fd is not None:
            with contextlib.suppress(InterruptedError):
                select.select([fd], [], [], None)
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                self._handle(line)
            if len(buf) > MAX_LINE:
                break
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _handle(self, line: bytes) -> None:
        import json

        M = _messages()
        try:
            message = M.from_json(json.loads(line))
        except ValueError:
            self.refused += 1
            return
        abort = False
        with self._lock:
            if isinstance(message, M.Abort):
                if message.round == self.round and self.inside and not self._aborted:
                    self._aborted = abort = True
                else:
                    self.refused += 1
            elif isinstance(message, M.Enter):
                if message.round > self.round and not self.inside:
                    self._enter = message
                    self._lock.notify_all()
                else:
                    self.refused += 1
            else:
                self.refused += 1
        if abort:
            with contextlib.suppress(Exception):
                self.on_abort()


def install(
    channel: Any,
    round_text: str | None,
    numbers: Any,
    *,
    standby_text: str | None = None,
    late: Callable[[], None] = lambda: None,
    preload: str | None = None,
) -> None:
    """The runner's call: a port when the worker has a channel and a round,
    or is a standby (``late``: the runner's setup once a standby has a rank)."""
    global PORT
    if channel.fd is not None and standby_text == "1":
        PORT = Port(channel, -1, standby=True, late=late, preload=preload)
        return
    round_ = numbers.ascii_int(round_text or "")
    if channel.fd is not None and round_ is not None and round_ >= 0:
        PORT = Port(channel, round_)
