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
from elastrun.store.limits import DEFAULT_LIMITS, StoreLimits
from elastrun.store.server import DEFAULT_PORT, StoreServer
from elastrun.store.token import TOKEN_ENV, TOKEN_FILE_ENV, no_token_warning, store_token

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
        type=int,
        default=DEFAULT_PORT,
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


def _field(flag: str) -> str:
    return _FIELDS.get(flag, flag[2:].replace("-", "_"))


def _show(value: float, in_bytes: bool) -> str:
    if in_bytes and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        for unit in ("G", "M", "K"):
            if value % _UNITS[unit] == 0:
                return f"{value // _UNITS[unit]}{unit}"
    return f"{value:g}"


def _limits(args: argparse.Namespace) -> StoreLimits:
    """The limits from the flags given (ConfigError naming a bad one)."""
    changes: dict[str, object] = {}
    for flag, _ in _LIMIT_FLAGS:
        field = _field(flag)
        text = getattr(args, flag[2:].replace("-", "_"))
        if text is None:
            continue
        current = getattr(DEFAULT_LIMITS, field)
        match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMG]?)", text.strip(), re.ASCII)
        if match is None or (isinstance(current, int) and "." in match.group(1)):
            kind = "a whole number" if isinstance(current, int) else "a number of seconds"
            raise ConfigError(f"{flag} {text!r}: expected {kind}")
        number = float(match.group(1)) * _UNITS[match.group(2)]
        changes[field] = int(number) if isinstance(current, int) else number
    try:
        return DEFAULT_LIMITS.with_(**changes)
    except ConfigError as exc:
        flag = next((f for f, _ in _LIMIT_FLAGS if _field(f) in str(exc)), "a limit")
        raise ConfigError(f"{flag}: {exc}") from None


def _fail(message: str) -> int:
    print(f"elastrun store: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed the usage and the problem
        return exc.code if isinstance(exc.code, int) else 2
    if not 0 <= args.port <= 65535:
        return _fail(f"--port {args.port} is not in 0-65535")
    try:
        token = store_token(None, args.token_file, flag="--token-file").token
        limits = _limits(args)
    except ConfigError as exc:
        return _fail(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    try:
        return asyncio.run(_serve(args.host, args.port, token, limits))
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
