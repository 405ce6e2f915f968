"""What a node tells its operator about where it stands in the rendezvous:
why it waits, and why a call gave up (the error's message)."""

from __future__ import annotations

from elastrun.errors import RendezvousClosed, RendezvousTimeout, RestartBudgetExhausted
from elastrun.failure import describe_stored
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.protocol import Action
from elastrun.rendezvous.records import RoundState
from elastrun.rendezvous.view import Observer
from elastrun.untrusted import printable

__all__ = ["call_error", "nodes", "spare", "waiting_reason"]


def nodes(n: int) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} node" if n == 1 else f"{n} nodes"


def spare(s: RendezvousSettings, n: int) -> bool:
    """Whether a node waits as a spare beside a round of ``n`` members (0:
    unknown): the round is at a size it cannot enlarge by joining."""
    return n > 0 and not s.sizes().room(n, 1)


def waiting_reason(s: RendezvousSettings, r: int, n: int) -> str:
    """Why a node waits after round ``r`` (of ``n`` members; 0: unknown)
    closed without it."""
    max_nodes = s.max_nodes
    if not n:
        return f"round {r} closed without this node"
    if s.node_unit > 1 and spare(s, n):
        return (
            f"round {r} has {nodes(n)} ({s.sizes().describe()}); waiting as a spare "
            "to replace a lost node"
        )
    if n >= max_nodes:
        return f"round {r} is full ({n} of max {nodes(max_nodes)}); waiting for a free place"
    return f"round {r} closed without this node ({n} of max {nodes(max_nodes)}); joining the next"


async def call_error(a: Action, s: RendezvousSettings, obs: Observer) -> BaseException:
    """The error a call raises for the rules' RAISE action ``a``."""
    if a.error is RendezvousClosed:
        return RendezvousClosed(f"job {s.run_id!r} has finished: there will be no further rounds")
    if a.error is RestartBudgetExhausted:
        rec = obs.view.round
        # Another node's record: escaped, as the message reaches a terminal.
        last = printable(describe_stored(rec.last_failure if rec is not None else None))
        return RestartBudgetExhausted(
            f"job {s.run_id!r} used its restart budget ({s.max_restarts} "
            f"restart{'' if s.max_restarts == 1 else 's'}, "
            f"--max-restarts); last failure: {last}"
        )
    return await _timeout_error(a.round, s, obs)


async def _timeout_error(r: int, s: RendezvousSettings, obs: Observer) -> RendezvousTimeout:
    await obs.note_joiners(r)
    # Other nodes' host names: escaped, as the message reaches a terminal.
    joins = sorted(printable(h) for (jr, _), h in obs.joiner_hosts.items() if jr == r)
    rnd = obs.view.round
    if obs.rules.ctx.round == r and rnd is not None and rnd.state is not RoundState.OPEN:
        return RendezvousTimeout(
            f"round {r} closed without this node and no new round opened before "
            f"join_timeout={s.join_timeout:g}s (job is full: max {nodes(s.max_nodes)})"
        )
    least = s.sizes().smallest or s.min_nodes
    unit = f" ({s.sizes().describe()})" if s.node_unit > 1 else ""
    return RendezvousTimeout(
        f"{len(joins)} of min {nodes(least)}{unit} joined before "
        f"join_timeout={s.join_timeout:g}s: {', '.join(joins) or 'none'}"
    )
