"""The embedded store's resource limits, with their defaults.

Every resource a client can make the store hold is bounded here; the table in
docs/store-protocol.md lists the same limits. The defaults leave a job of
thousands of nodes far from every bound (a round's result is stored in shards
of about 64 members, about 7 KB each; each agent holds one connection) while keeping what a
stranger can make the store hold small: before its hello a connection may
send at most :data:`PRE_HELLO_FRAME` bytes, and only a bounded number of
connections may be waiting for their hello.

``elastrun store serve`` exposes the ones an operator may need to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from elastrun.errors import ConfigError, LimitExceeded
from elastrun.frozen import frozen
from elastrun.store.base import Get, KeyValue, Op, Put

__all__ = [
    "DEFAULT_LIMITS",
    "KEY_OVERHEAD",
    "MAX_FRAME",
    "MAX_KEY",
    "MAX_TOKEN",
    "MAX_VALUE",
    "PRE_HELLO_FRAME",
    "StoreLimits",
    "check_answer",
    "check_puts",
    "encoded_size",
]

KiB = 1024
MiB = 1024 * KiB

# One frame (4-byte length + JSON) on the wire, either way.
MAX_FRAME = 4 * MiB
# The only frame allowed before the hello is the hello: a few fields and the token.
PRE_HELLO_FRAME = 4 * KiB
# A token longer than this cannot fit a hello (checked where tokens are set).
MAX_TOKEN = 1024
# A value's bytes (as etcd's default request limit): base64 in a frame, with
# its key, always fits MAX_FRAME, so every watch event fits one frame.
MAX_VALUE = 1536 * KiB
# A key's UTF-8 bytes.
MAX_KEY = 4 * KiB
# Bytes counted per live key on top of its key and value (against
# max_data_bytes): a rough share of the Python objects that hold it.
KEY_OVERHEAD = 200


@frozen
class StoreLimits:
    """The embedded store's limits (engine and server). All sizes in bytes,
    times in seconds."""

    # -- connections (server) --
    max_connections: int = 8192  # in all (bounded further by the open-file limit)
    max_connections_per_peer: int = 2048  # from one IP address
    # Connections that have not finished their hello: at most this many (and
    # per peer address); a new one beyond it evicts the oldest such one.
    max_pending_hello: int = 256
    max_pending_hello_per_peer: int = 64
    hello_timeout: float = 10.0  # connect -> a complete, accepted hello
    frame_timeout: float = 60.0  # a frame begun must be complete within this
    # Bytes received and not yet a whole frame (or not yet handled), all
    # connections together: past it, the connection whose incomplete frame
    # began first is closed. A frame larger than this cannot be received.
    max_partial_bytes: int = 64 * MiB
    # -- output (server, per connection) --
    # Above this many queued bytes the connection's requests wait (not read)
    # and its watches fall back to catching up from history as it drains.
    output_high_water: int = 1 * MiB
    # Never more than this queued (a safety net; the above keeps well under it).
    max_output_buffer: int = 16 * MiB
    # A connection whose queued output does not drain below the low-water mark
    # (a quarter of the high one) for this long is closed (a peer not reading).
    stall_timeout: float = 60.0
    # The kernel's send buffer of each connection (SO_SNDBUF; Linux doubles
    # it): what a client that does not read makes the kernel hold for it,
    # besides what the server queues (instead of up to 4 MiB, tcp_wmem's max).
    socket_send_buffer: int = 128 * KiB
    # -- output (server, all connections together) --
    # Bytes queued for clients and not yet read by them: a write past it first
    # closes the connections whose output has waited longest unread.
    max_output_bytes: int = 64 * MiB
    # A watch is cancelled (code "slow") once what it has not been sent, the
    # output queued unread on its connection and the history it still has to
    # catch up on, passes this many bytes.
    slow_watch_bytes: int = 8 * MiB
    # -- data (engine) --
    max_value: int = MAX_VALUE
    max_key: int = MAX_KEY
    # Live keys and values (and a per-key overhead): writes beyond it fail.
    max_data_bytes: int = 256 * MiB
    # Watch history: events of past revisions, for watches that start in the
    # past or resume; older revisions are compacted past these bounds.
    history_bytes: int = 32 * MiB
    history_revisions: int = 100_000
    # -- answers --
    # A range answer is cut into pages of at most this many bytes (the client
    # reads the rest transparently); a txn answer over it is refused unapplied.
    max_response: int = 3 * MiB
    # An in-process watch (the in-memory store) that holds this many bytes of
    # events unread stops receiving live events and catches up from history.
    watch_queue_bytes: int = 4 * MiB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"store limit {f.name} must be a positive number, got {value!r}")
        if self.max_value > MAX_VALUE or self.max_key > MAX_KEY:
            raise ConfigError(
                f"store limits max_value <= {MAX_VALUE} and max_key <= {MAX_KEY} "
                "(a watch event must fit one frame)"
            )
        if self.max_response > MAX_FRAME - 64 * KiB:
            raise ConfigError(f"store limit max_response must be below {MAX_FRAME - 64 * KiB}")

    def with_(self, **changes: object) -> StoreLimits:
        """A copy with some limits changed (validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


DEFAULT_LIMITS = StoreLimits()


def encoded_size(kv: KeyValue) -> int:
    """An upper bound of ``kv``'s size on the wire (JSON, value in base64)."""
    return len(kv.key) * 2 + (len(kv.value) + 2) // 3 * 4 + 120


def check_puts(
    limits: StoreLimits, puts: Sequence[Put], current: Mapping[str, KeyValue], data_bytes: int
) -> None:
    """Raise LimitExceeded if one of ``puts`` has a value or key over the
    limits, or together they would grow the data past ``max_data_bytes``."""
    growth = 0
    for op in puts:
        if len(op.value) > limits.max_value:
            raise LimitExceeded(
                f"the value of {op.key[:200]!r} is {len(op.value)} bytes; "
                f"the store's limit is {limits.max_value} bytes (max_value)"
            )
        if len(op.key.encode("utf-8", "surrogatepass")) > limits.max_key:
            raise LimitExceeded(
                f"key {op.key[:200]!r}... is longer than the store's limit of "
                f"{limits.max_key} bytes (max_key)"
            )
        old = current.get(op.key)
        growth += len(op.value) - (len(old.value) if old else -len(op.key) - KEY_OVERHEAD)
    if growth > 0 and data_bytes + growth > limits.max_data_bytes:
        raise LimitExceeded(
            f"the store is full: it holds {data_bytes} bytes of data and {growth} more "
            f"would pass its limit of {limits.max_data_bytes} (max_data_bytes); delete keys first"
        )


def check_answer(
    ops: Sequence[Op],
    puts: Sequence[Put],
    max_answer: int,
    read: Callable[[str, bool], list[KeyValue]],
) -> None:
    """Raise LimitExceeded if the gets of a txn's ``ops`` could answer more
    than ``max_answer`` bytes (what the ranges hold now, plus everything the
    txn itself puts, for each get)."""
    gets = [op for op in ops if isinstance(op, Get)]
    if not gets:
        return
    added = sum(encoded_size(KeyValue(p.key, p.value, 0, 0, 0)) for p in puts)
    total = 0
    for op in gets:
        total += added + sum(encoded_size(kv) for kv in read(op.key, op.prefix))
        if total > max_answer:
            raise LimitExceeded(
                f"the txn's gets could answer more than {max_answer} bytes (max_response); "
                "it was not applied: read large prefixes with a range (paged) instead"
            )
