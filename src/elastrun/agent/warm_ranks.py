"""Per-rank warm interpreters: warm starts for packages that read a rank
variable when they are imported.

Some frameworks read the worker's rank from the environment when they are
imported and keep it (Lightning reads ``LOCAL_RANK`` and ``RANK`` for its
rank-zero-only logging). The node's shared warm interpreter has no rank, so
it refuses such a package (worker/_zygote.py watches the variables while it
imports) and every worker imports it itself: seconds on every restart. For
these packages (``ModuleList.ranked``) the agent keeps, beside the shared
one, one warm interpreter per local rank, started with that rank's variables
of the round that ran last (``RANK_VARS``: the ranks and world sizes; never
the round's port, address or restart count), which imports them too.

A restart that gives a local rank the same variables forks its worker from
that rank's interpreter: what the package read is what a worker started cold
would read. A round that gives it other ones (the membership changed)
discards it: the worker is forked from the shared interpreter and imports the
package itself, and a new per-rank one is started with the new variables for
the next restart. One not ready yet is not waited for (the shared one serves
that rank). In a job of one node the ranks never change: once every local
rank has its own, the shared one is not kept once they are ready
(agent/warm_pool.py ``per_rank_only``), and one still importing is forked
from as the shared one would have been. A package that reads a variable
outside ``RANK_VARS`` when it is imported (the port, the restart count) is
refused by the per-rank ones too, and then imported ahead of time by none.

Cost: one interpreter per local rank, only for a script that imports such a
package, each bounded as the shared one (time, resident memory) and importing
at idle CPU priority while the workers train (docs/training.md, *Warm
starts*, has the measured size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from elastrun.agent.zygote import Zygote

__all__ = ["RANK_VARS", "RankZygotes", "rank_part", "same_ranks"]

# The variables a per-rank warm interpreter is started with, and which a
# round must give its local rank again for it to be used.
RANK_VARS = frozenset(
    (
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
    )
)


def rank_part(env: Mapping[str, str]) -> dict[str, str]:
    """The rank variables of a worker's environment."""
    return {k: env[k] for k in sorted(RANK_VARS) if k in env}


def same_ranks(started: Mapping[str, str], wanted: Mapping[str, str]) -> str | None:
    """None if a per-rank warm interpreter started with ``started`` may fork a
    worker with ``wanted``; otherwise the first rank variable that differs."""
    for key in sorted(RANK_VARS):
        if started.get(key) != wanted.get(key):
            return key
    return None


Spawn = Callable[[Mapping[str, str], int], "Zygote | None"]
Discard = Callable[[Zygote, str], None]
Compatible = Callable[[Mapping[str, str], Mapping[str, str]], "str | None"]


class RankZygotes:
    """The per-rank warm interpreters of a node, by local rank. ``spawn``
    starts one for a worker's environment and local rank, ``discard`` lets
    one go with a reason, ``compatible`` compares the rest of the
    environment (as for the shared one)."""

    def __init__(self, spawn: Spawn, discard: Discard, compatible: Compatible) -> None:
        self._spawn = spawn
        self._discard = discard
        self._compatible = compatible
        self.by_rank: dict[int, Zygote] = {}
        self.envs: dict[int, dict[str, str]] = {}  # the last round's, by local rank
        self.given_up = False

    def zygotes(self) -> list[Zygote]:
        return list(self.by_rank.values())

    def why_not(self, z: Zygote, env: Mapping[str, str]) -> str | None:
        """Why ``z`` cannot fork a worker with ``env`` (None: it can). Its end
        is what the pool read (``Zygote.catch_up``, before ``keep`` and
        ``take``), never its exit code alone: a refusal it sent is read first."""
        if z.gone is not None:
            return z.gone
        why = self._compatible(z.env, env) or same_ranks(z.env, env)
        return None if why is None else f"started with a different {why}"

    def keep(self, envs: Mapping[int, Mapping[str, str]], wanted: bool) -> None:
        """After a round started (``envs``: its workers'): make sure each local
        rank has one for the same variables when ``wanted`` (a package needs
        them), none otherwise."""
        self.envs = {lr: dict(env) for lr, env in envs.items()}
        if wanted and not self.given_up:
            self.refresh()
        else:
            self.drop("no module needs a rank's variables")

    def refresh(self) -> None:
        """Start the missing ones for the last round's ranks (and replace
        those that no longer fit them)."""
        for lr, env in sorted(self.envs.items()):
            z = self.by_rank.get(lr)
            if z is not None:
                why = self.why_not(z, env)
                if why is None:
                    continue
                self._let_go(lr, z, why)
            new = self._spawn(env, lr)
            if new is not None:
                self.by_rank[lr] = new
        for lr in [lr for lr in self.by_rank if lr not in self.envs]:
            self._let_go(lr, self.by_rank[lr], "its local rank is not started any more")

    def take(
        self, envs: Mapping[int, Mapping[str, str]], *, unready: bool = False
    ) -> dict[int, Zygote]:
        """The ready ones (``unready``: those still importing too) that may
        fork these workers, by local rank; those that may not are discarded
        (one still importing, not taken, is kept)."""
        out = {}
        for lr, env in envs.items():
            z = self.by_rank.get(lr)
            if z is None:
                continue
            why = self.why_not(z, env)
            if why is not None:
                self._let_go(lr, z, why)
            elif z.ready or unready:
                out[lr] = z
        return out

    def forget(self, z: Zygote) -> None:
        """``z`` was let go elsewhere."""
        if z.local_rank is not None and self.by_rank.get(z.local_rank) is z:
            del self.by_rank[z.local_rank]

    def drop(self, why: str) -> None:
        for lr, z in list(self.by_rank.items()):
            self._let_go(lr, z, why)

    def _let_go(self, lr: int, z: Zygote, why: str) -> None:
        self.by_rank.pop(lr, None)
        self._discard(z, why)
