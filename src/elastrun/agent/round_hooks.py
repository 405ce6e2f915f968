"""A feature's part in one round of workers (see agent/hooks.py): the hooks
that agent/workers.py calls while the round's workers start, run and end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastrun.agent.children import ForkedProcess
from elastrun.rendezvous.api import Change
from elastrun.worker._messages import Message

if TYPE_CHECKING:
    from elastrun.agent.process import Worker

__all__ = ["RoundHooks"]


class RoundHooks:
    """A feature's part in one round of workers (one ``WorkerGroup``)."""

    def worker_env(self, worker: Worker) -> Mapping[str, str]:
        """Variables to add to ``worker``'s environment (its folder exists;
        files of an earlier run with this run id are the feature's to remove)."""
        del worker
        return {}

    async def before_start(self) -> None:
        """Before any worker of the round starts (raced with the terminating
        signals; must be bounded)."""

    async def fork(
        self, envs: Mapping[int, Mapping[str, str]], channels: Mapping[int, int]
    ) -> dict[int, ForkedProcess]:
        """Start some of the workers itself (a Python command's only), by
        local rank: each with its environment and its channel socket's fd.
        The core starts the rest, and watches all of them alike."""
        del envs, channels
        return {}

    def started(self) -> None:
        """Every worker of the round was started."""

    def on_message(self, worker: Worker, message: Message) -> None:
        """``worker``'s runner sent ``message`` (typed, bounded: agent/channel.py)."""

    def channel_closed(self, worker: Worker) -> None:
        """``worker``'s channel is gone while it may still run."""

    def exited(self, worker: Worker) -> None:
        """``worker`` exited."""

    async def ended(self) -> None:
        """The round is over (its workers all exited, one failed, or it must
        end): nothing more is to be judged. Called once, before the workers
        are stopped."""

    async def failed(self) -> str:
        """The round failed on this node: lines for the failure summary ("":
        none). Called before the workers are stopped when a feature declared
        a rank failed while it ran (the others still wait for it), else after."""
        return ""

    async def changed(self, change: Change) -> None:
        """The round ends for a change of the job (``change``), before the
        workers are stopped."""
