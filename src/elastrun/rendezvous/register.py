"""A node's first registration under its job id, and the settings it agrees on.

What a node finds under its job id is classified by :mod:`.reuse`'s table,
from one snapshot of the job's ``config``, ``round`` and the count of its live
nodes. Every write is a txn on what was read: an empty job id is created at
once (settings, round 0 and this node's presence in the first txn, whose
failure branch reads the records for everyone else); a live job is joined
with a second; the remains of a failed or abandoned job are cleared first.
A race lost reads again, in the same request (bounded).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastrun.errors import ConfigMismatch, RendezvousClosed, RendezvousError
from elastrun.rendezvous import rounds
from elastrun.rendezvous.damage import decode_config
from elastrun.rendezvous.plan import decode_round
from elastrun.rendezvous.records import AgreedSettings, ConfigRecord, RoundRecord
from elastrun.rendezvous.reuse import Verdict, classify, describe_reset
from elastrun.rendezvous.view import Node, Observer
from elastrun.store.base import Compare, Count, Delete, Get, Op, Put
from elastrun.untrusted import printable

__all__ = ["REGISTER_TRIES", "Registration"]

REGISTER_TRIES = 8  # reads of the job's records on a first registration (races)


class Registration:
    """One node's registration: ``presence`` makes its presence put (on its
    lease); ``notice`` (set once hooks are attached) prints a line for the
    operator."""

    def __init__(self, node: Node, observer: Observer, presence: Callable[[], Put]) -> None:
        self.node = node
        self.observer = observer
        self.presence = presence
        self.notice: Callable[[str], None] | None = None

    async def first(self) -> None:
        """Classify what is under the job id (:mod:`.reuse`) and act: create
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
            node.events.emit("round_opened", round=0, reason="job_started", node=node.node_id)
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
                self.agree(config.settings, mine)
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

    def _announce_reset(
        self, why: str, config: ConfigRecord | None, rnd: RoundRecord | None
    ) -> None:
        line = describe_reset(self.node.settings.run_id, why, config, rnd)
        last = rnd.last_failure if rnd is not None else None
        self.node.events.emit(
            "job_reset",
            node=self.node.node_id,
            reason=why,
            previous_round=rnd.round if rnd is not None else None,
            previous_state=rnd.state.value if rnd is not None else None,
            previous_restarts=rnd.restarts if rnd is not None else None,
            previous_settings=config.settings.to_json() if config is not None else None,
            last_failure=last.to_json() if last is not None else None,
        )
        if self.notice is not None:
            self.notice(printable(line))  # it quotes the records

    def agree(self, job: AgreedSettings, mine: AgreedSettings) -> None:
        mismatch = rounds.config_diff(self.node.settings.run_id, job, mine)
        if mismatch is not None:
            message, diffs = mismatch
            fields = [f"{k}: job has {a!r}, this node has {b!r}" for k, (a, b) in diffs.items()]
            self.node.events.emit(
                "config_mismatch", node=self.node.node_id, message=message, fields=fields
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
        self.agree(decode_config(key, kv.value).settings, mine)
