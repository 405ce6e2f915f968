"""``elastrun store serve``: run the embedded store as its own process.

Prints ``elastrun store listening on HOST:PORT`` once bound (port 0 picks a
free port), serves until SIGTERM or SIGINT, then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from elastrun.errors import ElastrunError
from elastrun.store.server import DEFAULT_PORT, StoreServer

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
        type=Path,
        help="file holding the token clients must present (recommended off loopback)",
    )
    return parser


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
    token: str | None = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            return _fail(f"cannot read --token-file {args.token_file}: {exc}")
        if not token:
            return _fail(f"--token-file {args.token_file} is empty")
    try:
        return asyncio.run(_serve(args.host, args.port, token))
    except ElastrunError as exc:
        print(f"elastrun store: error: {exc}", file=sys.stderr, flush=True)
        return 1


async def _serve(host: str, port: int, token: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = StoreServer(host, port, token=token)
    bound_host, bound_port = await server.start()
    shown = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
    print(f"elastrun store listening on {shown}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return 0
