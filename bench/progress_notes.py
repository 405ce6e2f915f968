"""What sharing step times costs the agents: ``progress_*`` notes at N nodes.

``python -m bench.progress_notes [--nodes 64] [--ranks 8] [--intervals 10] [--every 1.0]
[--out FILE]``

Starts ``elastrun store serve`` on loopback (a real embedded store, in its own
process), then, in this process, N simulated agents: each a
``DynamicRendezvous`` with its own connection, as each real agent has. They
form one round (min = max = N), then each runs the agents' real progress
loop (``elastrun.agent.stragglers.publish_loop``) over its ``--ranks`` ranks,
whose heartbeat files (the format worker/_progress.py writes) are real files
(one rank is slower, so that there is a straggler to find), every ``--every``
seconds until each agent has published ``--intervals`` times. Nothing else
runs in this process meanwhile.

Reported: the CPU time of this process (all the agents, including their
store clients) per agent and interval (divided by the intervals the agents
completed) and per interval of the whole job; the note bytes an agent reads
per interval (get / range answers, counted at each agent's store
connection); and the store process's CPU per interval of the whole job.
Run it on two versions of elastrun (``PYTHONPATH=<tree>/src``) to compare
them: it uses only ``publish_loop`` and the rendezvous, which both have.
Bounded: the whole run is cut after ``--bound`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.rdzv_bench import embedded_store


class CountingStore:
    """A store client that counts the bytes of the key-values its reads return."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.read_bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _count(self, kvs: Any) -> None:
        self.read_bytes += sum(len(kv.key) + len(kv.value) for kv in kvs)

    async def get(self, key: str) -> Any:
        kv = await self._store.get(key)
        self._count([kv] if kv is not None else [])
        return kv

    async def get_prefix(self, prefix: str) -> Any:
        kvs, rev = await self._store.get_prefix(prefix)
        self._count(kvs)
        return kvs, rev


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _beats(folder: Path, node: int, ranks: int, slow: int) -> list[SimpleNamespace]:
    """Heartbeat files of one simulated node's ranks (rank ``slow`` is slower)."""
    workers = []
    for local in range(ranks):
        rank = node * ranks + local
        own = 0.08 if rank == slow else 0.05
        path = folder / f"beat.{rank}.json"
        beat = {"step": 100, "steps": 100, "monotonic": time.monotonic(), "step_time": 0.1}
        beat["own_time"] = own
        path.write_text(json.dumps(beat))
        workers.append(SimpleNamespace(rank=rank, heartbeat_file=str(path)))
    return workers


async def _run(host: str, port: int, args: argparse.Namespace, server_pid: int) -> dict[str, Any]:
    from elastrun.agent import stragglers
    from elastrun.events import ListSink
    from elastrun.names import RunId
    from elastrun.rendezvous.api import RendezvousSettings
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.store.client import TcpStore

    n = args.nodes
    stores = [
        CountingStore(await TcpStore.connect(host, port, timeout=30.0, request_timeout=60.0))
        for _ in range(n)
    ]
    handlers = [
        DynamicRendezvous(
            stores[i],  # type: ignore[arg-type]
            RendezvousSettings(
                run_id=RunId(f"progress-{os.getpid()}"),
                min_nodes=n,
                max_nodes=n,
                nproc=args.ranks,
                lease_ttl=60.0,
                join_timeout=120.0,
                host=f"node{i}",
                addr="127.0.0.1",
            ),
            node_id=f"node{i}",
        )
        for i in range(n)
    ]
    results = await asyncio.gather(*(h.next_round() for h in handlers))
    published = [0] * n

    def counted(i: int) -> None:
        write = handlers[i].write_note

        # A typed note (its name), or an older elastrun's name and value.
        async def write_note(*args: Any, **kw: Any) -> None:
            name = args[0] if isinstance(args[0], str) else args[0].name
            if name.startswith("progress_"):
                published[i] += 1
            await write(*args, **kw)

        handlers[i].write_note = write_note  # type: ignore[method-assign]

    for i in range(n):
        counted(i)
    with tempfile.TemporaryDirectory(prefix="progress-bench-") as tmp:
        groups = [
            SimpleNamespace(workers=_beats(Path(tmp), r.group_rank, args.ranks, slow=5))
            for r in results
        ]
        for s in stores:
            s.read_bytes = 0
        sink = ListSink()
        cpu0, store0, wall0 = time.process_time(), _cpu_of(server_pid), time.monotonic()
        loops = [
            asyncio.ensure_future(
                stragglers.publish_loop(
                    handlers[i],
                    [stragglers.RankFile(w.rank, w.heartbeat_file) for w in groups[i].workers],
                    results[i],
                    f"node{i}",
                    sink,
                    every=args.every,
                )
            )
            for i in range(n)
        ]
        while min(published) < args.intervals and all(not t.done() for t in loops):
            await asyncio.sleep(0.05)
        cpu, store_cpu = time.process_time() - cpu0, _cpu_of(server_pid) - store0
        wall = time.monotonic() - wall0
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for t in loops:
            if not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"a progress loop failed: {t.exception()!r}")
    intervals = sum(published)
    read = sum(s.read_bytes for s in stores)
    await asyncio.gather(*(h.shutdown() for h in handlers))
    for s in stores:
        await s.close()
    return {
        "nodes": n,
        "ranks_per_node": args.ranks,
        "every_s": args.every,
        "agent_intervals": intervals,
        "wall_s": round(wall, 2),
        # per agent and interval (mean), and for the whole job per interval
        "agent_cpu_ms_per_interval": round(cpu / intervals * 1000, 3),
        "agents_cpu_ms_per_job_interval": round(cpu / (intervals / n) * 1000, 1),
        "note_bytes_read_per_agent_interval": round(read / intervals),
        "note_bytes_read_per_interval_max_agent": round(
            max(s.read_bytes / max(1, k) for s, k in zip(stores, published, strict=True))
        ),
        "store_cpu_ms_per_job_interval": round(store_cpu / (intervals / n) * 1000, 1),
        "stragglers_found": sorted({e["rank"] for e in sink.events if e["kind"] == "straggler"}),
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.progress_notes", description=__doc__)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--intervals", type=int, default=10)
    p.add_argument("--every", type=float, default=1.0)
    p.add_argument("--bound", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None, help="also write the result (JSON) here")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with embedded_store(env) as ((host, port), pid):
        result = asyncio.run(asyncio.wait_for(_run(host, port, args, pid), args.bound))
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
