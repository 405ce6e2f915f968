"""Run rendezvous handlers in this process against an embedded TCP store.

Usage: python -m tests.integration.rdzv_node HOST PORT SPEC_JSON

SPEC_JSON: {"run_id", "min", "max", "count", "prefix", "ttl", "last_call",
"join_timeout", "max_restarts", "nproc", "script", "progress"}. ``script`` is a list of
steps every handler runs in turn: "next_round", "wait_change", "restart",
"complete", "shutdown", "sleep:S", "hang". Each handler prints one JSON line
per step result: {"node", "step", "ok", ...}; with "progress": true also one line
per waiting-status report: {"node", "step": "progress", "state", "joined", ...}.
Exits 0 when every handler ends.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from elastrun.failure import FailureRecord
from elastrun.rendezvous.api import RendezvousHooks, RendezvousSettings, WaitingStatus
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.store.client import TcpStore


def out(**fields: object) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


async def handler(store: TcpStore, spec: dict[str, Any], index: int) -> None:
    node = f"{spec.get('prefix', 'n')}{index}"
    settings = RendezvousSettings(
        run_id=spec["run_id"],
        min_nodes=spec["min"],
        max_nodes=spec["max"],
        max_restarts=spec.get("max_restarts", 0),
        lease_ttl=spec.get("ttl", 2.0),
        last_call_timeout=spec.get("last_call", 1.0),
        join_timeout=spec.get("join_timeout", 60.0),
        exit_barrier_timeout=spec.get("barrier", 30.0),
        nproc=spec.get("nproc", 1),
        host=node,
        addr="127.0.0.1",
    )
    rdzv = DynamicRendezvous(store, settings, node_id=node)
    if spec.get("progress"):

        def progress(st: WaitingStatus) -> None:
            out(
                node=node,
                step="progress",
                ok=True,
                round=st.round,
                state=st.state,
                joined=st.joined,
                deadline=st.deadline,
                left=st.seconds_left,
                detail=st.detail,
            )

        rdzv.attach(RendezvousHooks(progress=progress))
    try:
        for step in spec["script"]:
            t0 = time.monotonic()
            try:
                if step == "next_round":
                    r = await rdzv.next_round()
                    # Every member (the result may name only this node's place).
                    whole = await rdzv.full_result(r)
                    out(
                        node=node,
                        step=step,
                        ok=True,
                        round=r.round,
                        rank=r.group_rank,
                        world=r.group_world_size,
                        world_size=r.world_size,
                        offset=r.rank_offset,
                        members=[m.node_id for m in whole.members],
                        # What the whole membership says of this node's place.
                        whole=[
                            whole.group_rank,
                            whole.group_world_size,
                            whole.world_size,
                            whole.rank_offset,
                        ],
                        master=[r.master_addr, r.master_port],
                        restarts=r.restart_count,
                        t=time.monotonic() - t0,
                    )
                elif step == "wait_change":
                    c = await rdzv.wait_for_change()
                    out(
                        node=node,
                        step=step,
                        ok=True,
                        reason=c.reason,
                        detail=c.detail,
                        t=time.monotonic() - t0,
                    )
                elif step == "restart":
                    await rdzv.request_restart(FailureRecord(host=node, exitcode=1))
                    out(node=node, step=step, ok=True, t=time.monotonic() - t0)
                elif step == "complete":
                    await rdzv.complete()
                    out(node=node, step=step, ok=True, t=time.monotonic() - t0)
                elif step == "shutdown":
                    await rdzv.shutdown()
                    out(node=node, step=step, ok=True)
                elif step.startswith("sleep:"):
                    await asyncio.sleep(float(step.split(":", 1)[1]))
                elif step == "hang":
                    out(node=node, step=step, ok=True)
                    await asyncio.sleep(3600)
            except Exception as exc:
                out(
                    node=node,
                    step=step,
                    ok=False,
                    error=type(exc).__name__,
                    message=str(exc),
                    t=time.monotonic() - t0,
                )
                return
    finally:
        await rdzv.shutdown()


async def main() -> None:
    host, port, raw = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    spec = json.loads(raw)
    store = await TcpStore.connect(host, port, timeout=30.0)
    try:
        first = spec.get("first", 0)
        await asyncio.gather(*(handler(store, spec, first + i) for i in range(spec["count"])))
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main())
