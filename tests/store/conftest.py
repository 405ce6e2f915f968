"""Store fixtures: one conformance suite, every backend.

``make_store`` is parametrized over :data:`BACKENDS`. A test gets a
:class:`StoreHarness` and runs an async body with it::

    def test_something(make_store: StoreHarness) -> None:
        async def body(new_client: ClientFactory) -> None:
            a = await new_client()          # connected clients of ONE shared store
            b = await new_client()
            await a.put(make_store.prefix + "k", b"v")
            ...
        make_store.run(body)

The harness runs the body in a fresh event loop, bounded by a timeout, and
closes every client it made. Backends may share one server across tests, so
tests keep to their own keys under ``make_store.prefix`` and assert revisions
relative to ones they observed.

Adding a backend (e.g. etcd): write an async context manager factory
``def etcd_backend(request: pytest.FixtureRequest) -> AsyncContextManager[ClientFactory]``
that yields an async ``new_client()`` (use ``request.getfixturevalue(...)`` for a
session-scoped server and ``pytest.skip`` when it is not installed), and add
``"etcd": etcd_backend`` to :data:`BACKENDS`. Nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import selectors
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import pytest

from elastrun.store.base import Store
from elastrun.store.client import TcpStore
from elastrun.store.engine import Engine
from elastrun.store.memory import MemoryStore
from tests.conftest import PYTHON, REPO
from tests.store.etcd_fixture import etcd_backend, etcd_session  # noqa: F401 (fixture)

ClientFactory = Callable[[], Awaitable[Store]]
BackendFactory = Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[ClientFactory]]


# -- a real `elastrun store serve` process ------------------------------------
@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    host: str
    port: int

    def alive(self) -> bool:
        return self.proc.poll() is None


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line of ``proc``'s stdout, waiting at most ``timeout`` seconds."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no output from pid {proc.pid} within {timeout} s")
    return proc.stdout.readline()


def stop_process(proc: subprocess.Popen[str], grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def start_server_process(*extra: str, host: str = "127.0.0.1") -> ServerProcess:
    proc = subprocess.Popen(
        [PYTHON, "-m", "elastrun", "store", "serve", "--host", host, "--port", "0", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = read_line(proc, 30.0)
        match = re.fullmatch(r"elastrun store listening on \[?([^\]]+)\]?:(\d+)\n", line)
        assert match, f"unexpected first line from elastrun store serve: {line!r}"
        return ServerProcess(proc, match.group(1), int(match.group(2)))
    except BaseException:
        stop_process(proc)
        raise


@pytest.fixture(scope="session")
def store_server() -> Iterator[ServerProcess]:
    """One ``elastrun store serve --port 0`` for the whole session."""
    server = start_server_process()
    yield server
    stop_process(server.proc)
    assert server.proc.returncode == 0, "elastrun store serve did not exit 0 on SIGTERM"


# -- backends -------------------------------------------------------------------
@contextlib.asynccontextmanager
async def memory_backend(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    engine = Engine()  # one shared store; each client is a front-end on it

    async def new_client() -> Store:
        return MemoryStore(engine=engine)

    yield new_client


@contextlib.asynccontextmanager
async def tcp_backend(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    server: ServerProcess = request.getfixturevalue("store_server")

    async def new_client() -> Store:
        return await TcpStore.connect(server.host, server.port, timeout=10.0)

    yield new_client


BACKENDS: dict[str, BackendFactory] = {
    "memory": memory_backend,
    "tcp": tcp_backend,
    "etcd": etcd_backend,
}

_counter = itertools.count()


@dataclass
class StoreHarness:
    backend: str
    prefix: str
    _factory: BackendFactory
    _request: pytest.FixtureRequest

    def run(self, body: Callable[[ClientFactory], Awaitable[None]], timeout: float = 60.0) -> None:
        async def main() -> None:
            clients: list[Store] = []
            async with self._factory(self._request) as new_client:

                async def make() -> Store:
                    client = await new_client()
                    clients.append(client)
                    return client

                try:
                    async with asyncio.timeout(timeout):
                        await body(make)
                finally:
                    for client in clients:
                        await client.close()

        asyncio.run(main())


@pytest.fixture(params=sorted(BACKENDS))
def make_store(request: pytest.FixtureRequest) -> StoreHarness:
    name: str = request.param
    prefix = f"/test/{os.getpid()}/{next(_counter)}/{request.node.name}/"
    return StoreHarness(name, prefix, BACKENDS[name], request)
