"""Memory checkpoints: a training state copied into shared memory that the
agent holds, cheap enough to take every step.

::

    mem = MemoryCheckpoint("checkpoints", persist_every=50)
    state = mem.load()                      # every rank, at start
    ...
    mem.save({"model": ..., "optimizer": ..., "step": step}, step=step)   # every step

:meth:`MemoryCheckpoint.save` returns once the state's tensors are copied
into a *slot* of this worker's folder in shared memory (``/dev/shm``, made
private by the agent for the worker's local rank, named in
``ELASTRUN_MEMORY_CHECKPOINT_DIR``). A thread of the worker then hashes the
copy and commits it (its header, then its magic: see
:mod:`elastrun.worker.snapshot`); the next ``save`` waits for that first.
The slots are reused (no new memory per save) and written in turn, never
the newest one nor one the agent is reading, so a worker killed in the
middle of a copy leaves the previous snapshots intact, and the agent's
background work never blocks training. The agent keeps the slots across
worker restarts and writes the snapshots marked ``persist`` (every
``persist_every`` steps, or ``persist=True``) to ``directory`` as checkpoint
files (atomically, with checksum records), in the background.

:meth:`MemoryCheckpoint.load` is called by every rank at start: each rank
lists the steps its own slots hold (their headers checked: the data of
the step the ranks choose is then checked against its digest),
the ranks all-gather them and take the highest step that every rank holds;
each rank then loads its own copy (no disk read). For a state that is the
same on every rank (``shared=True``), the highest step any rank holds, sent
by its holder to the ranks without it (:mod:`elastrun.train.memory_load`).
The marked steps (``replicate_every``, and the ``persist`` ones) are also
sent by the agent to the next node's agent, which holds them as a replica:
a node that replaces a lost one gets the lost ranks' states from there,
and the ranks count those replicas when they agree. When no step is common
(a rank is new, or shared memory was lost with its node), every rank falls
back to :func:`~elastrun.train.load_checkpoint` on ``directory`` (the
newest intact disk checkpoint the ranks agree on). So the ranks always
agree on one step.

Without elastrun's agent (``python train.py``, torchrun), or when shared
memory has no room for the state (``/dev/shm`` is 64 MB in many
containers), ``save`` writes the ``persist`` saves to disk with
:func:`~elastrun.train.save_checkpoint` and skips the others, after one
warning line that says why.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elastrun.errors import ConfigError
from elastrun.train.checkpoint import load_checkpoint, save_checkpoint
from elastrun.train.context import env_int
from elastrun.train.heartbeat import phase
from elastrun.train.host_copy import HostCopier, Pending
from elastrun.train.log import Log, say
from elastrun.train.memory_load import restore
from elastrun.train.sharded import memory_state, usable
from elastrun.train.state_codec import Flat, flatten
from elastrun.worker import memory_limit
from elastrun.worker.local_main import is_local_main
from elastrun.worker.snapshot import (
    ENV,
    MAGIC,
    MAX_SLOTS,
    PREFIX,
    REPLICA_ENV,
    CommitNote,
    Marked,
    Persist,
    SaveTotals,
    SlotView,
    SnapshotError,
    SnapshotHeader,
    Torn,
    check_header_size,
    data_offset,
    open_fd,
    open_slot,
    read_persisted,
    snapshots,
)
from elastrun.worker.snapshot_digest import data_digest, preferred

__all__ = ["ENV", "MemoryCheckpoint"]

LOCK_WAIT = 120.0  # s a save waits for a slot when every other slot is being read
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


class _NoRoom(Exception):
    pass


class _Totals:
    """This process's saves into shared memory so far (every MemoryCheckpoint
    of it: they share its folder), written in each commit note."""

    saves = 0
    blocked_s = 0.0
    nbytes = 0

    @classmethod
    def counted(cls, blocked_s: float, nbytes: int) -> None:
        cls.saves += 1
        cls.blocked_s += blocked_s
        cls.nbytes += nbytes

    @classmethod
    def now(cls) -> SaveTotals:
        return SaveTotals(os.getpid(), cls.saves, cls.blocked_s, cls.nbytes)


class _Uncommitted(SnapshotError):
    """A slot newer than its folder's commit note: its worker stopped between
    the slot's magic and the note (or the note could not be written)."""


class _Slots:
    """This worker's slot files: open, mapped, and written in turn."""

    def __init__(
        self, folder: str, count: int, unmapping: Callable[[int], None] = lambda i: None
    ) -> None:
        self.folder = folder
        self.count = count
        self.unmapping = unmapping  # told before a slot's mapping is closed
        self.fds: dict[int, int] = {}
        self.maps: dict[int, mmap.mmap] = {}
        self.gens: dict[int, int] = {}  # the generation each slot holds (-1: none)
        self.marked: Marked | None = None  # kept until the agent has written it
        # The mark before it, kept (with 4 slots or more) until the agent is done
        # with the newest: the step a neighbour's replica holds until then.
        self.previous: Marked | None = None
        with contextlib.suppress(SnapshotError):
            note = CommitNote.read(folder)
            self.marked = None if note is None else note.marked
        for i in range(count):  # what an earlier worker of this rank left
            try:
                view = open_slot(self.path(i))
            except (SnapshotError, OSError):
                view = None
            if view is not None:
                self.gens[i] = view.header.generation
                view.close()

    def path(self, i: int) -> str:
        return os.path.join(self.folder, f"slot-{i}")

    def _fd(self, i: int) -> int:
        if i not in self.fds:
            self.fds[i] = open_fd(self.path(i), os.O_RDWR | os.O_CREAT)
        return self.fds[i]

    def _lock(self) -> int:
        """Lock a slot to write: not a kept one, nor one being read; waits
        (bounded) when there is none (2 slots and a disk write pending)."""
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            kept = self._kept()
            for i in sorted((i for i in range(self.count) if i not in kept), key=self._age):
                try:
                    fcntl.flock(self._fd(i), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return i
                except BlockingIOError:
                    continue
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"memory checkpoint: no slot in {self.folder} became free for "
                    f"{LOCK_WAIT:.0f}s (read by another process, or a disk write pending)"
                )
            time.sleep(0.01)

    def _kept(self) -> set[int]:
        """The slots not to write: the newest, and the marked one: until the
        agent is done with it (2 slots), or until the next mark (3 or more:
        so that the step a neighbour holds as a replica stays here too); with
        4 or more, the mark before it too, until the agent is done with the
        newest one (sent: the neighbour's replica holds it)."""
        kept = {max(self.gens, key=lambda i: self.gens[i])} if self.gens else set()
        m, prev = self.marked, self.previous
        if m is None or self.gens.get(m.slot) != m.generation:
            return kept
        pending = read_persisted(self.folder) < m.generation
        if self.count > 2 or pending:
            kept.add(m.slot)
        if self.count > 3 and pending and prev and self.gens.get(prev.slot) == prev.generation:
            kept.add(prev.slot)
        return kept

    def acquire(self, size: int) -> tuple[int, mmap.mmap]:
        """A slot of at least ``size`` bytes, locked, its magic cleared."""
        i = self._lock()
        fd = self._fd(i)
        self.gens[i] = -1
        try:
            if os.fstat(fd).st_size >= len(MAGIC):
                os.pwrite(fd, bytes(len(MAGIC)), 0)  # no magic: not a snapshot until committed
            if (have := os.fstat(fd).st_size) < size:
                # tmpfs pages count against the container's memory limit: past
                # it, an OOM kill instead of an error (worker/memory_limit.py).
                if (over := memory_limit.refusal(size - have)) is not None:
                    raise _NoRoom(over)
                self._unmap(i)
                try:
                    os.posix_fallocate(fd, 0, size)  # tmpfs: the pages now, or ENOSPC
                except OSError as e:
                    if e.errno in _NO_ROOM:
                        raise _NoRoom(str(e)) from None
                    if e.errno != errno.EOPNOTSUPP:
                        raise
                    os.ftruncate(fd, size)
            if i not in self.maps:
                self.maps[i] = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise
        return i, self.maps[i]

    def _age(self, i: int) -> tuple[int, int]:
        # The oldest first; a slot that exists before one to be created.
        return (self.gens.get(i, -1), 0 if os.path.exists(self.path(i)) else 1)

    def commit(self, i: int, header: bytes, generation: int) -> None:
        mm = self.maps[i]
        mm[PREFIX : PREFIX + len(header)] = header
        mm[len(MAGIC) : PREFIX] = len(header).to_bytes(8, "little")
        mm[0 : len(MAGIC)] = MAGIC
        self.gens[i] = generation
        fcntl.flock(self.fds[i], fcntl.LOCK_UN)

    def release(self, i: int) -> None:
        fcntl.flock(self.fds[i], fcntl.LOCK_UN)

    def _unmap(self, i: int) -> None:
        mm = self.maps.pop(i, None)
        if mm is not None:
            self.unmapping(i)
            mm.close()

    def close(self, remove: bool = False) -> None:
        for i in list(self.maps):
            self._unmap(i)
        for i, fd in self.fds.items():
            os.close(fd)
            if remove:
                Path(self.path(i)).unlink(missing_ok=True)
        self.fds.clear()


class _Committer:
    """The thread that hashes and commits each save, so that ``save``
    returns once the copy is made (no thread is started per save). At the
    interpreter's exit, the save in progress is committed first."""

    def __init__(self, commit: Callable[[int, SnapshotHeader, int, bool, Pending], None]) -> None:
        self.idle = threading.Event()
        self.idle.set()
        self._commit = commit
        self._jobs: queue.SimpleQueue[tuple[int, SnapshotHeader, int, bool, Pending] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="elastrun-memory-checkpoint")
        self._thread.daemon = True
        self._thread.start()
        atexit.register(self.idle.wait)

    def put(self, i: int, header: SnapshotHeader, start: int, mark: bool, copied: Pending) -> None:
        self.idle.clear()
        self._jobs.put((i, header, start, mark, copied))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._commit(*job)
            finally:
                self.idle.set()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        atexit.unregister(self.idle.wait)


class MemoryCheckpoint:
    """In-memory checkpoints held by elastrun's agent (see the module doc).

    ``directory``: the disk checkpoint folder (``persist`` saves go there, and
    :meth:`load` falls back to it); None: memory only. ``keep``: disk
    checkpoints kept there (0: all). ``persist_every``: mark every N-th step
    for the disk (0: only saves with ``persist=True``). ``replicate_every``:
    mark every N-th step for the neighbour node's agent, which holds it as a
    replica for node loss (None: the disk marks; 0: none). ``slots``: snapshots
    kept per rank in shared memory (2 to 8; 3 lets the agent persist one
    while the worker writes another; 2 uses less memory, but a save may then
    wait for the agent's disk write; default 3, and 4 when the marks are
    sent to a neighbour node, so that the previous mark stays until the
    newest one's replica has arrived). ``log``: where the lines go (rank 0's
    restore line, the one fallback warning); None: silence.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        keep: int = 3,
        persist_every: int = 0,
        replicate_every: int | None = None,
        slots: int | None = None,
        log: Log = print,
    ) -> None:
        replicated = bool(os.environ.get(REPLICA_ENV)) and (
            (persist_every if replicate_every is None else replicate_every) > 0
        )
        slots = slots if slots is not None else 4 if replicated else 3
        if not 2 <= slots <= MAX_SLOTS:
            raise ConfigError(f"memory checkpoint: slots must be 2..{MAX_SLOTS}, got {slots}")
        if persist_every < 0 or keep < 0 or (replicate_every or 0) < 0:
            raise ConfigError(
                "memory checkpoint: persist_every, replicate_every and keep must be >= 0"
            )
        self.replicate_every = persist_every if replicate_every is None else replicate_every
        self.directory = None if directory is None else os.path.abspath(directory)
        self.keep = keep
        self.persist_every = persist_every
        self.log = log
        self.folder = os.environ.get(ENV) or None
        self.replicas = os.environ.get(REPLICA_ENV) or None
        self.last_blocked_s = 0.0  # how long the last save kept the caller waiting
        self.last_waited_s = 0.0  # of which waiting for the save before it to be committed
        self.last_commit_s = 0.0  # how long the last commit took (copies done, hash, notes)
        self._copier = HostCopier(log)
        self._slots: _Slots | None = None
        self._slot_count = slots
        self._thread: _Committer | None = None
        self._error: BaseException | None = None
        self._fallback: str | None = None
        self._warned = False
        if self.folder is None:
            self._fallback = (
                "no elastrun agent holds memory checkpoints here (launched without elastrun, "
                "or the agent could not make its shared memory folder: see its event log)"
            )

    # ------------------------------------------------------------ saving
    @property
    def in_memory(self) -> bool:
        """Whether saves go to shared memory (False: the disk fallback)."""
        return self._fallback is None

    def _persist(self, step: int, persist: bool | None) -> Persist | None:
        if self.directory is None:
            return None
        every = self.persist_every
        if persist or (persist is None and every > 0 and step % every == 0):
            return Persist(self.directory, self.keep)
        return None

    def save(self, state: Mapping[Any, Any], *, step: int, persist: bool | None = None) -> None:
        """Copy ``state`` into shared memory as ``step`` (see the class doc)."""
        t0 = time.perf_counter()
        if step < 0:
            raise ConfigError(f"memory checkpoint step must be >= 0, got {step}")
        # All of it keeps the step waiting: a checkpoint phase (the agent's
        # goodput accounting counts it as time blocked in saves).
        with phase("checkpoint"):
            self.wait()
            self.last_waited_s = time.perf_counter() - t0
            flat = flatten(state)  # ConfigError naming a key that cannot be copied
            target = self._persist(step, persist)
            every = self.replicate_every
            mark = target is not None or (every > 0 and step % every == 0)
            if self._fallback is None:
                try:
                    self._save_memory(flat, step, target, mark, t0)
                except _NoRoom as e:
                    self._fall_back(flat.data_size, str(e))
            if self._fallback is not None and not self._warned:
                self._warn()
            if self._fallback is not None and target is not None:
                save_checkpoint(state, target.directory, step=step, keep=target.keep)
        self.last_blocked_s = time.perf_counter() - t0

    def _save_memory(
        self, flat: Flat, step: int, target: Persist | None, mark: bool, t0: float
    ) -> None:
        assert self.folder is not None
        if self._slots is None:
            self._slots = _Slots(self.folder, self._slot_count, self._copier.unmapping)
        rank, world = _rank_world()
        header = SnapshotHeader(
            step=step,
            rank=rank,
            world_size=world,
            generation=time.time_ns(),
            data_size=flat.data_size,
            sha256="0" * 64,  # the same length as the real one, written on commit
            tensors=flat.entries,
            tree=flat.tree,
            persist=target,
            digest=preferred(),
        )
        encoded = header.encode()
        why = check_header_size(encoded)
        if why is not None:
            raise ConfigError(
                f"memory checkpoint: the state at step {step} is too large to describe: {why}; "
                "keep large data in tensors (a header holds each tensor's place and the "
                "state's other values)"
            )
        start = data_offset(len(encoded))
        i, mm = self._slots.acquire(start + flat.data_size)
        try:
            with phase("checkpoint"):
                copied = self._copier.copy(flat, i, mm, start)  # GPU copies: queued
        except BaseException:
            self._slots.release(i)
            raise
        flat.tensors.clear()  # the caller's tensors are held only until their copies are done
        # Counted before the commit is queued, so that its note carries this
        # save (the caller waits for nothing more after this).
        _Totals.counted(time.perf_counter() - t0, flat.data_size)
        self._committer().put(i, header, start, mark, copied)

    def _commit(
        self, i: int, header: SnapshotHeader, start: int, mark: bool, copied: Pending
    ) -> None:
        slots = self._slots
        assert slots is not None
        t0 = time.perf_counter()
        try:
            copied.wait()  # the GPU's copies into the slot done
            with memoryview(slots.maps[i]) as view:
                digest = data_digest(view[start : start + header.data_size], header.digest)
            final = dataclasses.replace(header, sha256=digest)
            slots.commit(i, final.encode(), header.generation)
            if mark:
                slots.previous, slots.marked = (
                    slots.marked,
                    Marked(i, header.generation, header.step),
                )
            note = CommitNote(i, header.generation, header.step, slots.marked, _Totals.now())
            note.write(slots.folder)
            self.last_commit_s = time.perf_counter() - t0
        except BaseException as e:
            self._error = e
            slots.release(i)

    def _committer(self) -> _Committer:
        if self._thread is None:
            self._thread = _Committer(self._commit)
        return self._thread

    def wait(self) -> None:
        """Wait until the last save is committed (its error, if any, raised)."""
        if self._thread is not None:
            self._thread.idle.wait()
        if self._error is not None:
            e, self._error = self._error, None
            raise ConfigError(f"memory checkpoint: the last save failed: {e}") from e

    def _fall_back(self, size: int, why: str) -> None:
        folder = self.folder or "/dev/shm"
        try:
            st = os.statvfs(folder)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        self._fallback = f"shared memory has no room for {size / 2**20:.1f} MiB ({free}: {why})"
        if self._slots is not None:
            self._slots.close(remove=True)  # no stale copy outlives the fallback
            self._slots = None

    def _warn(self) -> None:
        self._warned = True
        where = "to disk every persist step only" if self.directory else "nowhere (no directory)"
        if self.folder is None:
            # No agent (torchrun, a plain script): the same for every rank of the node, so
            # said once, by local rank 0; shared memory's room is not what is missing.
            if os.environ.get("LOCAL_RANK", "0") not in ("", "0"):
                return
            say(
                self.log,
                f"=> warning: memory checkpoints off: {self._fallback}; saving {where}. "
                "Launch with elastrun to keep them in memory (docs/training.md: memory "
                "checkpoints)",
            )
            return
        say(
            self.log,
            f"=> warning: memory checkpoints off: {self._fallback}; saving {where}. Give "
            "/dev/shm room for 3x the state per rank (docs/training.md: memory checkpoints)",
        )

    def close(self) -> None:
        """Wait for the last save, then let go of the slots (they stay with the agent)."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.stop()
                self._thread = None
            if self._slots is not None:
                self._slots.close()
                self._slots = None

    # ------------------------------------------------------------ loading
    def load(
        self, *, group: Any = None, map_location: Any = "cpu", shared: bool = False
    ) -> dict[str, Any] | None:
        """Agree with the other ranks on one step and return its state (every
        rank must call it; see the module doc and :mod:`elastrun.train.memory_load`).
        ``shared``: the state is the same on every rank (data parallel), so a
        rank without the agreed step gets it from one that has it. None:
        nothing anywhere."""
        with phase("checkpoint"):
            views = self._listed(self.folder) if self.folder is not None else []
            replicas = self._listed(self.replicas) if self._lists_replicas() else []
            views, replicas = usable(views, replicas, group=group, log=self.log)  # sharded
            try:
                state = restore(
                    views,
                    replicas=replicas,
                    shared=shared,
                    group=group,
                    map_location=map_location,
                    log=self.log,
                )
            finally:
                for v in views + replicas:
                    v.close()
            if state is not None:
                state = memory_state(state)  # DTensors' shards back on their mesh
            if state is not None or self.directory is None:
                return state
            return load_checkpoint(
                self.directory, group=group, map_location=map_location, keep=self.keep, log=self.log
            )

    def _lists_replicas(self) -> bool:
        """The node's replicas are listed by its real local rank 0 only (every
        rank's LOCAL_RANK is 0 under --virtual-local-rank)."""
        return self.replicas is not None and is_local_main(os.environ)

    def _listed(self, folder: str | None) -> list[SlotView]:
        """The snapshots of ``folder`` whose header passes every check (bounds,
        seal, tree: :func:`~elastrun.worker.snapshot.parse_header`) and agrees
        with the folder's commit note. Each one that does not is named in one
        line, and skipped: the older ones serve. Their data is checked against
        its digest only if the ranks choose it (:mod:`elastrun.train.memory_load`)."""
        assert folder is not None
        try:
            note = CommitNote.read(folder)
        except SnapshotError:
            note = None  # a damaged note vouches for nothing, and rejects nothing
        views = []
        for v in snapshots(folder):
            if isinstance(v, Torn):
                continue  # torn by a kill mid-copy, or being written: not a snapshot
            if isinstance(v, SnapshotError):
                path, _, why = str(v).partition(": ")
                say(self.log, f"=> memory checkpoint {path} is damaged ({why}); not used")
                continue
            try:
                _check_note(v, note)
            except SnapshotError as e:
                what = "was never committed" if isinstance(e, _Uncommitted) else "is damaged"
                say(self.log, f"=> memory checkpoint {v.path} {what} ({e}); not used")
                v.close()
                continue
            views.append(v)
        return views


def _check_note(view: SlotView, note: CommitNote | None) -> None:
    """SnapshotError when ``view`` contradicts the commit note of its folder
    (slots only: replicas have none): the note names the newest commit's
    slot, generation and step, and the marked one's. A slot newer than the
    note was never committed (its worker stopped before the note), and a
    slot of a noted generation holds that step in that slot: a header
    whose step was edited, even with its hashes made again, does not."""
    h = view.header
    if note is None or not os.path.basename(view.path).startswith("slot-"):
        return
    if h.generation > note.generation:
        raise _Uncommitted(
            f"its generation {h.generation} is newer than its commit note's {note.generation}"
        )
    name = os.path.basename(view.path)
    for noted in (note, note.marked):
        if (
            noted is not None
            and noted.generation == h.generation
            and (h.step, name) != (noted.step, f"slot-{noted.slot}")
        ):
            raise SnapshotError(
                f"it says step {h.step}, and its commit note step {noted.step} in "
                f"slot-{noted.slot} for its generation"
            )


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return env_int(os.environ, "RANK", 0), env_int(os.environ, "WORLD_SIZE", 1)
