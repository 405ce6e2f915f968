"""The embedded store's client against a program that is no elastrun store
listening on its port: one that says nothing, one that closes every
connection. After a few unanswered hellos the client says that it is not a
store (ProtocolError, not retried), instead of retrying until its deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from elastrun.endpoint import Endpoint
from elastrun.errors import ProtocolError
from elastrun.store import client_conn
from elastrun.store.factory import Backend, StoreOptions, open_store


@contextlib.asynccontextmanager
async def listener(silent: bool) -> AsyncIterator[int]:
    held: list[asyncio.StreamWriter] = []

    async def on_conn(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if silent:
            held.append(writer)  # accepted, never answered
        else:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("silent", [True, False], ids=["silent", "closes"])
def test_a_listener_that_does_not_answer_the_hello_is_not_a_store(
    silent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_conn, "HELLO_TIMEOUT", 0.3)

    async def run() -> str:
        async with listener(silent) as port:
            with pytest.raises(ProtocolError) as caught:
                # a deadline far beyond the few tries it takes (the test's bound)
                await asyncio.wait_for(
                    open_store(
                        Backend.C10D,
                        (Endpoint("127.0.0.1", port),),
                        StoreOptions(),
                        timeout=600,
                    ),
                    120,
                )
            return str(caught.value)

    said = asyncio.run(run())
    assert "not an elastrun store" in said and "held by another program" in said, said
    assert ("did not answer the hello within 0.3 s" in said) == silent, said
