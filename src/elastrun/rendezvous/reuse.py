"""What a node that starts finds under its job id: a new job, a live job to
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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elastrun.rendezvous.records import ConfigRecord, RoundRecord, RoundState

__all__ = ["TABLE", "Found", "Verdict", "classify", "describe_reset"]


class Verdict(enum.Enum):
    NEW = "new"
    JOIN = "join"
    FINISHED = "finished"
    RESET = "reset"


@dataclass(frozen=True)
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
