"""``elastrun store serve``: run the embedded store as its own process.

Prints ``elastrun store listening on HOST:PORT`` once bound (port 0 picks a
free port), serves until SIGTERM or SIGINT, then exits 0. Misbehaving clients
are reported on stderr, a few lines per interval at most. The limits an
operator may need to change are flags (defaults: docs/store-protocol.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import signal
import sys
from collections.abc import Sequence

from elastrun.endpoint import Endpoint
from elastrun.errors import ConfigError, ElastrunError
from elastrun.store.factory import DEFAULT_PORT
from elastrun.store.limits import DEFAULT_LIMITS, StoreLimits
from elastrun.store.server import StoreServer
from elastrun.store.token import TOKEN_ENV, TOKEN_FILE_ENV, no_token_warning, store_token
from elastrun.untrusted import ascii_decimal, ascii_int, printable

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastrun store", description="The embedded elastrun coordination store."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the store until SIGTERM/SIGINT")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        default=str(DEFAULT_PORT),
        help=f"port to listen on; 0 picks a free one (default {DEFAULT_PORT})",
    )
    serve.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding the token clients must present (recommended off loopback; "
        f"default: ${TOKEN_ENV}, or the file ${TOKEN_FILE_ENV} names)",
    )
    for flag, what in _LIMIT_FLAGS:
        shown = _show(getattr(DEFAULT_LIMITS, _field(flag)), flag.endswith("-bytes"))
        serve.add_argument(flag, metavar="N", help=f"{what} (default {shown})")
    return parser


# The limits an operator may need to change (flag, what it bounds).
_LIMIT_FLAGS = [
    ("--max-connections", "connections in all"),
    ("--max-connections-per-peer", "connections from one IP address"),
    ("--max-pending-hello", "connections still without a hello, in all"),
    ("--hello-timeout", "seconds a new connection has for its hello"),
    ("--history-bytes", "watch history kept, in bytes (K, M, G suffixes)"),
    ("--max-data-bytes", "keys and values held, in bytes"),
    ("--max-value-bytes", "one value, in bytes (at most 1536K)"),
    ("--stall-timeout", "seconds a client may leave its output unread"),
    ("--max-partial-bytes", "bytes in incomplete frames, all connections together"),
    ("--max-output-bytes", "bytes queued unread for clients, all connections together"),
    ("--slow-watch-bytes", "bytes a watch may hold back before it is cancelled"),
]
_FIELDS = {"--max-value-bytes": "max_value"}
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
# The largest value of each kind of limit flag: far above any machine's need,
# and small enough that no sum or timer overflows.
MAX_COUNT = 1_000_000
MAX_BYTES = 1 << 40  # 1 TiB
MAX_SECONDS = 86_400.0  # a day


def _field(flag: str) -> str:
    return _FIELDS.get(flag, flag[2:].replace("-", "_"))


def _show(value: float, in_bytes: bool) -> str:
    if in_bytes and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        for unit in ("G", "M", "K"):
            if value % _UNITS[unit] == 0:
                return f"{value // _UNITS[unit]}{unit}"
    return str(value) if isinstance(value, int) else f"{value:g}"


def _limits(args: argparse.Namespace) -> StoreLimits:
    """The limits from the flags given (ConfigError naming a bad one)."""
    changes: dict[str, object] = {}
    for flag, _ in _LIMIT_FLAGS:
        field = _field(flag)
        text = getattr(args, flag[2:].replace("-", "_"))
        if text is None:
            continue
        changes[field] = _limit(flag, text, isinstance(getattr(DEFAULT_LIMITS, field), int))
    try:
        return DEFAULT_LIMITS.with_(**changes)
    except ConfigError as exc:
        flag = next(
            (f for f, _ in _LIMIT_FLAGS if re.search(rf"\b{_field(f)}\b", str(exc))), "a limit"
        )
        raise ConfigError(f"{flag}: {exc}") from None


def _limit(flag: str, text: str, whole: bool) -> int | float:
    """One limit flag's value: ASCII, with a K/M/G suffix for bytes, in its range."""
    in_bytes = flag.endswith("-bytes")
    raw = text.strip()
    unit = raw[-1:] if in_bytes and raw[-1:] in ("K", "M", "G") else ""
    number = (ascii_int if whole else ascii_decimal)(raw[: len(raw) - len(unit)])
    top = MAX_BYTES if in_bytes else MAX_COUNT if whole else MAX_SECONDS
    if number is None or number <= 0 or number * _UNITS[unit] > top:
        kind = "a whole number" if whole else "a number of seconds"
        raise ConfigError(
            f"{flag}: expected {kind} (ASCII digits) > 0 and <= {_show(top, in_bytes)}, "
            f"got {printable(repr(text[:64]))}"
        )
    return number * _UNITS[unit]


def _where(host: str, port_text: str) -> tuple[str, int]:
    """``--host`` (an address or name, ASCII; not empty) and ``--port`` (0..65535)."""
    port = ascii_int(port_text)
    if port is None or not 0 <= port <= 65535:
        raise ConfigError(
            f"--port: expected 0..65535 (ASCII digits), got {printable(repr(port_text[:64]))}"
        )
    if not host.strip():
        raise ConfigError("--host: must not be empty (0.0.0.0 or :: listens on every interface)")
    Endpoint.parse(f"[{host}]" if ":" in host else host, port, "--host")
    return host.strip(), port


def _fail(message: str) -> int:
    print(f"elastrun store: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed the usage and the problem
        return exc.code if isinstance(exc.code, int) else 2
    try:
        host, port = _where(args.host, args.port)
        token = store_token(None, args.token_file, flag="--token-file").token
        limits = _limits(args)
    except ConfigError as exc:
        return _fail(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    try:
        return asyncio.run(_serve(host, port, token, limits))
    except ElastrunError as exc:
        print(f"elastrun store: error: {exc}", file=sys.stderr, flush=True)
        return 1


async def _serve(host: str, port: int, token: str | None, limits: StoreLimits) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = StoreServer(host, port, token=token, limits=limits)
    bound_host, bound_port = await server.start()
    print(f"elastrun store listening on {Endpoint(bound_host, bound_port)}", flush=True)
    if token is None and not server.loopback_only():
        warning = no_token_warning(f"--token-file PATH or {TOKEN_ENV}")
        print(f"elastrun store: warning: {warning}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return 0
