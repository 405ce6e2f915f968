"""Static rendezvous: a fixed world, torchrun's legacy multi-node launch.

``--rdzv-backend=static --nnodes=N --node-rank=R --master-addr=A --master-port=P``:
every node is told its rank; nothing is exchanged between agents. The workers
of node rank 0 host the process group's store on ``A:P`` (``MASTER_ADDR`` /
``MASTER_PORT``). No elasticity: the world never changes, restarts are counted
per node against ``--max-restarts``, and the exit barrier returns at once.

As nothing is exchanged, every node must run the same ``--nproc-per-node``
(the world size is ``nnodes * nproc``) and the same ``--role`` (role ranks are
global ranks); use ``c10d`` or ``etcd`` otherwise.
"""

from __future__ import annotations

import asyncio

from elastrun.errors import RendezvousClosed, RestartBudgetExhausted
from elastrun.failure import FailureRecord
from elastrun.rendezvous.api import (
    Change,
    Member,
    Rendezvous,
    RendezvousHooks,
    RendezvousSettings,
    RoundResult,
)

__all__ = ["StaticRendezvous"]


class StaticRendezvous(Rendezvous):
    def __init__(
        self,
        settings: RendezvousSettings,
        *,
        node_rank: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        # The launcher's plan checked the settings: a fixed number of nodes,
        # node_rank in 0..nnodes-1, a master port in 1..65535.
        self.settings = settings
        self.node_rank = node_rank
        self.master_addr = master_addr
        self.master_port = master_port
        self.restart_count = 0
        self.last_failure: FailureRecord | None = None
        self._closed = False

    def attach(self, hooks: RendezvousHooks) -> None:
        # Kept, never called: a fixed world waits for no one, holds no lease
        # and has nothing to tell the operator.
        self.hooks = hooks

    def _member(self, rank: int) -> Member:
        me = rank == self.node_rank
        addr = self.settings.addr if me else ""
        if rank == 0 and not addr:
            addr = self.master_addr
        host = self.settings.host if me else ""
        return Member(
            node_id=f"static-{rank}",
            host=host,
            addr=addr,
            group_rank=rank,
            nproc=self.settings.nproc,
            # Nothing is exchanged: every node is taken to run this node's role.
            role=self.settings.role,
        )

    async def next_round(self) -> RoundResult:
        if self._closed:
            raise RendezvousClosed(f"run {self.settings.run_id}: this node already finished")
        return RoundResult(
            run_id=self.settings.run_id,
            round=self.restart_count,
            members=tuple(self._member(r) for r in range(self.settings.max_nodes)),
            group_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            restart_count=self.restart_count,
            max_restarts=self.settings.max_restarts,
            reason="static",
            # Round r > 0 follows the r-th restart, charged as it was asked for.
            charged=self.restart_count > 0,
        )

    async def wait_for_change(self) -> Change:
        # A fixed world never changes: wait until cancelled.
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    async def request_restart(self, failure: FailureRecord) -> None:
        self.last_failure = failure
        if self.restart_count >= self.settings.max_restarts:
            raise RestartBudgetExhausted(
                f"--max-restarts={self.settings.max_restarts} used up on node rank "
                f"{self.node_rank} (static rendezvous counts restarts per node)"
            )
        self.restart_count += 1

    async def complete(self) -> None:
        self._closed = True

    async def shutdown(self) -> None:
        return None
