"""Memory checkpoints held by the agent: the workers' snapshots in shared
memory, kept across worker restarts and written to disk in the background.

The agent makes a private folder (0700) per local rank,
``/dev/shm/elastrun-<uid>/<run id>/<agent pid>/local-<N>``, and names it in
the worker's environment (``ELASTRUN_MEMORY_CHECKPOINT_DIR``). What a worker
puts there (:mod:`elastrun.train.memory`; the format:
:mod:`elastrun.worker.snapshot`) outlives the worker: a restarted worker of
the same local rank finds it and resumes from it, without a disk read.

In the background the agent watches each folder's commit note (every
``POLL`` seconds, one small file per rank). A snapshot the worker marked
``persist`` is written to its checkpoint folder as ``ckpt-<step>.pt`` (the
snapshot's bytes, checked against its SHA-256 while they are written; the
usual checksum record; the ``latest`` pointer; old ones pruned: see
:mod:`elastrun.worker.checkpoint_files`) in ``torch.save``'s format, which
``torch.load(weights_only=True)`` reads (:mod:`elastrun.worker.torch_file`),
in a thread, one at a time: when
several are marked meanwhile, the newest of each rank is written next (the
others are skipped, never queued without bound). It reads the slot under a
shared lock, which the worker's writes go around (it has more slots), so
training never waits for the disk. Events: ``memory_checkpoint_persisted``,
``memory_checkpoint_persist_failed`` (and one console line for the first
failure).

For node loss, each agent also holds a *replica* of the next-lower node's
marked snapshots (group rank order, the first node holding the last one's):
after writing a marked snapshot to disk (or in its place, when it is marked
only for replication), the agent sends it to the next node's agent
(:mod:`elastrun.agent.replica`: the wire, its key, its bounds), which keeps
them in ``<folder>/replica`` and names that folder in the workers'
``ELASTRUN_MEMORY_CHECKPOINT_REPLICAS``. A restarted world's ranks count
them when they agree on a step (:mod:`elastrun.train.memory_load`). Events:
``memory_replica_sent``, ``memory_replica_send_failed``,
``memory_replica_received``, ``memory_replica_refused``.

The folders go when the agent ends; when it is killed, its orphan guard
removes them (agent/guard.py), and should that fail too, the next agent of
the run on this host removes the folders of agents whose pid is gone.
The agent never imports torch: it copies bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.process import Worker
from elastrun.agent.replica import (
    Received,
    ReplicaError,
    ReplicaHold,
    replica_key,
    send_snapshot,
)
from elastrun.agent.workers import WorkerGroup
from elastrun.event_kinds import (
    MemoryCheckpointPersisted,
    MemoryCheckpointPersistFailed,
    MemoryReplicaReceived,
    MemoryReplicaRefused,
    MemoryReplicaSendFailed,
    MemoryReplicaSent,
)
from elastrun.frozen import frozen
from elastrun.procs import pid_alive
from elastrun.rendezvous.api import RoundResult, whole
from elastrun.rendezvous.notes import ReplicaNote, seats
from elastrun.safefs import UnsafePath, private_dir
from elastrun.worker.checkpoint_files import publish, write_checkpoint
from elastrun.worker.snapshot import (
    ENV,
    HASH_CHUNK,
    MAGIC,
    PREFIX,
    REPLICA_ENV,
    CommitNote,
    Marked,
    SaveTotals,
    SlotView,
    SnapshotError,
    TensorEntry,
    open_slot,
    write_persisted,
)
from elastrun.worker.snapshot_digest import DataDigest, UnknownDigest
from elastrun.worker.torch_file import write_torch_file

__all__ = [
    "ENV",
    "REPLICA_ENV",
    "MemoryCheckpoints",
    "features",
    "persist_snapshot",
    "saves_since",
]

ROOT_ENV = "ELASTRUN_MEMORY_CHECKPOINT_ROOT"  # where the folders go (MemorySettings.root)
POLL = 0.2  # s between looks at the commit notes
CLOSE_WAIT = 60.0  # s the agent's end waits for a disk write in progress
REPLICA_WAIT = 10.0  # s a mark is kept for the previous node's replicas of its step
ADDRESS_WAIT = 5.0  # s to resolve the previous node's address (the slot kept for it)


def features(core: Core) -> list[Feature]:
    return [MemoryCheckpoints(core)]


@frozen
class Neighbour:
    """Where this round's marked snapshots go: the next node's replica port."""

    host: str
    port: int
    node_id: str


@frozen
class Persisted:
    """A snapshot written to disk: where, its step, size and SHA-256."""

    path: str
    step: int
    size: int
    sha256: str


def persist_snapshot(view: SlotView) -> Persisted:
    """Write the snapshot ``view`` holds to its checkpoint folder (its header
    names it) as a ``torch.save`` file (:mod:`elastrun.worker.torch_file`:
    ``torch.load(weights_only=True)`` reads it), checking its data against
    the header's digest as it goes: a mismatch leaves nothing behind
    (SnapshotError)."""
    header = view.header
    target = header.persist
    if target is None:
        raise SnapshotError("it is not marked to be written to disk")
    d = Path(target.directory)
    d.mkdir(parents=True, exist_ok=True)
    data = view.data
    with view.whole as whole:  # the sealed header, as the slot holds it
        hlen = int.from_bytes(whole[len(MAGIC) : PREFIX], "little")
        header_bytes = bytes(whole[PREFIX : PREFIX + hlen])

    try:
        DataDigest(header.digest)  # a digest this agent knows, before a byte is written
    except UnknownDigest as e:
        raise SnapshotError(str(e)) from None

    def write(f: IO[bytes]) -> None:
        data_sha = DataDigest(header.digest)  # afresh for each try of the write
        done = 0  # the data hashed so far (tensors and the padding between them)

        def chunks(e: TensorEntry) -> Iterator[memoryview]:
            nonlocal done
            data_sha.update(data[done : e.offset])
            for i in range(e.offset, e.offset + e.nbytes, HASH_CHUNK):
                chunk = data[i : min(i + HASH_CHUNK, e.offset + e.nbytes)]
                data_sha.update(chunk)
                yield chunk
            done = e.offset + e.nbytes

        write_torch_file(f, "archive", header, header_bytes, chunks)
        data_sha.update(data[done:])
        if data_sha.hexdigest() != header.sha256:
            raise SnapshotError("its data does not match its digest (changed while read?)")

    final, digest = write_checkpoint(d, header.step, write)
    publish(d, final, target.keep)
    return Persisted(str(final), header.step, final.stat().st_size, digest)


def saves_since(last: SaveTotals | None, now: SaveTotals) -> SaveTotals:
    """The saves a worker made between two looks at its commit note (``last``:
    None at the first): those of ``now`` less those of ``last``, or all of
    ``now``'s when it is another process (a restarted worker counts from 0)."""
    if last is None or last.pid != now.pid or now.saves < last.saves:
        return now
    return SaveTotals(
        now.pid,
        now.saves - last.saves,
        max(0.0, now.blocked_s - last.blocked_s),
        max(0, now.nbytes - last.nbytes),
    )


class MemoryCheckpoints(Feature):
    """The agent's part of memory checkpoints (see the module doc)."""

    def __init__(self, core: Core, root: str | None = None, poll: float = POLL) -> None:
        self.core = core
        self.settings = core.spec.memory
        self.root = root or self.settings.root
        self.poll = poll
        self.base: str | None = None
        self.folders: dict[int, str] = {}  # local rank -> its folder
        self._seen: dict[int, int] = {}  # local rank -> newest generation looked at
        self._totals: dict[int, SaveTotals] = {}  # local rank -> its saves last looked at
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._warned = False
        self.hold: ReplicaHold | None = None
        self.port: int | None = None
        self.result: RoundResult | None = None  # the round now running
        self._neighbour: Neighbour | None = None
        self._awaited = -1  # the newest step whose replicas were waited for
        self._replicas_off = False
        self._expecting: asyncio.Task[None] | None = None  # resolving the neighbour's address

    def start(self) -> None:
        spec = self.core.spec
        run = os.path.join(self.root, f"elastrun-{os.geteuid()}", spec.run_id)
        try:
            private_dir(run, below=self.root)
            self._remove_dead(run)
            self.base = private_dir(os.path.join(run, str(os.getpid())), below=self.root)
        except (UnsafePath, OSError) as e:
            # Said by each worker that uses memory checkpoints (it gets no folder).
            self.core.events.emit(
                MemoryCheckpointPersistFailed(
                    local_rank=-1, step=-1, reason=f"no shared memory folder: {e}"
                )
            )
            return
        self.core.guard.remove_when_gone(self.base)  # a killed agent's copies go too
        self._task = asyncio.get_running_loop().create_task(self._watch())

    @staticmethod
    def _remove_dead(run: str) -> None:
        """Folders of this run's agents on this host that were killed."""
        with contextlib.suppress(OSError):
            for name in os.listdir(run):
                if name.isdigit() and int(name) != os.getpid() and not pid_alive(int(name)):
                    shutil.rmtree(os.path.join(run, name), ignore_errors=True)

    def folder(self, local_rank: int) -> str | None:
        if self.base is None:
            return None
        if local_rank not in self.folders:
            path = os.path.join(self.base, f"local-{local_rank}")
            self.folders[local_rank] = private_dir(path, below=self.base)
        return self.folders[local_rank]

    def round(self, group: WorkerGroup) -> RoundHooks | None:
        return _MemoryRound(self, group.result) if self.base is not None else None

    # ------------------------------------------------------------ replicas
    async def round_starts(self, result: RoundResult) -> None:
        """Take this round's neighbour's replicas (the port in our note)."""
        self.result, self._neighbour, self._awaited = result, None, -1
        if self._expecting is not None:
            self._expecting.cancel()
        if self.hold is not None:
            self.hold.expect(())  # until this round's neighbour is known
        if self.base is None or result.group_world_size < 2:
            return
        # The neighbours' places: every member (read where the result names only this node).
        result = await whole(self.core.rendezvous, result)
        if not result.complete:
            return  # the store did not answer: no replicas this round
        self.result = result
        me = result.me
        if self.hold is None and me.addr and not self._replicas_off:
            try:
                folder = private_dir(os.path.join(self.base, "replica"), below=self.base)
                hold = ReplicaHold(
                    folder,
                    run=self.core.spec.run_id,
                    key=replica_key(self.settings.replica_secret, self.core.spec.run_id),
                    max_bytes=self.settings.replica_max_bytes,
                    max_header=self.settings.replica_max_header,
                )
                self.port = await hold.serve(me.addr)
            except OSError as e:  # UnsafePath
                self.core.say(f"elastrun: warning: memory checkpoint replicas off: {e}")
                self._replicas_off = True  # said once; not tried again
                return
            hold.on_received = self._received
            hold.on_refused = self._refused
            self.hold = hold
        if self.hold is not None:  # in the background: a name may take a while to resolve
            prev = result.members[(result.group_rank - 1) % result.group_world_size]
            self._expecting = asyncio.get_running_loop().create_task(_expect(self.hold, prev.addr))
        if self.port is not None:
            note = ReplicaNote(result.round, result.group_rank, me.node_id, self.port)
            await self.core.rendezvous.write_note(note)

    def _received(self, got: Received) -> None:
        self.core.events.emit(
            MemoryReplicaReceived(
                rank=got.rank,
                step=got.step,
                node=got.node,
                bytes=got.size,
                authenticated=self.hold is not None and bool(self.hold.key),
            )
        )

    def _refused(self, peer: str, why: str) -> None:
        self.core.events.emit(MemoryReplicaRefused(peer=peer, reason=why))

    async def neighbour(self) -> Neighbour | None:
        """The next node's replica port in this round (its note, checked)."""
        result = self.result
        if self._neighbour is not None or result is None or result.group_world_size < 2:
            return self._neighbour
        if not result.complete:
            return None
        nxt = result.members[(result.group_rank + 1) % result.group_world_size]
        seat = seats((m.node_id, m.group_rank, m.nproc) for m in result.members)[nxt.group_rank]
        note = await self.core.rendezvous.read_note(ReplicaNote, result.round, seat)
        if note is None:
            return None  # none yet, or not this round's yet
        self._neighbour = Neighbour(nxt.addr, note.port, nxt.node_id)
        return self._neighbour

    # ------------------------------------------------------------ persisting
    async def _watch(self) -> None:
        closing = self._closing
        while True:
            last = closing.is_set()  # one more look once the agent ends
            for lr, folder in list(self.folders.items()):
                marked = self._new_marked(lr, folder)
                if marked is not None:
                    to = await self.neighbour()
                    await asyncio.to_thread(self._persist, lr, folder, marked, to)
            if last:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), self.poll)

    def _new_marked(self, lr: int, folder: str) -> Marked | None:
        """The newest snapshot marked for the disk that is not written yet."""
        try:
            note = CommitNote.read(folder)
        except SnapshotError as e:
            if self._seen.get(lr) != -2:  # said once, until a good note comes
                self._failed(lr, -1, f"commit note: {e}")
            self._seen[lr] = -2
            return None
        if note is not None and note.saves is not None:
            self._count(lr, note.saves)
        m = None if note is None else note.marked
        if m is None or m.generation <= self._seen.get(lr, -1):
            return None
        self._seen[lr] = m.generation
        return m

    def _count(self, lr: int, totals: SaveTotals) -> None:
        """The saves of the worker of ``lr`` made since the last look go to
        the metrics."""
        new = saves_since(self._totals.get(lr), totals)
        self._totals[lr] = totals
        if new.saves and self.core.metrics is not None:
            self.core.metrics.saved(new.saves, new.blocked_s, new.nbytes)

    def _persist(self, lr: int, folder: str, marked: Marked, to: Neighbour | None) -> None:
        try:
            self._write(lr, folder, marked, to)
            if to is not None:
                self._await_replicas(marked.step)
        finally:
            with contextlib.suppress(OSError):  # the worker may write into that slot again
                write_persisted(folder, marked.generation)

    def _write(self, lr: int, folder: str, marked: Marked, to: Neighbour | None) -> None:
        clock = self.core.clock
        t0 = clock.monotonic()
        try:
            view = open_slot(os.path.join(folder, f"slot-{marked.slot}"))
        except (SnapshotError, OSError) as e:
            self._failed(lr, marked.step, str(e))
            return
        if view is None or view.header.generation != marked.generation:
            if view is not None:
                view.close()
            return  # a newer save marked since took its place (a newer note comes)
        try:
            if to is not None:
                self._send(lr, view, to)
            if view.header.persist is None:
                return
            done = persist_snapshot(view)
        except (SnapshotError, OSError) as e:
            self._failed(lr, marked.step, str(e))
            return
        finally:
            view.close()
        self.core.events.emit(
            MemoryCheckpointPersisted(
                local_rank=lr,
                rank=view.header.rank,
                step=done.step,
                path=done.path,
                bytes=done.size,
                seconds=round(clock.monotonic() - t0, 3),
            )
        )

    def _await_replicas(self, step: int) -> None:
        """Wait (at most REPLICA_WAIT s) until this node holds the previous
        node's replicas of ``step`` or later: until then the worker keeps its
        previous mark (with 4 slots), the step the replicas held before are
        of, so that a node lost meanwhile leaves a step every rank can have."""
        hold, result = self.hold, self.result
        if hold is None or result is None or not result.complete or result.group_world_size < 2:
            return
        if step <= self._awaited:
            return  # once per step (local ranks mark the same steps)
        self._awaited = step
        prev = result.members[(result.group_rank - 1) % result.group_world_size]
        first = sum(m.nproc for m in result.members if m.group_rank < prev.group_rank)
        ranks = range(first, first + prev.nproc)
        deadline = self.core.clock.monotonic() + REPLICA_WAIT
        while not self._closing.is_set() and self.core.clock.monotonic() < deadline:
            held = dict(hold.senders)
            if all(held.get(r, ("", -1))[1] >= step for r in ranks):
                return
            time.sleep(0.02)

    def _send(self, lr: int, view: SlotView, to: Neighbour) -> None:
        clock, result = self.core.clock, self.result
        t0 = clock.monotonic()
        me = None if result is None else result.me
        h = view.header
        try:
            send_snapshot(
                (to.host, to.port),
                view,
                run=self.core.spec.run_id,
                node="" if me is None else me.node_id,
                key=replica_key(self.settings.replica_secret, self.core.spec.run_id),
                source="" if me is None else me.addr,  # the receiver keeps a slot for it
                max_header=self.settings.replica_max_header,
            )
        except ReplicaError as e:
            self.core.events.emit(
                MemoryReplicaSendFailed(local_rank=lr, rank=h.rank, step=h.step, reason=str(e))
            )
            return
        self.core.events.emit(
            MemoryReplicaSent(
                local_rank=lr,
                rank=h.rank,
                step=h.step,
                to=to.node_id,
                bytes=view.size,
                seconds=round(clock.monotonic() - t0, 3),
            )
        )

    def _failed(self, lr: int, step: int, why: str) -> None:
        self.core.events.emit(MemoryCheckpointPersistFailed(local_rank=lr, step=step, reason=why))
        if not self._warned:
            self._warned = True
            self.core.say(
                f"elastrun: warning: a memory checkpoint (local rank {lr}, step {step}) could "
                f"not be written to disk: {why} (further failures: the event log only)"
            )

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # The disk write in progress, and the newest snapshot marked for
            # the disk since, are written first (bounded).
            self._closing.set()
            try:
                await asyncio.wait_for(task, CLOSE_WAIT)
            except TimeoutError:
                self._failed(-1, -1, f"the agent ended before its disk writes ({CLOSE_WAIT:.0f}s)")
        if self._expecting is not None:
            self._expecting.cancel()
        if self.hold is not None:
            await self.hold.close()
            self.hold = None
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            with contextlib.suppress(OSError):  # the run's folder, once no agent uses it
                os.rmdir(os.path.dirname(self.base))
            self.base = None


async def _expect(hold: ReplicaHold, host: str) -> None:
    """The slot ``hold`` keeps for the neighbour, for the addresses ``host``
    (the previous member's address: an IP or a name) stands for; for none
    when it does not resolve within ADDRESS_WAIT s."""
    if not host:
        return
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
            ADDRESS_WAIT,
        )
    except (OSError, TimeoutError):
        return
    hold.expect(str(info[4][0]) for info in infos)


class _MemoryRound(RoundHooks):
    def __init__(self, feature: MemoryCheckpoints, result: RoundResult) -> None:
        self.feature = feature
        self.result = result

    async def before_start(self) -> None:
        await self.feature.round_starts(self.result)

    def worker_env(self, worker: Worker) -> dict[str, str]:
        try:
            folder = self.feature.folder(worker.local_rank)
        except (UnsafePath, OSError) as e:
            self.feature.core.say(f"elastrun: warning: memory checkpoints: {e}")
            return {}
        if folder is None:
            return {}
        hold = self.feature.hold
        return {ENV: folder, **({REPLICA_ENV: hold.folder} if hold is not None else {})}
