"""End to end on etcd: real agents (``python -m elastrun``), real gloo workers,
real etcd members on loopback, through the etcd v3 API only.

* the elastic scenario of test_elastic.py (join, node loss, worker crash) with
  ``--rdzv-backend=etcd``;
* a 3-member cluster: SIGKILL the member the agents talk to and the job goes
  on (a 2-node job with ``--rdzv-backend=etcd-v2``); kill 2 of 3 and the
  agents stop their workers and fail, clearly, in bounded time;
* bad credentials, a missing TLS file, an unreachable endpoint: a clear error,
  a non-zero exit, no worker started.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import (
    BOUND,
    check_finished,
    job,
    join_loss_and_crash,
    steps_after,
)
from tests.store.etcd_fixture import EtcdCluster, requires_etcd, start_cluster

pytestmark = [pytest.mark.etcd, requires_etcd]

FAIL_BOUND = 90.0  # quorum loss -> agent exit


def etcd_flags(
    endpoints: str,
    run_id: str,
    *,
    backend: str = "etcd",
    nnodes: str = "1:3",
    max_restarts: int = 3,
    conf: str = "",
) -> list[str]:
    rdzv_conf = "last_call_timeout=1,lease_ttl=2,join_timeout=30,key_prefix=/elastrun-test/"
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoints}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        f"--rdzv-conf={rdzv_conf}{',' + conf if conf else ''}",
        "--shutdown-timeout=5",
    ]


def run_id() -> str:
    return f"e2e-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def etcd1() -> Iterator[EtcdCluster]:
    cluster = start_cluster(1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    cluster = start_cluster(3)
    try:
        yield cluster
    finally:
        cluster.stop()


def agent_traceback(out: str) -> bool:
    """A traceback from the agent itself (workers' lines carry a ``[host:rank]`` tag)."""
    return any(line.startswith("Traceback") for line in out.splitlines())


def remote_ports(pid: int) -> set[int]:
    """Remote ports of the established TCP connections of process ``pid`` (from /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED
                    ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


# -- the elastic scenario ---------------------------------------------------------------


def test_join_loss_and_crash_on_etcd(tmp_path: Path, etcd1: EtcdCluster) -> None:
    flags = etcd_flags(etcd1.endpoints, run_id())
    with job(tmp_path) as j:
        join_loss_and_crash(j, tmp_path, lambda name: flags, label="etcd ")


# -- a 3-member cluster ---------------------------------------------------------------


def test_member_loss_job_goes_on(tmp_path: Path, etcd3: EtcdCluster) -> None:
    """SIGKILL the member the agents are connected to (the first endpoint: the
    store starts there; checked in /proc): training goes on and finishes. The
    agents name the backend ``etcd-v2`` (served by the etcd v3 backend): that
    name runs a 2-node job too."""
    flags = etcd_flags(etcd3.endpoints, run_id(), backend="etcd-v2", nnodes="2")
    with job(tmp_path) as j:
        a = j.start_agent("a", flags)
        b = j.start_agent("b", flags)
        wait_for(lambda: sum(s["world"] == 2 for s in j.steps()) >= 4, BOUND, "training")
        mark = len(j.steps())
        step_before = max(s["step"] for s in j.steps())
        victim = etcd3.members[0]
        for agent in (a, b):
            ports = remote_ports(agent.proc.pid)
            assert victim.client_port in ports, (victim.client_port, ports)
        t = time.monotonic()
        victim.kill(signal.SIGKILL)
        # Long enough for leases (TTL 2 s) and watches to have hit the dead member.
        wait_for(
            lambda: len(steps_after(j, mark, lambda s: s["step"] > step_before + 15)) > 0,
            BOUND,
            "training after the etcd member was killed",
        )
        print(f"etcd member loss: training on, {time.monotonic() - t:.1f}s observed")
        assert a.proc.poll() is None and b.proc.poll() is None
        for agent in (a, b):  # they failed over to the survivors
            ports = remote_ports(agent.proc.pid)
            assert ports & {m.client_port for m in etcd3.members[1:]}, ports
        rank0 = check_finished(j, tmp_path, a, b)
        assert rank0[-1] > step_before + 15
        restarts = {s["restart"] for s in j.steps()}
        assert restarts == {0}, f"a member loss must not consume restarts: {restarts}"
        # the etcd-v2 name: one world of 2 that trained (6 steps at least) and finished
        assert sum(s["world"] == 2 for s in j.steps()) >= 6
        assert {s["world"] for s in j.steps()} == {2}


def test_quorum_loss_stops_workers_and_fails(tmp_path: Path, etcd3: EtcdCluster) -> None:
    flags = etcd_flags(etcd3.endpoints, run_id(), nnodes="2")
    with job(tmp_path) as j:
        a = j.start_agent("a", flags)
        b = j.start_agent("b", flags)
        wait_for(lambda: sum(s["world"] == 2 for s in j.steps()) >= 4, BOUND, "training")
        t = time.monotonic()
        for member in etcd3.members[:2]:
            member.kill(signal.SIGKILL)
        codes = [a.wait(FAIL_BOUND), b.wait(FAIL_BOUND)]
        elapsed = time.monotonic() - t
        print(f"etcd quorum loss: agents exited {codes} after {elapsed:.1f}s")
        assert all(code not in (0, None) for code in codes), codes
        for agent in (a, b):
            out = agent.output()
            tail = out[-3000:]
            assert "etcd" in out and etcd3.members[2].endpoint in out, tail
            assert "unavailable" in out.lower() or "unreachable" in out.lower(), tail
            assert not agent_traceback(out), tail
        assert not any(pid_alive(s["pid"]) for s in j.steps()), "workers left behind"


# -- bad configuration: clear error, no worker ------------------------------------------


def fails_cleanly(tmp_path: Path, flags: list[str], bound: float = 45.0) -> str:
    with job(tmp_path) as j:
        agent = j.start_agent("a", flags)
        code = agent.wait(bound)  # bounded: fails the test if it does not exit
        out = agent.output()
        assert code != 0, out[-3000:]
        assert j.steps() == [], "a worker was started"
        assert not agent_traceback(out), out[-3000:]
        return out


def test_wrong_password(tmp_path: Path, etcd_with_auth: EtcdCluster) -> None:
    flags = etcd_flags(etcd_with_auth.endpoints, run_id(), conf="user=root,password=wrong")
    out = fails_cleanly(tmp_path, flags)
    assert "user name or password" in out or "authentication" in out.lower(), out[-3000:]


def test_missing_credentials(tmp_path: Path, etcd_with_auth: EtcdCluster) -> None:
    out = fails_cleanly(tmp_path, etcd_flags(etcd_with_auth.endpoints, run_id()))
    assert "authentication" in out.lower(), out[-3000:]


def test_correct_password_runs(tmp_path: Path, etcd_with_auth: EtcdCluster) -> None:
    flags = etcd_flags(etcd_with_auth.endpoints, run_id(), nnodes="1", conf="user=root,password=pw")
    with job(tmp_path) as j:
        a = j.start_agent("a", flags)
        wait_for(lambda: len(j.steps()) >= 3, BOUND, "training with user/password")
        check_finished(j, tmp_path, a)


def test_missing_tls_file(tmp_path: Path, etcd1: EtcdCluster) -> None:
    flags = etcd_flags(etcd1.endpoints, run_id(), conf="cacert=/nonexistent/ca.pem")
    out = fails_cleanly(tmp_path, flags, bound=30.0)
    assert "/nonexistent/ca.pem" in out, out[-3000:]


def test_unreachable_endpoint(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    flags = etcd_flags(endpoint, run_id(), conf="join_timeout=8")
    out = fails_cleanly(tmp_path, flags, bound=45.0)
    assert endpoint in out and "etcd" in out, out[-3000:]
    assert "refused" in out or "unavailable" in out.lower(), out[-3000:]
