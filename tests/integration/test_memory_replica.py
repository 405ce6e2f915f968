"""Memory checkpoint replicas with real agents and real torch workers (gloo).

Two training nodes and a hot spare on loopback addresses of their own
(``--local-addr``), each rank with a state of its own
(tests/integration/scripts/replica_worker.py). Each agent sends its workers'
marked snapshots (every 5th step) to the next node's agent. A node's agent is
SIGKILLed at step 12, once the other node holds its step-10 replica: the
spare takes its place and its rank, and both ranks resume at step 10, the
lost rank's state coming from the survivor's replica (no checkpoint folder at
all: nothing on disk to read). When the survivor refused the replicas (over
its size bound), both ranks fall back to the disk checkpoint they agree on.

Strangers at a replica port (no token: the port is open, as the store is):
one sends a replica whose header is 60 MB of tree nodes, then four hold
connections silent; the receiving agent's memory stays bounded, the job
trains on in the same round, and the neighbour's replicas keep arriving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.replica import GREETING, NONCE, Offer
from elastrun.names import RunId
from elastrun.rendezvous.keys import Keys
from elastrun.store.client import TcpStore
from elastrun.worker.snapshot import MAGIC, data_offset
from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import BOUND, Job, job
from tests.store.abuse import vm_kib

pytest.importorskip("torch")

ADDRS = {"a": "127.0.0.2", "b": "127.0.0.3", "s": "127.0.0.4"}


def flags(port: int, name: str, j: Job, *, host: bool) -> list[str]:
    return [
        "--nnodes=2:3",
        "--node-unit=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=replicas",
        "--max-restarts=3",
        f"--local-addr={ADDRS[name]}",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-{name}.jsonl'}",
    ]


def kinds(j: Job, name: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in j.events(name) if e["kind"] == kind]


def loaded(j: Job) -> list[dict[str, Any]]:
    path = j.dir / "loaded.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def lose_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Job:
    """Train a and b, kill b's agent at step 12, let the spare s replace it;
    returns the finished job (every agent exited 0)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the agents' environment
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", flags(port, "a", j, host=True), script="replica_worker.py")
        b = j.start_agent("b", flags(port, "b", j, host=False), script="replica_worker.py")
        wait_for(j.steps, BOUND, "training at world 2")
        s = j.start_agent("s", flags(port, "s", j, host=False), script="replica_worker.py")
        wait_for(
            lambda: sum(1 for st in j.steps() if st["step"] == 12) == 2,
            BOUND,
            "both ranks at step 12",
        )
        wait_for(lambda: kinds(j, "s", "node_waiting"), BOUND, "the spare waits")
        b_rank = next(st["rank"] for st in j.steps() if st["node"] == "b")
        b_pids = {st["pid"] for st in j.steps() if st["node"] == "b"}
        if "ELASTRUN_REPLICA_MAX_BYTES" not in env:
            wait_for(
                lambda: any(
                    e["rank"] == b_rank and e["step"] == 10
                    for e in kinds(j, "a", "memory_replica_received")
                ),
                BOUND,
                "a holds b's step-10 replica",
            )
        else:
            wait_for(
                lambda: any(e["step"] == 10 for e in kinds(j, "b", "memory_checkpoint_persisted")),
                BOUND,
                "b's step 10 on disk",
            )
        os.kill(b.proc.pid, signal.SIGKILL)  # the agent alone: its guard does the rest
        assert b.wait(BOUND) == -signal.SIGKILL
        wait_for(lambda: not any(pid_alive(p) for p in b_pids), BOUND, "the lost node's workers")
        j.touch("go")
        for agent in (a, s):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        assert b_rank in {st["rank"] for st in j.steps() if st["node"] == "s"}
        return j


def test_a_lost_node_s_rank_resumes_from_the_neighbour_s_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"MEM_STEPS": "16", "MEM_HOLD_AT": "12", "MEM_REPLICATE": "5"}
    # With a store token, the replicas are signed with a key derived from it.
    env["ELASTRUN_STORE_TOKEN"] = "replica-test-token"
    j = lose_a_node(tmp_path, monkeypatch, env)
    resumed = [ld for ld in loaded(j) if ld["node"] in ("a", "s") and ld["step"] > 0]
    by_node = {ld["node"]: ld for ld in resumed}
    assert set(by_node) == {"a", "s"}, loaded(j)
    # Both ranks agreed on the replicated step, each got its own rank's state.
    assert {ld["step"] for ld in resumed} == {10} and all(ld["w_ok"] for ld in resumed), resumed
    assert not (tmp_path / "ckpt").exists()  # no checkpoint folder: no disk read possible
    out = j.agents[0].output() + j.agents[2].output()
    assert (
        "=> using memory checkpoint: step 10;" in out and "from a neighbour node's replica" in out
    )
    sent = kinds(j, "b", "memory_replica_sent")
    assert any(e["step"] == 10 for e in sent), sent
    assert not kinds(j, "a", "memory_replica_refused")
    assert all(e["authenticated"] for e in kinds(j, "a", "memory_replica_received"))
    final = [st for st in j.steps() if st["step"] == 16]
    assert {st["node"] for st in final} == {"a", "s"}


def test_a_refused_replica_falls_back_to_the_disk_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    env = {
        "MEM_STEPS": "16",
        "MEM_HOLD_AT": "12",
        "MEM_REPLICATE": "0",
        "MEM_PERSIST": "5",
        "MEM_DIR": str(ckpt),
        "ELASTRUN_REPLICA_MAX_BYTES": "100",  # every replica is over the bound
    }
    j = lose_a_node(tmp_path, monkeypatch, env)
    refused = kinds(j, "a", "memory_replica_refused")
    assert refused and "over the bound of 100" in refused[0]["reason"], refused
    assert not kinds(j, "a", "memory_replica_received")
    resumed = [ld for ld in loaded(j) if ld["node"] in ("a", "s") and ld["step"] > 0]
    assert {ld["step"] for ld in resumed} == {10} and len(resumed) == 2, loaded(j)
    assert all(ld["w_ok"] for ld in resumed), resumed
    out = j.agents[0].output() + j.agents[2].output()
    assert "=> using checkpoint from rank: 0, step: 10" in out, out[-3000:]
    assert "=> using memory checkpoint" not in out


STRANGER = "127.0.0.9"  # the strangers' own loopback address


async def _replica_port(store_port: int) -> int:
    """The replica port group rank 0's agent published (its job note)."""
    store = await TcpStore.connect("127.0.0.1", store_port, timeout=BOUND)
    try:
        kv = await store.get(Keys(RunId("replicas")).note("replica_0"))
        assert kv is not None
        return int(json.loads(kv.value)["port"])
    finally:
        await store.close()


def _greeted(addr: tuple[str, int]) -> socket.socket:
    """A stranger's connection (from its own address), once greeted."""
    sock = socket.create_connection(addr, timeout=BOUND, source_address=(STRANGER, 0))
    got = b""
    try:
        while len(got) < len(GREETING) + NONCE:
            chunk = sock.recv(64)
            if not chunk:
                raise ConnectionError("closed at once")
            got += chunk
    except BaseException:
        sock.close()
        raise
    return sock


def send_huge_header(addr: tuple[str, int], mb: int) -> None:
    """A well-formed replica (offer, magic, header, no data) whose header is
    ``mb`` MB of tree nodes; what the port answers is not needed."""
    empty = hashlib.sha256(b"").hexdigest().encode()
    nodes = mb * (1 << 20) // 8
    parts = [
        b'{"v":1,"step":5,"rank":0,"world_size":2,"generation":1,"data_size":0,"sha256":"',
        empty,
        b'","persist":null,"tensors":[],"tree":{"l":[',
        b'{"v":0},' * (nodes - 1),
        b'{"v":0}]}}',
    ]
    hlen = sum(map(len, parts))
    pad = bytes(data_offset(hlen) - 16 - hlen)
    blob = b"".join([MAGIC, hlen.to_bytes(8, "little"), *parts, pad])
    offer = Offer("replicas", 0, 5, 1, len(blob), hashlib.sha256(blob).hexdigest(), 0, "x")
    with contextlib.suppress(OSError), _greeted(addr) as sock:
        body = offer.encode()
        sock.sendall(struct.pack(">I", len(body)) + body + blob)
        while sock.recv(4096):
            pass


def hold_silent(addr: tuple[str, int], count: int, stop: threading.Event) -> None:
    """Keep ``count`` connections open, each after an offer of 16 MiB and then
    silent; one the port closes is opened again, until ``stop``."""
    held: list[socket.socket] = []
    offer = Offer("replicas", 0, 5, 1, 16 << 20, "0" * 64, 1, "x").encode()
    try:
        while not stop.is_set():
            alive = []
            for sock in held:
                try:
                    closed = sock.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    sock.close()
                else:
                    alive.append(sock)
            held = alive
            while len(held) < count and not stop.is_set():
                try:
                    sock = _greeted(addr)
                    sock.sendall(struct.pack(">I", len(offer)) + offer)
                    sock.setblocking(False)  # looked at without waiting, above
                    held.append(sock)
                except OSError:
                    break  # refused at once: try again shortly
            stop.wait(0.05)
    finally:
        for sock in held:
            sock.close()


def test_strangers_at_a_replica_port_leave_training_and_the_replicas_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group rank 0's agent, attacked: its peak memory grows by less than
    300 MB for a 60 MB header (1.7 GB before the bound: its loop blocked for
    seconds and the job re-formed); with four strangers holding connections,
    its neighbour's replicas keep arriving (none in 60 s before the slot kept
    for the neighbour); the same workers train throughout, in one round."""
    env = {"MEM_STEPS": "100000", "MEM_REPLICATE": "2", "MEM_STOP": "stop"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("ELASTRUN_STORE_TOKEN", raising=False)
    port = free_port()
    with job(tmp_path) as j:
        agents = {
            "a": j.start_agent("a", flags(port, "a", j, host=True), script="replica_worker.py"),
            "b": j.start_agent("b", flags(port, "b", j, host=False), script="replica_worker.py"),
        }
        wait_for(
            lambda: all(kinds(j, n, "memory_replica_received") for n in agents),
            BOUND,
            "each agent holds a replica",
        )
        (target,) = [n for n in agents if kinds(j, n, "round_joined")[-1]["group_rank"] == 0]
        agent = agents[target]
        workers = {st["pid"] for st in j.steps()}
        replica = (ADDRS[target], asyncio.run(_replica_port(port)))

        before = vm_kib(agent.proc.pid, "VmHWM")
        send_huge_header(replica, 60)
        grew = vm_kib(agent.proc.pid, "VmHWM") - before
        print(f"a 60 MB replica header: the receiving agent's VmHWM grew by {grew / 1024:.1f} MB")
        assert grew < 300 << 10, f"the agent's peak memory grew by {grew >> 10} MB"
        wait_for(
            lambda: any(
                "its header of" in e["reason"] for e in kinds(j, target, "memory_replica_refused")
            ),
            BOUND,
            "the 60 MB header refused",
        )

        # Four strangers hold connections; the neighbour's replicas still arrive.
        def received() -> int:
            return len(kinds(j, target, "memory_replica_received"))

        def kept() -> bool:
            return any(
                "one is kept for it" in e["reason"]
                for e in kinds(j, target, "memory_replica_refused")
            )

        stop = threading.Event()
        holder = threading.Thread(target=hold_silent, args=(replica, 4, stop), daemon=True)
        holder.start()
        try:
            wait_for(kept, BOUND, "the strangers hold their connections")
            got = received()
            wait_for(lambda: received() >= got + 5, BOUND, "replicas while strangers hold")
        finally:
            stop.set()
            holder.join(BOUND)
        j.touch("stop")
        for a in agents.values():
            assert a.wait(BOUND) == 0, a.output()[-3000:]
        # The same workers from first to last, one round: the job never re-formed.
        assert {st["pid"] for st in j.steps()} == workers
        assert all(len(kinds(j, n, "round_joined")) == 1 for n in agents)
