"""A candidate host's word for its own agent, in a store failover without a
token (docs/failover.md, *Who may vote*).

Without a token, anyone who reaches a candidate could send a vote or a hello
in another candidate's name: a stranger could elect a second host, or keep a
cut-off host from stepping down. So a candidate's vote and its store
connection's hello each carry a fresh random **nonce**, which its agent
registers first with its own candidate store (the same process:
:class:`Claims`). The receiver counts the vote, or hears from the
connection, only once the named candidate's store, asked at that candidate's
own entry of the list (:func:`ask`: a ``vouch`` frame), answers the same
claim for that nonce. A stranger cannot answer at a live candidate's address
(its store listens there), nor learn a nonce (it travels only on the agent's
own connection to the receiver). With a token, the token authenticates every
frame and nothing is asked.

Bounded: a store keeps the last :data:`MAX_CLAIMS` claims of its agent; a
receiver asks at most :data:`MAX_ASKING` at once (a vote beyond that is not
counted: the voter votes again later; a hello's connection is asked about
again a heartbeat later).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.errors import ConfigError
from elastrun.store.client_conn import exchange

__all__ = ["ASK_TIMEOUT", "MAX_ASKING", "MAX_CLAIMS", "Checks", "Claims", "ask"]

MAX_CLAIMS = 256  # claims a candidate's store keeps for its agent (oldest dropped)
# Vouch checks a store runs at once. Each comes from one admitted connection
# (a vote frame, or a hello naming a candidate: once per connection), so the
# server's admission bounds them too; beyond this a vote is not counted (its
# voter votes again in its next term) and a hello is asked about later.
MAX_ASKING = 64
ASK_TIMEOUT = 2.0  # one vouch request (a loaded machine answers slowly)


class Claims:
    """What this candidate's agent said in its name lately: nonce -> claim."""

    def __init__(self, limit: int = MAX_CLAIMS) -> None:
        self._claims: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._limit = limit

    def add(self, claim: dict[str, Any]) -> str:
        """Register ``claim`` (a vote ``{"t": "vote", "term", "target"}`` or a
        hello ``{"t": "hello", "target"}``); its nonce, to send with it."""
        nonce = secrets.token_hex(16)
        self._claims[nonce] = dict(claim)
        while len(self._claims) > self._limit:
            self._claims.popitem(last=False)
        return nonce

    def get(self, nonce: object) -> dict[str, Any] | None:
        return self._claims.get(nonce) if isinstance(nonce, str) else None


async def ask(
    host: str, port: int, token: str | None, nonce: str, timeout: float = ASK_TIMEOUT
) -> dict[str, Any] | None:
    """The claim the store at ``host:port`` vouches for under ``nonce``
    (None: none, or no answer in time)."""
    frame = {"v": 1, "t": "vouch", "token": token, "nonce": nonce}
    reply = await exchange(host, port, frame, timeout)
    claim = reply.get("claim") if reply is not None and reply.get("t") == "vouch" else None
    return claim if isinstance(claim, dict) else None


class Checks:
    """A candidate store's checks of others' claims: whether candidate ``i``
    (``candidates[i]``, its entry) vouches for a claim, at most
    :data:`MAX_ASKING` at once."""

    def __init__(self, candidates: Sequence[str], token: str | None) -> None:
        self.candidates = tuple(candidates)
        self.token = token
        self._running: set[asyncio.Task[None]] = set()

    def vote(
        self, voter: int, nonce: object, claim: dict[str, Any], done: Callable[[bool], None]
    ) -> None:
        """Check a vote; ``done(vouched)`` (False at once when busy)."""

        async def check() -> None:
            done(await self.vouched(voter, nonce, claim))

        if not self._run(check()):
            done(False)

    def hello(
        self,
        candidate: int,
        nonce: object,
        claim: dict[str, Any],
        *,
        every: float,
        lost: Callable[[], bool],
        heard: Callable[[], None],
    ) -> None:
        """Check a connection's hello, up to five times ``every`` seconds
        apart while the connection is not ``lost``; ``heard()`` once vouched.
        When busy, asked again ``every`` seconds later."""

        async def check() -> None:
            for _ in range(5):
                if lost():
                    return
                if await self.vouched(candidate, nonce, claim):
                    if not lost():
                        heard()
                    return
                await asyncio.sleep(every)

        if not self._run(check()):
            asyncio.get_running_loop().call_later(
                every,
                lambda: (
                    None
                    if lost()
                    else self.hello(candidate, nonce, claim, every=every, lost=lost, heard=heard)
                ),
            )

    async def vouched(self, candidate: int, nonce: object, claim: dict[str, Any]) -> bool:
        """Whether candidate ``candidate``'s store, asked at its own entry,
        vouches for ``claim`` under ``nonce``."""
        if not isinstance(nonce, str) or not 0 < len(nonce) <= 64:
            return False
        if not 0 <= candidate < len(self.candidates):
            return False
        try:
            where = Endpoint.parse(self.candidates[candidate], 0, "candidate")
        except ConfigError:
            return False
        return await ask(where.host, where.port, self.token, nonce) == claim

    def cancel(self) -> None:
        for task in list(self._running):
            task.cancel()

    def _run(self, work: Coroutine[Any, Any, None]) -> bool:
        if len(self._running) >= MAX_ASKING:
            work.close()
            return False
        task = asyncio.get_running_loop().create_task(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return True
