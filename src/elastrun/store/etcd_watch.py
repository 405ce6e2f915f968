"""A watch of the etcd store: one watch stream over etcd's gRPC-JSON
gateway, re-established on another member from the next undelivered
revision when the one it uses breaks (:mod:`.etcd`; docs/etcd.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

from elastrun.errors import RevisionCompacted, StoreError, StoreUnavailable
from elastrun.store.base import KeyValue, Watch, WatchEvent
from elastrun.store.etcd_conn import (
    Endpoint,
    EtcdConnection,
    Json,
    RetryableError,
    Stream,
    gateway_error,
    int_field,
    translate,
)

__all__ = ["EtcdWatch", "WatchOwner"]


def _reauth(error: StoreError | RetryableError) -> bool:
    return isinstance(error, RetryableError) and error.reauth


class WatchOwner(Protocol):
    """What an :class:`EtcdWatch` asks of its store (:class:`.etcd.EtcdStore`)."""

    conn: EtcdConnection

    def _kv(self, data: Mapping[str, Any]) -> KeyValue: ...

    def _forget(self, watch: EtcdWatch) -> None: ...


class EtcdWatch(Watch):
    """One etcd watch stream, re-established on another member (from the
    next undelivered revision) when the one it uses breaks."""

    def __init__(self, store: WatchOwner, key_range: Json, start_revision: int | None) -> None:
        self._store = store
        self._conn = store.conn
        self._range = key_range
        self._next_rev = start_revision if start_revision and start_revision > 0 else None
        self._queue: asyncio.Queue[WatchEvent | StoreError | None] = asyncio.Queue()
        self._stream: Stream | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        self._stream = await self._open()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _open(self) -> Stream:
        create: Json = {**self._range, "progress_notify": True}
        if self._next_rev is not None:
            create["start_revision"] = str(self._next_rev)
        stream, first = await self._conn.stream(
            "watch", {"create_request": create}, self._conn.deadline(), self._check_created
        )
        if self._next_rev is None:
            header = first.get("result", {}).get("header", {})
            self._next_rev = int_field(header, "revision") + 1
        return stream

    async def _check_created(self, message: Json, endpoint: Endpoint) -> None:
        self._raise_if_broken(message, endpoint)
        if not message.get("result", {}).get("created"):
            raise RetryableError(f"watch not created: {message}")

    def _raise_if_broken(self, message: Json, endpoint: Endpoint) -> None:
        """Raise for an error or a cancelled watch (RetryableError: resume elsewhere)."""
        if "error" in message:
            code, text = gateway_error(message, 200)
            raise translate(code, text, str(endpoint))
        result = message.get("result", {})
        if not result.get("canceled"):
            return
        compact_revision = int_field(result, "compact_revision")
        if compact_revision:
            raise RevisionCompacted(
                f"etcd at {endpoint}: watch history from revision {self._next_rev} is compacted "
                f"(oldest kept: {compact_revision})",
                compact_revision,
            )
        reason = str(result.get("cancel_reason", "cancelled by the server"))
        error = translate(0, reason, str(endpoint))
        if isinstance(error, StoreError) and not isinstance(error, RevisionCompacted):
            raise error
        raise RetryableError(f"watch cancelled: {reason}", reauth=_reauth(error))

    async def _run(self) -> None:
        stream = self._stream
        try:
            while stream is not None:
                try:
                    message = await stream.next()
                    if message is None:
                        raise StoreUnavailable(f"etcd at {stream.endpoint} ended the watch stream")
                    self._raise_if_broken(message, stream.endpoint)
                    self._deliver(message.get("result", {}))
                except (StoreUnavailable, RetryableError) as exc:
                    await stream.aclose()
                    self._stream = stream = None
                    if self._closed:
                        return
                    if isinstance(exc, RetryableError) and exc.reauth:
                        await self._conn.authenticate(force=True)
                    self._stream = stream = await self._open()
        except StoreError as exc:
            self._queue.put_nowait(exc)
        finally:
            if stream is not None and self._closed:
                await stream.aclose()

    def _deliver(self, result: Mapping[str, Any]) -> None:
        events = result.get("events", [])
        for event in events:
            kv = self._store._kv(event.get("kv", {}))
            if event.get("type") == "DELETE":
                self._queue.put_nowait(WatchEvent("delete", kv))
            else:
                self._queue.put_nowait(WatchEvent("put", kv))
            self._next_rev = max(self._next_rev or 0, kv.mod_revision + 1)
        if not events and not result.get("created"):
            # A progress notification: everything up to this revision was sent.
            revision = int_field(result.get("header", {}), "revision")
            if revision:
                self._next_rev = max(self._next_rev or 0, revision + 1)

    async def __anext__(self) -> WatchEvent:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, StoreError):
            self._queue.put_nowait(item)  # keep failing, don't hang
            raise item
        return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._store._forget(self)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None
        self._queue.put_nowait(None)
