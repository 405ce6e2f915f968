"""Registration: a node's first registration under its job id, the settings
it agrees on, and registering again after its lease was lost.

A node's first registration
---------------------------
What a node finds under its job id is classified by the reuse table below,
from one snapshot of the job's ``config``, ``round`` and the count of its live
nodes. Every write is a txn on what was read: an empty job id is created at
once (settings, round 0 and this node's presence in the first txn, whose
failure branch reads the records for everyone else); a live job is joined
with a second; the remains of a failed or abandoned job are cleared first.
A race lost reads again, in the same request (bounded).

Reusing a job id
----------------
What a node that starts finds under its job id: a new job, a live job to
join, a finished job, or the remains of a job that is over (pure; no I/O).

A job id can outlive its job: the embedded store may be served by
``elastrun store serve`` or by another job's agent, and etcd keeps
everything. A node starting under an id that was used before must not
silently take over the dead job's restart count (its workers would start with
``TORCHELASTIC_RESTART_COUNT=1`` and its first crash would fail it) or be
refused against the dead job's settings. So the first registration of an
agent classifies what it finds, in one consistent read of the job's
``config``, ``round`` and ``nodes/`` (presence keys, on leases: a live node
holds one), by this table (first matching row):

=============== ============== ========== ========== =================================
``config``      ``round``      live nodes verdict    why
=============== ============== ========== ========== =================================
absent          absent         any        NEW        nothing here: create the job
any             ``finished``   any        FINISHED   the job succeeded: nothing to do
any             ``failed``     any        RESET      the job failed (its budget spent)
any             any other      >= 1       JOIN       a live job: join it (its settings
                                                     must agree with this node's; a
                                                     missing settings record is written)
present         any other      0          RESET      every node of the job is gone: it
                                                     was abandoned (killed, stopped)
absent          present        0          RESET      round records without settings:
                                                     left over
=============== ============== ========== ========== =================================

RESET deletes the job's keys and starts it afresh as NEW: round 0, no
restarts used, this node's settings. A FINISHED job stays finished: a node
started again under its id (a Kubernetes pod restarted after completion)
exits 0 with nothing to do; to run the job again, use a new id. Only a
node's first registration classifies; a member that lost its lease and
registers again rejoins its job whatever it finds.

A node whose lease has not expired yet counts as live: a job whose nodes were
SIGKILLed is "abandoned" only once their leases are gone (about 2 s on the
embedded store, whose server cuts a dead connection's leases to a short grace;
``lease_ttl`` on etcd). A node that starts before then joins the dying job.

Registering again
-----------------
A node that lost its lease registers again, for as long as its rejoin window.

A node loses its lease when the store said it is gone (expired, revoked) or
when the store could not be reached for longer than the lease TTL (a cut
link, a store host under load). By then the other nodes have seen it gone
and re-formed without it; its own workers are stopped (the agent stops them
on the ``lease_lost`` change before it asks for the next round). To rejoin,
it needs a new lease and its presence key again: :func:`regain` tries that
until it succeeds, retrying while the store is unreachable, for at most the
*rejoin window* (the rendezvous's ``join_timeout``). Past the window it
raises :class:`~elastrun.errors.StoreUnavailable` naming the store, the
window and the last error: the agent exits 1 with that line.

What is not retried: an error that is no matter of reachability (a refused
token, a protocol error, a config mismatch), and the loss of the embedded
store's host with candidate hosts (``HostLost``, ``NotHost``): the failover
rendezvous handles those by finding the next host.

After a takeover of the store's host, a node registers in the new host's
store with the round it carries instead (:meth:`Registration.after_takeover`).
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Awaitable, Callable

from elastrun.clock import Clock, remaining, wait_until
from elastrun.errors import (
    ConfigMismatch,
    HostLost,
    LeaseNotFound,
    NotHost,
    RendezvousClosed,
    RendezvousError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from elastrun.event_kinds import ConfigMismatched, JobReset, LeaseRegained, RoundOpened
from elastrun.frozen import frozen
from elastrun.rendezvous import notes as N
from elastrun.rendezvous import rounds
from elastrun.rendezvous.damage import decode_config
from elastrun.rendezvous.node_io import Node, Observer
from elastrun.rendezvous.plan import decode_round
from elastrun.rendezvous.records import (
    AgreedSettings,
    ConfigRecord,
    PresenceRecord,
    RoundRecord,
    RoundState,
)
from elastrun.store.base import Compare, Count, Delete, Get, Op, Put
from elastrun.store.keepalive import LeaseKeeper, describe_store
from elastrun.untrusted import printable

__all__ = [
    "REGISTER_TRIES",
    "RETRY_EVERY",
    "TABLE",
    "Found",
    "Registration",
    "Verdict",
    "classify",
    "describe_reset",
    "regain",
]


# -- the reuse table ------------------------------------------------------------
class Verdict(enum.Enum):
    NEW = "new"
    JOIN = "join"
    FINISHED = "finished"
    RESET = "reset"


@frozen
class Found:
    """The verdict, and for RESET why (``failed``, ``abandoned``, ``leftover``)."""

    verdict: Verdict
    why: str = ""


# The table above, row by row: (config present, round states, live nodes
# present) -> (verdict, why); None matches anything. First match wins.
Row = tuple[bool | None, frozenset[RoundState | None] | None, bool | None, Verdict, str]
TABLE: tuple[Row, ...] = (
    (False, frozenset({None}), None, Verdict.NEW, ""),
    (None, frozenset({RoundState.FINISHED}), None, Verdict.FINISHED, ""),
    (None, frozenset({RoundState.FAILED}), None, Verdict.RESET, "failed"),
    (None, None, True, Verdict.JOIN, ""),
    (True, None, False, Verdict.RESET, "abandoned"),
    (False, None, False, Verdict.RESET, "leftover"),
)


def classify(config: ConfigRecord | None, round_rec: RoundRecord | None, live_nodes: int) -> Found:
    """The table above. ``config``/``round_rec``: the records read (None:
    absent); ``live_nodes``: how many presence keys the job has."""
    state = None if round_rec is None else round_rec.state
    for has_config, states, live, verdict, why in TABLE:
        if has_config is not None and has_config != (config is not None):
            continue
        if states is not None and state not in states:
            continue
        if live is not None and live != (live_nodes > 0):
            continue
        return Found(verdict, why)
    raise AssertionError("the reuse table covers every case")


def describe_reset(
    run_id: str, why: str, config: ConfigRecord | None, round_rec: RoundRecord | None
) -> str:
    """The console line of a RESET, saying what is left behind and what happens."""
    restarts = round_rec.restarts if round_rec is not None else 0
    budget = config.settings.max_restarts if config is not None else None
    used = f"{restarts} of {budget} restarts used" if budget is not None else f"{restarts} restarts"
    if why == "failed":
        what = f"the previous job with this id failed ({used}"
        failure = round_rec.last_failure if round_rec is not None else None
        if failure is not None:
            what += f"; last failure: {failure.describe()}"
        what += ")"
    elif why == "abandoned":
        what = (
            f"the previous job with this id stopped with no node left (round "
            f"{round_rec.round if round_rec is not None else 0}, {used})"
        )
    else:
        what = "records of an earlier job with this id are left in the store"
    return (
        f"elastrun: job {run_id!r}: {what}; starting a new job with this id "
        "(restart count 0, this node's settings)"
    )


# -- registering again ----------------------------------------------------------
RETRY_EVERY = 0.5  # s between two tries while the store is unreachable


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, HostLost | NotHost):
        return False
    return isinstance(exc, StoreUnavailable | LeaseNotFound | TimeoutError | OSError)


async def regain(
    attempt: Callable[[], Awaitable[None]],
    *,
    window: float,
    clock: Clock,
    lost: str,
    store: str = "the store",
    limit: str | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> float:
    """Run ``attempt`` (get a lease, put the presence key) until it succeeds;
    an unreachable store is retried every :data:`RETRY_EVERY` seconds until
    ``window`` seconds have passed (a try still waiting then is cancelled).
    ``on_retry(error)`` is called after each failed try. Returns the seconds
    it took; raises StoreUnavailable past the window (``lost``: why the lease
    was lost, ``store``: what the store is, ``limit``: what bounds the window,
    by default ``join_timeout``, for the message)."""
    bound = f"join_timeout={window:g}" if limit is None else limit
    start = clock.monotonic()
    deadline = start + window
    while True:
        try:
            await wait_until(attempt(), deadline, clock)
            return clock.monotonic() - start
        except Exception as exc:
            if not _retryable(exc):
                raise
            if remaining(deadline, clock) <= 0:
                why = str(exc) or (
                    "no answer" if isinstance(exc, TimeoutError) else type(exc).__name__
                )
                raise StoreUnavailable(
                    f"{store} stayed unreachable for {window:g} s ({bound}) "
                    f"after this node's lease was lost ({lost}); giving up: {why}"
                ) from None
            if on_retry is not None:
                on_retry(exc)
        await clock.sleep_until(min(clock.monotonic() + RETRY_EVERY, deadline))


# -- registration --------------------------------------------------------------
REGISTER_TRIES = 8  # reads of the job's records while registering (races with other nodes)


class Registration:
    """One node's registration, on the lease ``keeper`` holds; ``notice``
    (set once hooks are attached) prints a line for the operator. What a
    registration's txn read of ``round`` goes to the observer
    (``round_seen``: the first phase starts from it)."""

    def __init__(self, node: Node, observer: Observer, keeper: LeaseKeeper) -> None:
        self.node = node
        self.observer = observer
        self.keeper = keeper
        self.notice: Callable[[str], None] | None = None

    def presence(self) -> Put:
        """This node's presence key, on its lease."""
        record = PresenceRecord(self.node.info(), since=time.time())
        key = self.node.keys.node(self.node.node_id)
        return Put(key, record.encode(), self.keeper.lease)

    async def first_lease(self) -> None:
        """This node's first lease. A store that answers no grant within
        ``lease_ttl`` (its host loaded, an etcd without quorum for a moment:
        StoreTimeout) is asked again every :data:`RETRY_EVERY` seconds, for at
        most ``join_timeout``: a node joining a job does not give up on one
        slow answer. Any other error is raised at once (a wrong endpoint fails
        fast)."""
        node = self.node
        window = node.settings.join_timeout
        deadline = node.clock.monotonic() + window
        while True:
            try:
                await self.keeper.start()
                return
            except StoreTimeout as exc:
                if remaining(deadline, node.clock) <= 0:
                    raise StoreTimeout(f"{exc}; asked again for join_timeout={window:g}s") from None
            await node.clock.sleep_until(min(node.clock.monotonic() + RETRY_EVERY, deadline))

    async def first(self) -> None:
        """Classify what is under the job id (the reuse table) and act: create
        the job, join it, start it afresh, or report it finished. Every write
        is a txn on what was read; a lost race reads again (bounded)."""
        node = self.node
        k, store, mine = node.keys, node.store, node.settings.agreed()
        # The records, and how many nodes are live (their presence keys
        # counted: O(1) bytes, not every record), in one snapshot; a node
        # that registers after it, as after any read, is the reset's race.
        reads: list[Op] = [Get(k.config), Get(k.round), Count(k.nodes)]
        # An empty job id (NEW whatever the count) is created at once, with
        # round 0; any other finds the records in the failure branch.
        res = await store.txn(
            [Compare.unchanged(k.config, 0), Compare.unchanged(k.round, 0)],
            [
                Put(k.config, ConfigRecord(mine).encode()),
                Put(k.round, rounds.first_round(time.time()).encode()),
                self.presence(),
                Get(k.round),
            ],
            reads,
        )
        if res.succeeded:
            node.events.emit(RoundOpened(round=0, reason="job_started", node=node.node_id))
            self.observer.round_seen = (res.gets[0][0], res.revision)
            return
        for _ in range(REGISTER_TRIES):
            config_kv = res.gets[0][0] if res.gets[0] else None
            round_kv = res.gets[1][0] if res.gets[1] else None
            config = decode_config(k.config, config_kv.value) if config_kv else None
            rnd = decode_round(k.round, round_kv.value) if round_kv else None
            found = classify(config, rnd, res.counts[0] if res.counts else 0)
            config_rev = config_kv.mod_revision if config_kv else 0
            round_rev = round_kv.mod_revision if round_kv else 0
            if found.verdict is Verdict.FINISHED:
                raise RendezvousClosed(
                    f"job {node.settings.run_id!r} finished earlier; to run it again, use a "
                    "new --rdzv-id"
                )
            if found.verdict is Verdict.RESET:
                same = [
                    Compare.unchanged(k.config, config_rev),
                    Compare.unchanged(k.round, round_rev),
                ]
                done = await store.txn(same, [Delete(k.root, prefix=True)], reads)
                if done.succeeded:
                    self._announce_reset(found.why, config, rnd)
                    res = await store.txn([], reads)
                else:  # lost a race: the records as they are now
                    res = done
                continue
            if config is not None:
                await self._agree_or_refuse(config.settings, mine)
                ops = [self.presence()]
            else:
                ops = [Put(k.config, ConfigRecord(mine).encode()), self.presence()]
            compares = [Compare.unchanged(k.config, config_rev)]
            if found.verdict is Verdict.NEW:
                compares.append(Compare.unchanged(k.round, round_rev))
            # With round read in the same txn: the first phase starts from it.
            res = await store.txn(compares, [*ops, Get(k.round)], reads)
            if res.succeeded:
                if res.gets and res.gets[0]:
                    self.observer.round_seen = (res.gets[0][0], res.revision)
                return
            # Lost a race (another node wrote first): its failure branch read
            # the records again, in the same request.
        raise RendezvousError(
            f"job {node.settings.run_id!r}: its records changed {REGISTER_TRIES} times while "
            "this node registered (nodes starting and leaving at once?); try again"
        )

    async def after_takeover(self, carry: rounds.Carry) -> None:
        """Register in a new host's store after a takeover (docs/failover.md).

        The new host's store starts empty. Each survivor writes, in one txn on
        what it read: the job's settings (created if absent, else agreed), its
        presence, and the round after its own last one (``carry``;
        :func:`.rounds.takeover_round`: never before what the store holds, with
        the most restarts of the two), unless the store already holds a later
        round: every survivor carries its own, the first one writes it, the
        others join it."""
        node = self.node
        k, store, mine = node.keys, node.store, node.settings.agreed()
        detail = f"the store's host was lost; re-forming after round {carry.round}"
        for _ in range(REGISTER_TRIES):
            res = await store.txn([], [Get(k.config), Get(k.round)])
            config_kv = res.gets[0][0] if res.gets[0] else None
            round_kv = res.gets[1][0] if res.gets[1] else None
            found = decode_round(k.round, round_kv.value) if round_kv else None
            ops: list[Put] = [self.presence()]
            if config_kv is not None:
                self.agree(decode_config(k.config, config_kv.value).settings, mine)
            else:
                ops.append(Put(k.config, ConfigRecord(mine).encode()))
            if found is None or found.round <= carry.round:
                opened = rounds.takeover_round(carry, found, detail, time.time())
                ops.append(Put(k.round, opened.encode()))
            compares = [
                Compare.unchanged(k.config, config_kv.mod_revision if config_kv else 0),
                Compare.unchanged(k.round, round_kv.mod_revision if round_kv else 0),
            ]
            if (await store.txn(compares, ops)).succeeded:
                return
        raise RendezvousError(
            f"job {node.settings.run_id!r}: the new store host's records changed "
            f"{REGISTER_TRIES} times while this node registered; try again"
        )

    def _announce_reset(
        self, why: str, config: ConfigRecord | None, rnd: RoundRecord | None
    ) -> None:
        line = describe_reset(self.node.settings.run_id, why, config, rnd)
        last = rnd.last_failure if rnd is not None else None
        self.node.events.emit(
            JobReset(
                node=self.node.node_id,
                reason=why,
                previous_round=rnd.round if rnd is not None else None,
                previous_state=rnd.state.value if rnd is not None else None,
                previous_restarts=rnd.restarts if rnd is not None else None,
                previous_settings=config.settings.to_json() if config is not None else None,
                last_failure=last,
            )
        )
        if self.notice is not None:
            self.notice(printable(line))  # it quotes the records

    def agree(self, job: AgreedSettings, mine: AgreedSettings) -> None:
        mismatch = rounds.config_diff(self.node.settings.run_id, job, mine)
        if mismatch is not None:
            message, diffs = mismatch
            fields = [f"{k}: job has {a!r}, this node has {b!r}" for k, (a, b) in diffs.items()]
            self.node.events.emit(
                ConfigMismatched(node=self.node.node_id, message=message, fields=fields)
            )
            raise ConfigMismatch(message, diffs)

    async def check_config(self) -> None:
        store, mine, key = self.node.store, self.node.settings.agreed(), self.node.keys.config
        record = ConfigRecord(mine).encode()
        if await store.create(key, record):
            return
        kv = await store.get(key)
        if kv is None:  # deleted in between: try again once
            await store.create(key, record)
            return
        await self._agree_or_refuse(decode_config(key, kv.value).settings, mine)

    async def _agree_or_refuse(self, job: AgreedSettings, mine: AgreedSettings) -> None:
        """:meth:`agree`; when refused, first tell the job's waiting nodes why
        this node will not join (the ``refused`` note, agent/refusals.py; best
        effort, bounded by the store's request timeout)."""
        try:
            self.agree(job, mine)
        except ConfigMismatch as exc:
            node = self.node
            note = N.RefusalNote(node.node_id, node.info().host, str(exc)[: N.MAX_MESSAGE])
            with contextlib.suppress(StoreError, TimeoutError):
                await node.store.put(node.keys.note(note.name), N.encode(note.to_json()))
            raise

    async def regain_lease(
        self,
        window: float | None = None,
        limit: str | None = None,
        check: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """A new lease and the presence key again after the lease was lost
        (``check`` first, each try): retried while the store is unreachable,
        at most ``join_timeout`` (or ``window``, named ``limit``, if shorter:
        :func:`regain`)."""
        node, keeper = self.node, self.keeper
        lost = keeper.lost_reason or "lease lost"
        full = node.settings.join_timeout
        if window is None or window >= full:
            window, limit = full, None
        said = f"join_timeout={window:g}s" if limit is None else f"{window:.0f}s: {limit}"
        tries = [1]

        async def attempt() -> None:
            if check is not None:
                await check()
            await keeper.start()
            put = self.presence()
            await node.store.put(put.key, put.value, put.lease)

        def on_retry(exc: BaseException) -> None:
            tries[0] += 1

        if self.notice is not None:
            self.notice(
                f"elastrun: this node lost its lease ({printable(lost)}); registering again "
                f"(for up to {said} while the store is unreachable)"
            )
        took = await regain(
            attempt, window=window, clock=node.clock, lost=lost, on_retry=on_retry,
            store=describe_store(node.store), limit=limit,
        )  # fmt: skip
        node.events.emit(LeaseRegained(node=node.node_id, lost=lost, tries=tries[0], after_s=took))
        if self.notice is not None:
            self.notice(f"elastrun: registered again after {took:.1f}s: rejoining the job")
