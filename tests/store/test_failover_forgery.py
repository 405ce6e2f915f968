"""A stranger against a failover store without a token (docs/failover.md,
*Who may vote*): real candidate stores on loopback, real
agents' clients, and a forging client that speaks the protocol.

The forger reaches every candidate and knows the public candidate list (so
its digest). It sends votes for term 2 in the names of candidates 0 and 1 to
candidate 2, then keeps sending hellos in their names, to that candidate and
to the real host. Neither may count: no second host, and a host cut off from
its real candidates still steps down. And voters whose ballots stand at
different terms (a relaunched job's records, a planted valid record) still
elect a host."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.store.ballot import Ballot
from elastrun.store.term import Role, list_digest
from tests.faults.forger import first_answer, keep_talking
from tests.store.test_failover_start import candidate, connect, endpoints, run, watches


def forged_vote(eps: tuple[Endpoint, ...], term: int, voter: int) -> dict[str, Any]:
    digest = list_digest(",".join(str(e) for e in eps))
    return {"t": "vote", "token": None, "term": term, "voter": voter, "list": digest,
            "nonce": secrets.token_hex(16)}  # fmt: skip


def forged_hello(candidate_index: int, term: int) -> dict[str, Any]:
    return {"t": "hello", "token": None, "term": term, "candidate": candidate_index,
            "nonce": secrets.token_hex(16)}  # fmt: skip


def test_forged_votes_without_a_token_never_make_a_second_host() -> None:
    eps = endpoints()

    async def body() -> None:
        async with candidate(eps, 0) as a, candidate(eps, 1) as b, candidate(eps, 2) as c:
            await asyncio.gather(connect(a), connect(b), connect(c))
            assert (a.term, b.term, c.term) == (1, 1, 1)
            assert a.server is not None and a.server.failover is not None
            assert c.server is not None and c.server.failover is not None
            # Votes in the names of candidates 0 and 1, for term 2, to candidate 2.
            for voter in (0, 1):
                answer = await first_answer(eps[2], forged_vote(eps, 2, voter))
                assert answer.get("won") is False, answer
            assert c.server.failover.role is Role.STANDBY and c.server.failover.term == 1
            # Hellos in their names keep a connection to it: still a standby.
            answer = await first_answer(eps[2], forged_hello(0, 2))
            assert answer.get("code") == "not_host" or "not_host" in str(answer), answer
            assert c.server.failover.role is Role.STANDBY

    run(body)


def test_forged_hellos_without_a_token_do_not_keep_a_cut_off_host_serving() -> None:
    eps = endpoints()

    async def body() -> None:
        async with candidate(eps, 0) as a, candidate(eps, 1) as b, candidate(eps, 2) as c:
            await asyncio.gather(connect(a), connect(b), connect(c))
            assert a.server is not None and a.server.failover is not None
            # The host loses its real candidates (their agents stop talking
            # to it), while the forger keeps connections open to it in their
            # names, sending bytes: it must still step down.
            for client in (b, c):
                for task in watches.pop(id(client), []):
                    task.cancel()
                assert client.store is not None
                client.store.abort()
            forgers = [asyncio.ensure_future(keep_talking(eps[0], 1, i)) for i in (1, 2)]
            await asyncio.sleep(0.5)
            assert not any(f.done() for f in forgers), [f.exception() for f in forgers if f.done()]
            for _ in range(600):  # bounded: the fence time (1.2 s) and a check, under load
                if a.server.failover.role is Role.FENCED:
                    break
                await asyncio.sleep(0.05)
            assert a.server.failover.role is Role.FENCED, "forged hellos kept the host serving"
            for task in forgers:
                task.cancel()

    run(body)


def test_without_a_token_the_real_candidates_still_elect_a_new_host() -> None:
    """The vouching costs no failover: the host's store stops (its address
    refuses: proof), the two others vote, each vote vouched for by the
    voter's own store, and one of them hosts term 2."""
    eps = endpoints()

    async def body() -> None:
        async with candidate(eps, 1) as b, candidate(eps, 2) as c:
            async with candidate(eps, 0) as a:
                await asyncio.gather(connect(a), connect(b), connect(c))
                assert (a.term, b.term, c.term) == (1, 1, 1)
            # a's store and agent are gone: its address refuses.
            for client in (b, c):
                for task in watches.pop(id(client), []):
                    task.cancel()
            lost_b, lost_c = await asyncio.gather(b.watch(), c.watch())
            await asyncio.gather(b.replace(lost_b), c.replace(lost_c))
            assert (b.term, b.host, c.term, c.host) == (2, 1, 2, 1)
            assert b.server is not None and b.server.failover is not None
            assert b.server.failover.role is Role.HOST

    run(body)


def test_voters_whose_ballots_stand_at_different_terms_meet_in_one_term() -> None:
    """A valid record with a high term (a job relaunched over its agents'
    records, or one planted) on one standby: it votes in the term after it,
    the other voter in the next term of the job. Each standby tells the
    voters the highest term it holds a vote in, and the next vote joins it:
    a new host is elected (without this, the two voters stepped up one term
    each per vote, never meeting)."""
    eps = endpoints()

    async def body() -> None:
        async with candidate(eps, 1) as b, candidate(eps, 2) as c:
            c.ballot = Ballot(None, 3, term=50, candidate=2)
            b.failover_timeout = c.failover_timeout = 20.0
            async with candidate(eps, 0) as a:
                await asyncio.gather(connect(a), connect(b), connect(c))
            for client in (b, c):
                for task in watches.pop(id(client), []):
                    task.cancel()
            lost_b, lost_c = await asyncio.gather(b.watch(), c.watch())
            await asyncio.gather(b.replace(lost_b), c.replace(lost_c))
            assert b.term == c.term > 50 and b.host == c.host == 1

    run(body)
