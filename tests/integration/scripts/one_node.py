"""A one-node Rendezvous for agent tests (a test double of the rendezvous only;
the workers the agent starts are real processes)."""

from __future__ import annotations

import asyncio
from typing import Any

from elastrun.errors import RendezvousClosed, RestartBudgetExhausted
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous.api import (
    Change,
    Member,
    Rendezvous,
    RendezvousHooks,
    RendezvousSettings,
    RoundResult,
)
from tests.helpers import free_port


class OneNodeRendezvous(Rendezvous):
    def __init__(
        self,
        run_id: str = "test-run",
        nproc: int = 1,
        max_restarts: int = 0,
        host: str = "testhost",
        closed: bool = False,
        max_nodes: int = 1,
    ) -> None:
        # max_nodes: what the job allows (more than 1: an elastic job, whose
        # round a waiting node can end); this node is always the only member.
        self.settings = RendezvousSettings(
            run_id=RunId(run_id),
            min_nodes=1,
            max_nodes=max_nodes,
            max_restarts=max_restarts,
            nproc=nproc,
            host=host,
            addr="127.0.0.1",
        )
        self.round = -1
        self.restart_count = 0
        self._charged = 0  # restarts the last round handed out counted
        self.failures: list[dict[str, Any]] = []  # the records, as JSON
        self.completed = 0
        self.shutdowns = 0
        self.closed = closed
        self.change = asyncio.Event()
        self.change_value = Change(reason="node_waiting", detail="a test node waits")

    def attach(self, hooks: RendezvousHooks) -> None:
        self.hooks = hooks

    async def next_round(self) -> RoundResult:
        if self.closed:
            raise RendezvousClosed("test job already finished")
        self.round += 1
        self.change.clear()
        s = self.settings
        # As the store's rendezvous: a round charges the restart asked for in the one before.
        charged, self._charged = self.restart_count > self._charged, self.restart_count
        return RoundResult(
            run_id=s.run_id,
            round=self.round,
            members=(Member("n0", s.host, s.addr, 0, s.nproc),),
            group_rank=0,
            master_addr="127.0.0.1",
            master_port=free_port(),
            restart_count=self.restart_count,
            max_restarts=s.max_restarts,
            charged=charged,
        )

    async def wait_for_change(self) -> Change:
        await self.change.wait()
        return self.change_value

    async def request_restart(self, failure: FailureRecord) -> None:
        self.failures.append(failure.to_json())
        if self.restart_count >= self.settings.max_restarts:
            raise RestartBudgetExhausted(
                f"all {self.settings.max_restarts} restarts of job {self.settings.run_id} are used"
            )
        self.restart_count += 1

    async def complete(self) -> None:
        self.completed += 1
        self.closed = True

    async def shutdown(self) -> None:
        self.shutdowns += 1
