"""In-process restarts: a training function entered again after a group failure,
in the same process (docs/in_process.md).

::

    import elastrun.train

    model_weights = expensive_setup()          # runs once per process

    @elastrun.train.in_process
    def train() -> None:
        dist.init_process_group("gloo")        # env://: this round's RANK, MASTER_PORT, ...
        ...                                    # resume from the memory checkpoint, train

    train()

When the job's group fails (a peer's process died, a rank raised, the job's
membership changed), the agent asks every rank whose process may survive to
leave: the wrapper aborts its process group (so a collective waiting for a
peer ends now, not at its timeout), leaves the function, tells the agent and
waits. Once the next round forms, the agent sends the new round's variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ...): the wrapper sets them in ``os.environ``
and calls the function again. What the process built outside the function
(imports, data, models, compiled code) is kept.

A standby process (agent/standby.py) runs the script up to its first call of
the wrapper without a rank, then waits there until the agent hands it the
rank of a process that is gone, with that round's variables.

A rank whose function raised an exception of its own (not a broken
collective) is suspect: the exception goes on, the process ends and the agent
starts a new one. Outside elastrun (or under torchrun), the function is
called once, as if undecorated.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from elastrun.train import connections

__all__ = ["collective_broken", "current_round", "in_process"]

P = ParamSpec("P")
R = TypeVar("R")

PORT_MODULE = "_elastrun_restart"  # worker/_restart.py, as the runner loads it
PROGRESS_MODULE = "_elastrun_progress"  # worker/_progress.py, as the runner loads it
# What a collective broken by a peer says (gloo's transport, NCCL's watchdog).
BROKEN_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport",
    "NCCL communicator was aborted",
    "Broken pipe",
)
DISTRIBUTED_PATH = os.sep + os.path.join("torch", "distributed") + os.sep
# After an Abort, how long the function has to leave before the connections it
# opened are shut down under it (connections.py): the aborted group ends most
# waits at once; this ends the others (a wait on a live peer, on the store).
ABORT_GRACE = 2.0


def _port() -> Any:
    module = sys.modules.get(PORT_MODULE)
    return getattr(module, "PORT", None)


def current_round() -> int | None:
    """The rendezvous round this process trains in (None outside elastrun)."""
    port = _port()
    return None if port is None else int(port.round)


def collective_broken(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective ended by a peer or by an abort (the
    process may survive it), rather than an error of the rank's own: a
    ``torch.distributed`` error type, a transport's message, or raised from
    inside ``torch.distributed``."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if isinstance(dist_error, type) and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError | ValueError):
        return False
    text = str(exc)
    if any(m in text for m in BROKEN_MARKERS):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and DISTRIBUTED_PATH in frames[-1].filename


# The script's thread (its collective broke) and the port's (the agent's Abort)
# may both abort: one at a time, the second finds nothing left to abort.
_ABORT_LOCK = threading.Lock()


class _Retired:
    """The process groups this process aborted, held until the entry after
    the next one (:meth:`entered`), so that leaving never destroys one.

    A gloo group's destructor joins its worker threads, and runs where its
    last reference is dropped: in the wrapper's ``del e`` (a DDP wrapper's
    reducer in the old round's frames holds the group) or in the abort (which
    clears torch's table of groups), with the GIL held. A worker thread that
    is just ending a collective the abort broke frees the collective's work,
    which needs the GIL (the work holds Python objects of the thread that
    started it: the ``contextvars`` context that ``backward()`` stashes):
    each waits for the other, and the rank never leaves (found with gdb in a
    survivor of the example that was replaced at ``LEAVE_TIMEOUT``). Held a
    round longer, a group is destroyed once its threads have long ended their
    last work (they got the GIL while this process waited for its ``Enter``
    and trained a round), and its destructor only joins idle threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the port's thread holds too (an Abort)
        self._entry = 0  # entries into a wrapped function so far, in this process
        self._held: dict[int, list[Any]] = {}  # entry -> the groups aborted in it

    def hold(self, groups: list[Any]) -> None:
        """Groups aborted in the current entry."""
        with self._lock:
            self._held.setdefault(self._entry, []).extend(groups)

    def entered(self) -> None:
        """A wrapped function is entered: the groups of the entries before
        the last one are dropped (the last one's are kept)."""
        with self._lock:
            self._entry += 1
            old = [self._held.pop(n) for n in list(self._held) if n < self._entry - 1]
        del old  # destroyed here, out of the lock


_RETIRED = _Retired()


def _groups(c10d: Any) -> list[Any]:
    """Every process group torch knows of now (the default one among them)."""
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    return list(pg_map) if isinstance(pg_map, dict) else []


def _abort_groups() -> None:
    """Abort every process group (its collectives end now), held in
    :data:`_RETIRED`; no-op without one."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return
    with _ABORT_LOCK, contextlib.suppress(Exception):
        if c10d.is_initialized():
            _RETIRED.hold(_groups(c10d))
            abort = getattr(c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
            else:  # an older torch: destroy it
                c10d.destroy_process_group()


class _Entry:
    """The function's current entry, as the port's thread sees it on an Abort."""

    def __init__(self) -> None:
        self.number = 0  # entries so far
        self.spared: frozenset[str] = frozenset()  # sockets open before it

    def enter(self) -> None:
        self.spared = connections.snapshot()
        self.number += 1
        _RETIRED.entered()

    def abort(self, port: Any) -> None:
        """The agent's Abort: abort the groups now; if the function has not
        left within :data:`ABORT_GRACE`, shut down the connections this entry
        opened (the wait the abort did not end ends then)."""
        number, spared = self.number, self.spared
        _abort_groups()

        def still_inside() -> None:
            if port.inside and self.number == number:
                connections.shut_down(spared)

        timer = threading.Timer(ABORT_GRACE, still_inside)
        timer.daemon = True
        timer.start()


def _new_progress() -> None:
    """The hang watchdog judges a re-entered function from its first progress."""
    progress = getattr(sys.modules.get(PROGRESS_MODULE), "current", lambda: None)()
    if progress is not None:
        progress.reentering()


def in_process(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` so that elastrun may restart it in this process (see the
    module's docstring). The wrapped function returns ``fn``'s value once a
    call of it returns."""
    told = _port()
    if told is not None:
        told.wrapped()  # the agent may start its standbys now

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        port = _port()
        if port is None:
            return fn(*args, **kwargs)
        entry = _Entry()
        port.on_abort = lambda: entry.abort(port)
        if port.standby:  # set up without a rank: wait for one (agent/standby.py)
            env = port.stand_by()
            if env is None:
                raise SystemExit("elastrun: the agent is gone; this standby ends")
            os.environ.update(env)
            port.late()
        while True:
            entry.enter()
            port.entering()
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                if not isinstance(e, Exception) or not (port.aborted() or collective_broken(e)):
                    raise  # the rank's own error: its process is replaced
                # Before the old round's frames are freed (``del e``): freeing them (the
                # group, a DDP wrapper and its pending work) can wait in C++, holding the
                # GIL (so that no other thread of ours runs), for the group's threads,
                # which a wait on a live peer keeps (the abort does not end it). Measured
                # with the example, SIGKILL of one of 3 ranks: a survivor stopped in that
                # ``del`` until LEAVE_TIMEOUT in 4 of 6 runs; aborting and shutting down
                # this entry's connections first, in 1 of 13.
                _abort_groups()  # held: ``del e`` does not destroy them
                connections.shut_down(entry.spared)
                why = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
                del e  # no frame of the old round kept alive
            _abort_groups()  # whatever the freed frames left (a group made since)
            port.leaving(why)
            env = port.wait_enter()
            if env is None:
                raise SystemExit("elastrun: the agent is gone; this worker ends")
            os.environ.update(env)
            _new_progress()

    return wrapper
