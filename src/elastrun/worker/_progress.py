"""Automatic progress, for the hang watchdog and the straggler report (stdlib only).

Loaded by the worker runner (``_runner.py``) when the agent gives the worker a
progress file (``ELASTRUN_HEARTBEAT_FILE``). With no change to the script it
counts, through torch's process-wide hooks:

* **optimizer steps**: ``torch.optim``'s global step post-hook (plain loops,
  Lightning, accelerate and Hugging Face all step a ``torch.optim`` optimizer);
* **batches**: each batch a ``torch.utils.data.DataLoader`` yields (so an
  evaluation loop, which steps no optimizer, shows progress too);
* **checkpoint phases**: ``torch.save`` and ``torch.load`` run inside a
  ``checkpoint`` phase, as do elastrun.train's checkpoint helpers; a script
  may mark its own long phases with :func:`elastrun.train.phase`;
* explicit :func:`elastrun.train.heartbeat` calls.

A hook only updates a few numbers (no I/O, no lock). A daemon thread writes
the progress file, atomically, at most every ``ELASTRUN_HEARTBEAT_INTERVAL``
seconds and only when something changed; the agent reads it when one of its
timers fires. A worker stuck anywhere, even holding the GIL, writes nothing
new: no false progress. One line of JSON (schema 1, the heartbeat's, with
more fields)::

    {"v": 1, "pid": 1234, "step": 42, "monotonic": 51234.1,
     "steps": 40, "step_time": 0.051, "own_time": 0.02, "calib": 1.2,
     "phase": null, "phase_since": null,
     "first_at": 51200.3, "first_step": 1, "saving_s": 0.8, "first_saving_s": 0.3,
     "reported": false}

``monotonic`` is the time of the last progress (CLOCK_MONOTONIC, machine
wide); ``step_time`` the median of the recent optimizer step intervals;
``own_time`` the same outside backward passes and collectives (what tells
a straggler in DDP, where every rank's step lasts as long as the slowest's); ``calib`` this
rank's own calibrated timeout: ``max(GAP_QUANTILE_MULT x the
99th percentile of the recent gaps between two progress events,
GAP_MAX_MULT x the longest gap seen)``. The time spent in a phase is never a
gap: a checkpoint save does not teach the watchdog to wait longer for steps.
For the agent's goodput accounting (agent/goodput.py): ``first_at`` and
``first_step``, this process's first optimizer step (or reported step) and
when it ended; ``saving_s``, the seconds it spent in ``checkpoint`` phases so
far, and ``first_saving_s`` those before its first step (loading a checkpoint: part
of the start or restart, not taken from training); ``reported``, whether
``step`` is the script's own (``heartbeat(step)``)
rather than this process's count of optimizer steps.

The file is replaced through a new, randomly named file beside it
(``O_EXCL``, no link followed: ``elastrun/safefs.py``). A write that fails
(a full disk, a read-only or unwritable folder) never stops training, and
never leaves the agent judging a stale record. The worker says so once on
stderr and removes the stale file. If the runner has a channel to the agent,
it sends a ``ProgressFailed`` message there once, then each changed
snapshot as a ``Progress`` message (``_messages.py``), at most one per
interval, for as long as the file cannot be written. The file is tried again with backoff (the
interval, doubling up to ``MAX_BACKOFF``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

SCHEMA = 1
FILE_ENV = "ELASTRUN_HEARTBEAT_FILE"
INTERVAL_ENV = "ELASTRUN_HEARTBEAT_INTERVAL"
MAX_INTERVAL = 1.0
GAPS_KEPT = 512  # recent gaps between two progress events
STEPS_KEPT = 32  # recent optimizer step intervals (the step time)
GAP_QUANTILE_MULT = 10.0
GAP_MAX_MULT = 2.0
MIN_GAPS = 8  # fewer gaps than this: no calibration yet (the floor holds)
MAX_BACKOFF = 30.0  # s between two tries of a progress file that cannot be written
MAX_PHASE_NAME = 64
EXIT_JOIN = 1.0  # s the script's end waits for the writer thread
OPTIMIZER_MODULE = "torch.optim.optimizer"
DATALOADER_MODULE = "torch.utils.data.dataloader"


def _by_path(name: str, path: str) -> Any:
    """The stdlib-only file ``path`` (relative to this one's folder), loaded
    once as module ``name``: this file runs outside the package."""
    mod = sys.modules.get(name)
    if mod is None:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(name, os.path.join(here, path))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(mod)
    return mod


def safefs() -> Any:
    """``elastrun/safefs.py``, as ``_elastrun_safefs``."""
    return _by_path("_elastrun_safefs", os.path.join("..", "safefs.py"))


def numbers() -> Any:
    """``elastrun/untrusted.py`` (its ASCII numbers: ``ascii_int``,
    ``ascii_decimal``), as ``_elastrun_untrusted``."""
    return _by_path("_elastrun_untrusted", os.path.join("..", "untrusted.py"))


def messages() -> Any:
    """``_messages.py``, as ``_elastrun_messages`` (as the runner loads it)."""
    return _by_path("_elastrun_messages", "_messages.py")


def _median(values: deque[float]) -> float | None:
    if not values:
        return None
    import statistics  # here: with decimal and fractions, 4 ms of every worker's start

    return statistics.median(values)


# Sends one of _messages.py's messages to the agent (the runner's channel).
Send = Callable[[Any], None]


class Progress:
    """One worker's progress; hooks call :meth:`event`, a thread writes it.

    ``send``: the runner's channel to the agent (None: no channel), used
    only while the file cannot be written."""

    def __init__(
        self,
        path: str,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        send: Send | None = None,
    ) -> None:
        self.path = path
        self.send = send
        self.interval = max(0.01, min(MAX_INTERVAL, interval))
        self.clock = clock
        self.last: float | None = None  # the last progress
        self.step: int | None = None  # the script's step (heartbeat) or the count
        self.steps = 0  # optimizer steps
        self.changes = 0
        self.gaps: deque[float] = deque(maxlen=GAPS_KEPT)
        self.max_gap = 0.0
        self.step_times: deque[float] = deque(maxlen=STEPS_KEPT)
        self.own_times: deque[float] = deque(maxlen=STEPS_KEPT)
        self.waiting = 0.0  # s in backward passes and collectives since the last step
        self.last_step_at: float | None = None
        self.phase: str | None = None
        self.phase_since: float | None = None
        self.phase_depth = 0
        self.explicit = False  # the script reports its own steps (heartbeat(step))
        self.first_at: float | None = None  # this process's first step ended then
        self.first_step: int | None = None
        self.first_reported = False  # first_step is the script's own number
        self.saving = 0.0  # s spent in checkpoint phases, ended ones
        self.first_saving: float | None = None  # of them, before the first step
        self._written = -1
        self.failure: OSError | None = None  # the file's last write error (None: it works)
        self._backoff = 0.0
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------- events
    def event(self, step: int | None = None) -> None:
        """Progress happened now (a batch, a heartbeat)."""
        now = self.clock()
        last = self.last
        if last is not None and self.phase is None:
            gap = now - last
            self.gaps.append(gap)
            self.max_gap = max(self.max_gap, gap)
        self.last = now
        if step is not None:
            self.step = step
        self.changes += 1

    def optimizer_step(self, *_: Any) -> None:
        now = self.clock()
        self.steps += 1
        if self.last_step_at is not None and self.phase is None:
            interval = now - self.last_step_at
            self.step_times.append(interval)
            self.own_times.append(max(0.0, interval - self.waiting))
        self.waiting = 0.0
        self.last_step_at = now
        self.event(None if self.explicit else self.steps)
        self._first(now)

    def _first(self, now: float) -> None:
        if self.first_at is None:
            self.first_at, self.first_step = now, self.step
            self.first_saving = self.saving

    def heartbeat(self, step: int | None) -> None:
        if step is not None:
            self.explicit = True
        self.event(step)
        if step is not None and not self.first_reported:
            # The script's number for its first step (the count stood for it).
            self.first_reported = True
            self.first_step = step
            if self.first_at is None:
                self.first_at = self.last
                self.first_saving = self.saving

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        """A long phase (a checkpoint save): the watchdog allows it longer,
        and its duration is not a gap between two steps."""
        outer = self.phase_depth == 0
        if outer:
            self.phase = name[:MAX_PHASE_NAME]
            self.phase_since = self.clock()
            self.changes += 1
        self.phase_depth += 1
        try:
            yield
        finally:
            self.phase_depth -= 1
            if outer:
                if self.phase == "checkpoint" and self.phase_since is not None:
                    self.saving += max(0.0, self.clock() - self.phase_since)
                self.phase = self.phase_since = None
                # Progress resumes from here: the phase is no gap, and the
                # step in flight around it is no step time.
                self.last = self.clock()
                self.last_step_at = None
                self.changes += 1

    # ------------------------------------------------------------ numbers
    def step_time(self) -> float | None:
        return _median(self.step_times)

    def own_time(self) -> float | None:
        """The median step time outside backward passes and collectives: in
        DDP every rank's step lasts as long as the slowest's (the others wait
        in the backward pass's all-reduce), so this is what tells the slow rank."""
        return _median(self.own_times)

    def calibrated(self) -> float | None:
        """This rank's own timeout, learned from its gaps (None: too few)."""
        if len(self.gaps) < MIN_GAPS:
            return None
        ordered = sorted(self.gaps)
        q99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return max(GAP_QUANTILE_MULT * q99, GAP_MAX_MULT * self.max_gap)

    def snapshot(self) -> dict[str, Any]:
        st, own, calib = self.step_time(), self.own_time(), self.calibrated()
        return {
            "v": SCHEMA,
            "pid": os.getpid(),
            "step": self.step,
            "monotonic": self.last,
            "steps": self.steps,
            "step_time": None if st is None else round(st, 6),
            "own_time": None if own is None else round(own, 6),
            "calib": None if calib is None else round(calib, 3),
            "phase": self.phase,
            "phase_since": self.phase_since,
            "first_at": self.first_at,
            "first_step": self.first_step,
            "saving_s": round(self.saving, 6),
            "first_saving_s": None if self.first_saving is None else round(self.first_saving, 6),
            "reported": self.explicit,
        }

    # ------------------------------------------------------------- writing
    def write(self) -> None:
        """Write the file if anything changed; while it cannot be written,
        send the snapshot over the channel instead (never raises)."""
        changes = self.changes
        if changes == self._written or (self.last is None and self.phase is None):
            return
        try:
            snapshot = self.snapshot()
            line = json.dumps(snapshot) + "\n"
        except RuntimeError:  # a hook changed the numbers meanwhile: next time
            return
        self._written = changes
        if self.failure is None or self.clock() >= self._retry_at:
            try:
                safefs().write_atomic(self.path, line.encode())
            except OSError as e:
                self._failed(e)
            else:
                self.failure, self._backoff = None, 0.0
                return
        self._send(messages().Progress(snapshot, str(self.failure)))

    def _failed(self, error: OSError) -> None:
        """The file could not be written: said once, the stale file removed,
        the next try later."""
        self._backoff = min(MAX_BACKOFF, max(self.interval, 2 * self._backoff))
        self._retry_at = self.clock() + self._backoff
        if self.failure is not None:
            self.failure = error
            return
        self.failure = error
        how = (
            "its progress goes to the agent over the runner's channel meanwhile"
            if self.send is not None
            else "the hang watchdog cannot judge this worker meanwhile"
        )
        with contextlib.suppress(Exception):
            print(
                f"elastrun: worker pid {os.getpid()}: progress file {self.path} not "
                f"recorded: {error}; retrying with backoff; {how}",
                file=sys.stderr,
                flush=True,
            )
        self._send(messages().ProgressFailed(self.path, str(error)))
        # A stale record would look like a worker that stopped progressing.
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _send(self, message: Any) -> None:
        if self.send is not None:
            with contextlib.suppress(Exception):
                self.send(message)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="elastrun-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def stop(self) -> None:
        self._stop.set()

    def reentering(self) -> None:
        """An in-process restart (train/in_process.py): the process enters
        its training function again in a new round, which the watchdog judges
        only from its first progress, as a new worker's."""
        self.last = self.last_step_at = None
        self.waiting = 0.0
        self.changes += 1

    def exiting(self) -> None:
        """The script returned or raised: what follows (torch.distributed's
        shutdown, atexit handlers, the interpreter's teardown) is an ``exit``
        phase, judged from its start, as a checkpoint save is. Written at
        once, by this thread once the writer's has stopped (bounded)."""
        self.stop()
        if self.last is None:
            return  # no progress yet: nothing the watchdog judges
        thread = self._thread
        if thread is not None:
            thread.join(EXIT_JOIN)
            if thread.is_alive():
                return  # stuck writing: never two writers of one file
        self.phase, self.phase_since = "exit", self.clock()
        self.phase_depth += 1
        self.changes += 1
        self.write()


# ---------------------------------------------------------------- the hooks


def hook_optimizer(progress: Progress, mod: Any) -> None:
    register = getattr(mod, "register_optimizer_step_post_hook", None)
    if register is not None:
        register(progress.optimizer_step)


def hook_dataloader(progress: Progress, mod: Any) -> None:
    cls = getattr(mod, "_BaseDataLoaderIter", None)
    real = getattr(cls, "__next__", None)
    if cls is None or real is None or getattr(real, "_elastrun_progress", False):
        return

    @functools.wraps(real)
    def __next__(self: Any) -> Any:
        out = real(self)
        progress.event()
        return out

    __next__._elastrun_progress = True  # type: ignore[attr-defined]
    cls.__next__ = __next__


def _in_phase(progress: Progress, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(real, "_elastrun_progress", False):
        return real

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with progress.in_phase(name):
            return real(*args, **kwargs)

    wrapper._elastrun_progress = True  # type: ignore[attr-defined]
    return wrapper


def _timed(progress: Progress, real: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(real, "_elastrun_progress", False):
        return real
    clock = progress.clock

    @functools.wraps(real)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return real(*args, **kwargs)
        finally:
            progress.waiting += clock() - t0

    timed._elastrun_progress = True  # type: ignore[attr-defined]
    return timed


def hook_backward(progress: Progress, autograd: Any) -> None:
    """Time spent in ``torch.autograd.backward`` (``Tensor.backward`` calls it)."""
    real = getattr(autograd, "backward", None)
    if real is not None:
        autograd.backward = _timed(progress, real)


# Collectives a script (or Lightning, or accelerate) calls from Python: a
# rank waits in them for the slowest.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)


def hook_collectives(progress: Progress, dist: Any) -> None:
    """Time spent in ``torch.distributed``'s collectives."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:
            continue
        timed = _timed(progress, real)
        setattr(dist, name, timed)
        if c10d is not None and getattr(c10d, name, None) is real:
            setattr(c10d, name, timed)


def hook_torch(progress: Progress, torch: Any) -> None:
    """torch.save / torch.load run in a ``checkpoint`` phase; backward passes
    are timed."""
    autograd = sys.modules.get("torch.autograd")
    if autograd is not None:
        hook_backward(progress, autograd)
    serialization = sys.modules.get("torch.serialization")
    for name in ("save", "load"):
        real = getattr(torch, name, None)
        if real is None:
            continue
        wrapped = _in_phase(progress, "checkpoint", real)
        setattr(torch, name, wrapped)
        if serialization is not None and getattr(serialization, name, None) is real:
            setattr(serialization, name, wrapped)


_current: Progress | None = None


def current() -> Progress | None:
    """The worker's progress (None when the agent asked for none)."""
    return _current


def install(
    on_import: Callable[[str, Callable[[Any], None]], None], send: Send | None = None
) -> Progress | None:
    """Start recording progress if the agent gave a file. ``on_import(name,
    callback)`` calls ``callback(module)`` once ``name`` is imported (at once
    when it is already); ``send``: the runner's channel to the agent."""
    global _current
    path = os.environ.get(FILE_ENV)
    if not path:
        return None
    given = numbers().ascii_decimal(os.environ.get(INTERVAL_ENV, ""))
    interval = MAX_INTERVAL if given is None or given <= 0 else given
    progress = Progress(path, interval, send=send)
    on_import(OPTIMIZER_MODULE, functools.partial(hook_optimizer, progress))
    on_import(DATALOADER_MODULE, functools.partial(hook_dataloader, progress))
    on_import("torch", functools.partial(hook_torch, progress))
    on_import("torch.distributed", functools.partial(hook_collectives, progress))
    progress.start()
    _current = progress
    return progress
