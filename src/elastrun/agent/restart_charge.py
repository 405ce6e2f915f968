"""A restart as the rendezvous charged it: said once the next round formed.

A round that ends for a worker failure (on this node or another) opens the
next round, and the rendezvous charges the restart against ``--max-restarts``
only when that round *closes*, with every member of the round before back
(rendezvous/rounds.py ``close_records``): a failure collateral to a lost node
or a lost store host (a collective broken before the agent saw the loss) is
not charged, and a failure that several nodes report for the same round is
charged once. So an agent cannot know, when its round ends, whether the
restart counts nor which count it is; it keeps what it will say
(:class:`RoundEnd`) and says it when ``next_round()`` returns: the console
line (``restart 2/3`` only when charged) and the ``restart`` event, whose
``count`` is the next round's ``restart_count``, the
``TORCHELASTIC_RESTART_COUNT`` its workers get, the same on every node.

A round that ends for a membership change (a node joins or is lost, the
store's host is lost) is never charged: its line is said at once
(agent/failures.py ``change_line``), its event when the next round formed.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from elastrun.agent.failures import change_why, failed_why
from elastrun.event_kinds import Restart
from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.rendezvous.api import Change, RoundResult
from elastrun.untrusted import printable

__all__ = ["NOT_CHARGED", "RoundEnd"]

# Why a worker failure's restart was not charged (the rendezvous' rule).
NOT_CHARGED = "a node or the store's host was lost"


@frozen
class RoundEnd:
    """How this node's round ended, kept until the next round formed:
    ``counts`` (a worker failure, charged if that round's close charged it),
    ``why`` (the cause the console line names) and ``event``, the
    ``restart`` event as the round ended (its ``count`` and ``counted`` are
    the charge's, filled in by :meth:`restart`)."""

    why: str
    counts: bool
    event: Restart

    @property
    def round(self) -> int:
        return self.event.round

    @classmethod
    def failed(
        cls, result: RoundResult, job: FailureRecord, root: FailureRecord | None
    ) -> RoundEnd:
        """This node's workers failed in ``result``'s round: ``job`` the job's
        root cause, ``root`` the one the line names (None: the agent stopped
        every failed rank itself)."""
        event = Restart(result.round, result.restart_count, "worker_failed", False, failure=job)
        return cls(failed_why(root), True, event)

    @classmethod
    def changed(cls, result: RoundResult, change: Change) -> RoundEnd:
        """``result``'s round ended for ``change`` (another node's failure:
        counted if charged; a membership change: never)."""
        event = Restart(result.round, result.restart_count, change.reason, False, change.detail)
        return cls(change_why(change), change.counts_as_restart, event)

    def restart(self, result: RoundResult) -> Restart:
        """The ``restart`` event, ``result`` being the round that formed next:
        ``count`` the job's restarts used then, ``counted`` whether its close
        charged this one."""
        counted = self.counts and result.charges(self.round)
        return replace(self.event, count=result.restart_count, counted=counted)

    def line(self, result: RoundResult) -> str | None:
        """The console line once ``result`` formed (escaped), None for a
        membership change (its line was said as the round ended)."""
        if not self.counts:
            return None
        if result.charges(self.round):
            said = f"restart {result.restart_count}/{result.max_restarts}"
        else:
            said = f"not counted: {NOT_CHARGED}"
        return printable(f"elastrun: restarting workers ({said}): {self.why}")
