"""Rendezvous time for N simulated agents on the embedded store (and on etcd).

``python -m bench.rdzv_bench [--sizes 8,64,256] [--procs 4] [--reps 3] [--backends embedded,etcd]``

Starts ``elastrun store serve`` on loopback (``etcd``: a single-member etcd on
loopback, from the ``etcd`` binary on PATH, with a temporary data dir), then
``--procs`` processes each running N/procs rendezvous handlers
(``DynamicRendezvous``, min = max = N, so the round closes as soon as everyone
joined: this measures the protocol, not the last call). On the embedded store
each handler has its own connection, as each real agent has (etcd: one client
per process). The processes connect
first; then all are told "go" at once, and each reports how long its handlers
took from "go" to holding the round's result. The rendezvous time is the
slowest handler's; the median over the repetitions is printed. Then every
handler completes (exit barrier), timed too (``--detail``: also when each
process's handlers left it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent


async def _worker(host: str, port: int, spec: dict[str, object]) -> None:
    from elastrun.names import RunId
    from elastrun.rendezvous.api import RendezvousSettings
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.store.base import Store
    from elastrun.store.client import TcpStore

    n, count, first = int(spec["n"]), int(spec["count"]), int(spec["first"])  # type: ignore[call-overload]
    stores: list[Store]
    if spec.get("backend") == "etcd":
        from elastrun.store.etcd import open_etcd_store
        from elastrun.store.etcd_options import EtcdOptions

        # One client per simulated agent, as each real agent has its own (a
        # client shared by hundreds of handlers scans a pool of hundreds of
        # watch streams at each request: a cost no real agent pays).
        options = EtcdOptions(key_prefix=f"/bench/{spec['run_id']}/")
        stores = [
            await open_etcd_store(f"{host}:{port}", options=options, timeout=60.0)
            for _ in range(count)
        ]
    else:
        # One connection per simulated agent, as each real agent has its own:
        # the store's per-connection output bound then applies per agent.
        stores = [
            await TcpStore.connect(host, port, timeout=30.0, request_timeout=60.0)
            for _ in range(count)
        ]
    handlers = [
        DynamicRendezvous(
            stores[i],
            RendezvousSettings(
                run_id=RunId(str(spec["run_id"])),
                min_nodes=n - 1 if spec.get("lose") else n,
                max_nodes=n,
                last_call_timeout=1.0,
                # The node to lose (a0) on a short lease: its keys go 0.25 s
                # after its connection (the store's grace: half the TTL).
                lease_ttl=0.5 if spec.get("lose") and first + i == 0 else 30.0,
                join_timeout=120.0,
                host=f"a{first + i}",
                addr="127.0.0.1",
            ),
            node_id=f"a{first + i}",
        )
        for i in range(count)
    ]
    tally: Counter[str] = Counter()
    if spec.get("tally"):
        for store in stores:
            _tally(store, tally)
    # The setup's objects (connections, handlers) out of the cyclic
    # collector's walks: a process simulating thousands of agents would
    # otherwise walk every agent's objects at each older-generation
    # collection (1.4-1.8 s of a process's CPU at 8192 agents), a cost no
    # real agent, one per process, pays.
    gc.collect()
    gc.freeze()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0, c0 = time.monotonic(), time.process_time()
    if spec.get("lose") and first == 0:
        # The node lost: a0 joins, then its connection drops (as when its host
        # dies: the store cuts its lease to a grace) before the round closes.
        lost = asyncio.create_task(handlers[0].next_round())
        while handlers[0]._observer.joined is None and not lost.done():
            await asyncio.sleep(0.001)
        lost.cancel()
        await stores[0].close()
        handlers, stores = handlers[1:], stores[1:]
    results = await asyncio.gather(*(h.next_round() for h in handlers))
    t_round, c_round = time.monotonic() - t0, time.process_time() - c0
    size = n - 1 if spec.get("lose") else n
    assert all(r.group_world_size == size for r in results), "the lost node is in the round"
    if spec.get("lose"):  # every member, not only this handler's own place
        whole = await handlers[0].full_result(results[0])
        assert not any(m.node_id == "a0" for m in whole.members), "a0 is in the round"
    t1, c1 = time.monotonic(), time.process_time()
    each: list[float] = []

    async def complete(h: DynamicRendezvous) -> None:
        await h.complete()
        each.append(time.monotonic() - t1)

    await asyncio.gather(*(complete(h) for h in handlers))
    t_done, c_done = time.monotonic() - t1, time.process_time() - c1
    await asyncio.gather(*(h.shutdown() for h in handlers))
    for store in {id(s): s for s in stores}.values():
        await store.close()
    each.sort()
    out = {
        "round": t_round,
        "complete": t_done,
        "each": each,
        "cpu": [c_round, c_done],
        "tally": dict(tally),
    }
    print(json.dumps(out), flush=True)


def _tally(store: object, tally: Counter[str]) -> None:
    """Count ``store``'s requests by operation and the bytes of their answers
    as JSON (embedded store: its connection's ``_send``; watch events are not
    counted). Costs CPU: only with ``--tally``, never in a timed run."""
    from elastrun.store import codec

    send = getattr(store, "_send", None)
    if send is None:
        return

    async def counted(conn: object, deadline: float, request: Any, decode: object) -> object:
        answer = await send(conn, deadline, request, decode)
        tally[request.OP] += 1
        tally["answer_bytes"] += len(json.dumps(codec.encode_answer(answer)))
        return answer

    setattr(store, "_send", counted)  # noqa: B010 (an instance's method, replaced)


@dataclass(frozen=True)
class Run:
    """One run's numbers: wall seconds to a closed round and through the exit
    barrier; the store host's CPU seconds (go -> every handler through the
    barrier) and its peak memory minus its memory before the agents connected
    (bytes); the agents' CPU seconds in all (round, barrier)."""

    round: float
    barrier: float
    host_cpu: float
    host_mem: int
    agents_cpu: float
    tally: dict[str, int] = field(default_factory=dict)  # requests by op, answer bytes (--tally)


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _memory(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of process ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _run_once(
    addr: tuple[str, int],
    n: int,
    procs: int,
    backend: str = "embedded",
    detail: bool = False,
    host_pid: int = 0,
    lose: bool = False,
    tally: bool = False,
) -> Run:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    procs = min(procs, n)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    children = []
    errs: list[IO[bytes]] = []
    for p in range(procs):
        count = n // procs + (1 if p < n % procs else 0)
        first = sum(n // procs + (1 if q < n % procs else 0) for q in range(p))
        spec = {
            "run_id": run_id,
            "n": n,
            "count": count,
            "first": first,
            "backend": backend,
            "lose": lose,
            "tally": tally,
        }
        argv = [sys.executable, "-m", "bench.rdzv_bench", "--worker", addr[0], str(addr[1])]
        errs.append(tempfile.TemporaryFile())  # noqa: SIM115 (closed in the finally below)
        children.append(
            subprocess.Popen(
                [*argv, json.dumps(spec)],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errs[-1],
                text=True,
            )
        )
    try:
        rss = _memory(host_pid, "VmRSS") if host_pid else 0
        for c, err in zip(children, errs, strict=True):
            assert c.stdout is not None
            line = c.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"worker failed to start: {line!r}{_tail(c, err)}")
        cpu = _cpu(host_pid) if host_pid else 0.0
        for c in children:
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        times = []
        for c, err in zip(children, errs, strict=True):
            out, _ = c.communicate(timeout=300)
            lines = out.strip().splitlines()
            if c.returncode != 0 or not lines:
                raise RuntimeError(f"a worker of the {n}-agent run failed{_tail(c, err)}")
            times.append(json.loads(lines[-1]))
        if detail:  # when each handler left the barrier, per process (seconds)
            for p, t in enumerate(times):
                each = t["each"]
                q = [each[min(len(each) - 1, int(f * len(each)))] for f in (0.0, 0.5, 0.9)]
                print(
                    f"  process {p}: {len(each)} handlers left the barrier after "
                    f"min {q[0]:.2f} / p50 {q[1]:.2f} / p90 {q[2]:.2f} / max {each[-1]:.2f} s",
                    flush=True,
                )
        host_cpu = _cpu(host_pid) - cpu if host_pid else 0.0
        peak = _memory(host_pid, "VmHWM") - rss if host_pid else 0
        return Run(
            round=max(t["round"] for t in times),
            barrier=max(t["complete"] for t in times),
            host_cpu=host_cpu,
            host_mem=peak,
            agents_cpu=sum(sum(t["cpu"]) for t in times),
            tally=dict(sum((Counter(t["tally"]) for t in times), Counter())),
        )
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(10)
        for err in errs:
            err.close()


def _tail(proc: subprocess.Popen[str], err: IO[bytes]) -> str:
    """A failed worker's exit status and the end of its stderr, for the error."""
    proc.poll()
    err.seek(0)
    raw = err.read()
    # The first error (the cause) and the end (what it led to).
    text = (
        (raw if len(raw) <= 6000 else raw[:3000] + b"\n...\n" + raw[-3000:])
        .decode("utf-8", "replace")
        .strip()
    )
    return f" (exit status {proc.returncode}):\n{text or '(no output on stderr)'}"


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def _etcd_member() -> Iterator[tuple[tuple[str, int], int]]:
    """A single-member etcd on loopback (temporary data dir), stopped by pid."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("the etcd rows need the etcd server binary on PATH (`make etcd`)")
    client, peer = _free_ports(2)
    base = Path(tempfile.mkdtemp(prefix="elastrun-bench-etcd-"))
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    args = [
        binary, "--name", "m0", "--data-dir", str(base / "data"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"m0={peer_url}", "--initial-cluster-state", "new",
    ]  # fmt: skip
    with open(base / "etcd.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        break
            except (OSError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: {(base / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield ("127.0.0.1", client), proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def _table(
    title: str,
    host: Callable[[], AbstractContextManager[tuple[tuple[str, int], int]]],
    sizes: list[int],
    args: argparse.Namespace,
    backend: str,
) -> None:
    """One row per size: the medians over ``--reps`` runs, each on a fresh
    store host (so its memory is that run's); under each row the store host's
    CPU and memory per agent and the agents' CPU per agent; then the growth
    exponents (log of the time ratio over log of the size ratio)."""
    print(f"rendezvous on {title} ({args.procs} processes, {args.reps} reps)")
    print(f"{'agents':>7} {'rendezvous s (median)':>22} {'exit barrier s':>15}")
    medians: dict[int, Run] = {}
    for n in sizes:
        runs = []
        for _ in range(args.reps):
            with host() as (addr, pid):
                runs.append(
                    _run_once(
                        addr, n, args.procs, backend, args.detail, pid, args.lose_one, args.tally
                    )
                )
        timed = [f for f in Run.__dataclass_fields__ if f != "tally"]
        med = Run(
            **{f: statistics.median(getattr(r, f) for r in runs) for f in timed},
            tally=runs[0].tally,
        )
        medians[n] = med
        print(f"{n:>7} {med.round:>22.3f} {med.barrier:>15.3f}", flush=True)
        print(
            f"        per agent: store host CPU {med.host_cpu / n * 1e3:.2f} ms, "
            f"store host memory {med.host_mem / n / 1024:.1f} KiB, "
            f"agents' CPU {med.agents_cpu / n * 1e3:.2f} ms (load average "
            f"{os.getloadavg()[0]:.1f})",
            flush=True,
        )
        if med.tally:
            ops = {k: v for k, v in med.tally.items() if k != "answer_bytes"}
            print(
                f"        per agent (--tally, first run): {sum(ops.values()) / n:.1f} requests "
                f"({', '.join(f'{k} {v / n:.1f}' for k, v in sorted(ops.items()))}), "
                f"{med.tally.get('answer_bytes', 0) / n / 1024:.1f} KiB of answers",
                flush=True,
            )
    _exponents(medians)


def _exponents(medians: dict[int, Run]) -> None:
    """Growth exponents between the sizes run: from each size to the next, and
    from 512 to 4096 when both ran (1: linear, 2: quadratic)."""
    sizes = sorted(medians)
    pairs = list(itertools.pairwise(sizes))
    if 512 in medians and 4096 in medians and (512, 4096) not in pairs:
        pairs.append((512, 4096))
    for a, b in pairs:
        ra, rb = medians[a], medians[b]
        k = math.log(b / a)
        parts = [
            f"{name} {math.log(max(y, 1e-6) / max(x, 1e-6)) / k:.2f}"
            for name, x, y in (
                ("round", ra.round, rb.round),
                ("barrier", ra.barrier, rb.barrier),
                ("store host CPU", ra.host_cpu, rb.host_cpu),
                ("agents' CPU", ra.agents_cpu, rb.agents_cpu),
            )
        ]
        print(f"  growth exponent {a} -> {b}: {', '.join(parts)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="embedded", help="embedded, etcd or embedded,etcd")
    ap.add_argument(
        "--detail",
        action="store_true",
        help="also print, per process, when its handlers left the exit barrier",
    )
    ap.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=0,
        help="the store's connection caps (in all and from one address: every simulated "
        "agent connects from 127.0.0.1); default: the largest size plus 64 above 2000 "
        "agents, else the store's defaults (8192 in all, 2048 per address)",
    )
    ap.add_argument(
        "--max-output-bytes",
        default="",
        help="the store's max_output_bytes (e.g. 1G): the answers queued for all clients "
        "(default 64M; each agent's answers are a few KiB, 8192 agents fit)",
    )
    ap.add_argument(
        "--lose-one",
        action="store_true",
        help="one agent (a0) joins, then its connection drops before the round closes: "
        "min is N-1, and the round must close with the N-1 others (checked; embedded store; "
        "at a few hundred agents or more, where joining takes longer than a0's 0.25 s grace)",
    )
    ap.add_argument(
        "--tally",
        action="store_true",
        help="also count each simulated agent's store requests by operation and the bytes "
        "of their answers (embedded store; costs CPU: the times of such a run are not "
        "comparable)",
    )
    ap.add_argument("--worker", nargs=3, metavar=("HOST", "PORT", "SPEC"))
    args = ap.parse_args()
    if args.worker:
        host, port, spec = args.worker
        asyncio.run(_worker(host, int(port), json.loads(spec)))
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"embedded", "etcd"}
    if unknown:
        ap.error(f"--backends: unknown {sorted(unknown)}; choose embedded, etcd")
    if "embedded" in backends:
        _bench_embedded(sizes, args)
    if "etcd" in backends:
        _table("etcd (single member, loopback)", _etcd_member, sizes, args, "etcd")
    return 0


@contextmanager
def embedded_store(
    env: dict[str, str], connections: int = 0, output_bytes: str = ""
) -> Iterator[tuple[tuple[str, int], int]]:
    """``elastrun store serve`` on loopback, in its own process: its address
    and pid; terminated (then killed) on exit. ``connections``: allow that
    many connections in all and from one address (the simulated agents all
    connect from 127.0.0.1); 0: the store's defaults."""
    limits = []
    if connections:
        limits = ["--max-connections", str(connections)]
        limits += ["--max-connections-per-peer", str(connections)]
    if output_bytes:
        limits += ["--max-output-bytes", output_bytes]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastrun",
            "store",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *limits,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        m = re.search(r"listening on (\S+):(\d+)", server.stdout.readline())
        if not m:
            raise RuntimeError("the store did not start")
        # Keep reading what the store prints (its log): a full pipe would stall it.
        threading.Thread(target=server.stdout.read, daemon=True).start()
        yield (m.group(1), int(m.group(2))), server.pid
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def _bench_embedded(sizes: list[int], args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    connections = args.max_connections_per_peer or (max(sizes) + 64 if max(sizes) > 2000 else 0)
    if connections:
        _raise_open_files(connections + 256)
    _table(
        "the embedded store",
        lambda: embedded_store(env, connections, args.max_output_bytes),
        sizes,
        args,
        "embedded",
    )


def _raise_open_files(wanted: int) -> None:
    """The open-file limit of this process and its children at least
    ``wanted`` (up to the hard limit): the store holds one per agent."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))


if __name__ == "__main__":
    sys.exit(main())
