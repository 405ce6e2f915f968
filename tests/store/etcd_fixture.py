"""Real etcd servers for tests: one member or a 3-member cluster on 127.0.0.1.

Each member gets free loopback ports (client and peer), a temporary data dir
and its own log file; it is stopped by pid (SIGTERM, then SIGKILL). Tests that
need etcd are skipped with a clear reason when the ``etcd`` binary is missing
(``make etcd`` or ``scripts/ensure-etcd.sh`` installs it).

Use :func:`start_cluster` directly, or the session-scoped ``etcd_session``
fixture (one member; give each store its own ``key_prefix``); ``etcd_with_auth``
is a member of its own with auth on (:func:`enable_auth`).
:func:`etcd_backend` plugs etcd into the store conformance suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastrun.store.base import Store
from elastrun.store.etcd_options import EtcdOptions
from tests.helpers import free_ports

ClientFactory = Callable[[], Awaitable[Store]]

ETCD = shutil.which("etcd")
SKIP_REASON = "needs the etcd server binary (Debian's etcd-server; run `make etcd`)"
requires_etcd = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)

START_TIMEOUT = 30.0


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and certificates (for 127.0.0.1) made with the openssl CLI."""

    cacert: str
    cert: str  # server and client certificate (both usages)
    key: str

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.cacert)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def make_tls_files(directory: Path) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = directory
    ext = d / "ext.cnf"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\n"
    )
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=elastrun-test-ca", "-keyout", "ca.key", "-out", "ca.pem"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", "node.key", "-out", "node.csr"],
        ["x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "node.pem"],
    ]  # fmt: skip
    for args in steps:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)
    return TlsFiles(str(d / "ca.pem"), str(d / "node.pem"), str(d / "node.key"))


class EtcdMember:
    def __init__(
        self, name: str, client_port: int, peer_port: int, base: Path, tls: TlsFiles | None = None
    ) -> None:
        self.tls = tls
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = base / f"{name}.data"
        self.log_path = base / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster: str, token: str) -> None:
        assert ETCD is not None, SKIP_REASON
        args = [
            ETCD,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            # Quick elections keep failover tests short.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]  # fmt: skip
        if self.tls is not None:
            args += [
                "--cert-file", self.tls.cert,
                "--key-file", self.tls.key,
                "--trusted-ca-file", self.tls.cacert,
                "--client-cert-auth",
            ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            ctx = self.tls.context() if self.tls else None
            url = f"{self.client_url}/health"
            with urllib.request.urlopen(url, timeout=1.0, context=ctx) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class EtcdCluster:
    def __init__(self, members: list[EtcdMember], base: Path) -> None:
        self.members = members
        self.base = base
        self.tls = members[0].tls

    @property
    def endpoints(self) -> str:
        """``host:port,host:port,...`` of every member."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def url(self) -> str:
        return self.members[0].client_url

    def member_at(self, endpoint: str) -> EtcdMember:
        return next(m for m in self.members if m.endpoint == endpoint)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [m for m in self.members if not m.alive()]
            if dead:
                raise RuntimeError(f"etcd {dead[0].name} exited:\n{dead[0].log_tail()}")
            if all(m.healthy() for m in self.members):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"etcd did not become healthy in {timeout} s:\n{self.members[0].log_tail()}"
        )

    def stop(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                m.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def _tmp_base() -> Path:
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="elastrun-etcd-", dir=parent))


def start_cluster(size: int = 1, *, tls: bool = False) -> EtcdCluster:
    """Start ``size`` members on free loopback ports and wait until healthy
    (``tls``: clients must use HTTPS with a client certificate, see
    ``cluster.tls``)."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    base = _tmp_base()
    files = make_tls_files(base) if tls else None
    ports = free_ports(2 * size)
    members = [
        EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], base, files) for i in range(size)
    ]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    token = f"elastrun-test-{secrets.token_hex(4)}"
    cluster = EtcdCluster(members, base)
    try:
        for m in members:
            m.start(initial, token)
        cluster.wait_healthy()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def gateway(url: str, path: str, body: dict[str, object], token: str | None = None) -> object:
    """POST to etcd's JSON gateway (for test setup such as enabling auth)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    req = urllib.request.Request(
        f"{url}/v3/{path}", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="session")
def etcd_session() -> Iterator[EtcdCluster]:
    """One etcd member for the whole test session (no auth, plain HTTP); give
    each store its own ``key_prefix`` (:func:`unique_prefix`)."""
    cluster = start_cluster(1)
    try:
        yield cluster
    finally:
        cluster.stop()


def unique_prefix() -> str:
    return f"t-{secrets.token_hex(4)}/"


@contextlib.asynccontextmanager
async def etcd_backend(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    """The conformance suite's "etcd" backend: clients of one shared key
    prefix on the session's etcd (see tests/store/conftest.py)."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster: EtcdCluster = request.getfixturevalue("etcd_session")
    from elastrun.store.etcd import open_etcd_store

    prefix = unique_prefix()

    async def new_client() -> Store:
        return await open_etcd_store(
            cluster.endpoints, options=EtcdOptions(key_prefix=prefix), timeout=10.0
        )

    yield new_client


def enable_auth(cluster: EtcdCluster, password: str = "pw") -> None:
    """Turn on etcd auth through the gateway: user ``root`` with ``password``."""
    url = cluster.url
    gateway(url, "auth/role/add", {"name": "root"})
    gateway(url, "auth/user/add", {"name": "root", "password": password})
    gateway(url, "auth/user/grant", {"user": "root", "role": "root"})
    gateway(url, "auth/enable", {})


@pytest.fixture(scope="module")
def etcd_with_auth() -> Iterator[EtcdCluster]:
    """A member of its own with auth enabled (:func:`enable_auth`): user
    ``root``, password ``pw``. Skipped without the etcd binary."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = start_cluster(1)
    try:
        enable_auth(cluster)
        yield cluster
    finally:
        cluster.stop()
