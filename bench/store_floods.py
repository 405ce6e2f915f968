"""The embedded store's memory under two floods by clients that said hello.

``python -m bench.store_floods [--connections 1000] [--watchers 300] [--out FILE]``

Each flood runs against a fresh ``elastrun store serve --port 0`` process
(no token: any client that reaches the port says hello; default limits),
with the abusers as raw sockets of this process bound to 127.0.0.2, while a
legitimate client (TcpStore, from 127.0.0.1) does puts, gets and a watch, one
round after the other, each put read back and seen by the watch in order:

1. **Half-sent frames.** ``--connections`` connections say hello, announce a
   4 MiB frame and send all of it but its last byte, as fast as the store
   takes it (at most 60 s).
2. **Watchers that never read.** ``--watchers`` connections watch every key
   and never read a byte; then a client puts a 1.5 MiB value 30 times
   (``--puts``).

Reported: the store process's peak resident memory (VmHWM) before and
after, the abusers' connections it closed (seen from their sockets), what it
says it did when it stops (connections closed for each budget, watches
cancelled as slow, the most it held of each), and the legitimate client's
rounds and slowest round (any failure of it is reported, not raised).
Bounded: about a minute in all on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.store.abuse import (
    MiB,
    closed_by_server,
    half_frames_after_hello,
    never_reading_watchers,
    served_while,
    sockets,
    vm_kib,
)
from tests.store.conftest import start_server_process, stop_process

from elastrun.store.client import TcpStore

TARGET_MB = 300


def _mb(kib: int) -> float:
    return kib / 1024


async def _legit(
    host: str, port: int, flooding: threading.Event, extra: Callable[[TcpStore], Any] | None
) -> dict[str, Any]:
    """The legitimate client's rounds while ``flooding`` is set (and
    ``extra``, run beside them with a client of its own)."""
    out: dict[str, Any] = {"served": False}
    try:
        store = await TcpStore.connect(host, port, timeout=10)
        try:
            side = None
            if extra is not None:
                writer = await TcpStore.connect(host, port, timeout=10)
                side = asyncio.ensure_future(extra(writer))
            rounds, worst = await served_while(store, flooding, "/legit/")
            if side is not None:
                out.update(await side)
                await writer.close()
            out.update(served=True, rounds=rounds, worst_round_s=round(worst, 3))
        finally:
            await store.close()
    except Exception as exc:  # a failure of the legitimate client is the result
        out["error"] = repr(exc)
    return out


def _run(
    name: str,
    flood: Callable[[str, int, list[socket.socket]], dict[str, Any]],
    extra: Callable[[TcpStore], Any] | None = None,
) -> dict[str, Any]:
    server = start_server_process()
    pid = server.proc.pid
    result: dict[str, Any] = {"scenario": name}
    try:
        time.sleep(0.5)
        result["vmhwm_before_mb"] = round(_mb(vm_kib(pid, "VmHWM")), 1)
        flooding = threading.Event()
        flooding.set()
        with sockets() as held:
            found: dict[str, Any] = {}

            def attack() -> None:
                try:
                    found.update(flood(server.host, server.port, held))
                finally:
                    flooding.clear()

            t0 = time.monotonic()
            attacker = threading.Thread(target=attack, daemon=True)
            attacker.start()
            legit = asyncio.run(_legit(server.host, server.port, flooding, extra))
            attacker.join(120)
            result["flood_s"] = round(time.monotonic() - t0, 1)
            time.sleep(1.0)
            result["vmhwm_after_mb"] = round(_mb(vm_kib(pid, "VmHWM")), 1)
            result["vmrss_end_mb"] = round(_mb(vm_kib(pid, "VmRSS")), 1)
            result.update(found)
            result["legitimate_client"] = legit
            result.update(_closed(held))
            result["store_alive"] = server.alive()
            result.update(_stop(server))
    finally:
        stop_process(server.proc)
    return result


def half_frames(connections: int) -> Callable[[str, int, list[socket.socket]], dict[str, Any]]:
    def flood(host: str, port: int, held: list[socket.socket]) -> dict[str, Any]:
        sent = half_frames_after_hello(host, port, connections, held, within=60.0)
        return {"connections": len(held), "sent_mib": round(sent / MiB)}

    return flood


def watchers(count: int) -> Callable[[str, int, list[socket.socket]], dict[str, Any]]:
    def flood(host: str, port: int, held: list[socket.socket]) -> dict[str, Any]:
        never_reading_watchers(host, port, None, count, held, start_revision=None)
        ready.set()
        done.wait(120)
        time.sleep(3.0)  # the store checks slow watches once a second
        return {"watchers": len(held)}

    return flood


ready = threading.Event()
done = threading.Event()


def puts(times: int, size: int) -> Callable[[TcpStore], Any]:
    async def write(store: TcpStore) -> dict[str, Any]:
        value = os.urandom(size)
        while not ready.is_set():
            await asyncio.sleep(0.05)
        accepted = 0
        for _ in range(times):
            await store.put("/flood/big", value)
            accepted += 1
        done.set()
        return {"puts": accepted, "put_mib": round(size / MiB, 2)}

    return write


def _closed(held: list[socket.socket]) -> dict[str, Any]:
    return {"closed_by_store": sum(closed_by_server(s) for s in held)}


_STOPPED = re.compile(
    r"refused (\d+) connection\(s\); closed (\d+) for max_partial_bytes and (\d+) for "
    r"max_output_bytes; cancelled (\d+) slow watch\(es\); held at most ([0-9.]+) MiB of "
    r"incomplete frames and ([0-9.]+) MiB of unread output"
)


def _stop(server: Any) -> dict[str, Any]:
    """SIGTERM the store; what it says it did when it stops."""
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        _, err = server.proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        return {"store_stop": "did not stop within 20 s"}
    found = _STOPPED.search(err or "")
    if found is None:
        return {"store_says": "nothing closed or cancelled"}
    names = ("refused", "closed_partial", "closed_output", "slow_watches")
    out: dict[str, Any] = {n: int(v) for n, v in zip(names, found.groups()[:4], strict=True)}
    out["partial_peak_mib"] = float(found.group(5))
    out["output_peak_mib"] = float(found.group(6))
    return {"store_says": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store_floods", description=__doc__)
    p.add_argument("--connections", type=int, default=1000, help="half-sent frames (1000)")
    p.add_argument("--watchers", type=int, default=300, help="watchers that never read (300)")
    p.add_argument("--puts", type=int, default=30, help="1.5 MiB puts they are sent (30)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    results = [
        _run(
            f"{args.connections} half-sent 4 MiB frames after hello", half_frames(args.connections)
        ),
        _run(
            f"{args.watchers} watchers that never read, {args.puts} puts of 1.5 MiB",
            watchers(args.watchers),
            puts(args.puts, 1536 * 1024),
        ),
    ]
    print("| scenario | store VmHWM before -> after | target | legitimate client | the abusers |")
    print("|---|---|---|---|---|")
    for r in results:
        legit = r["legitimate_client"]
        served = (
            f"{legit['rounds']} rounds, slowest {legit['worst_round_s'] * 1000:.0f} ms"
            if legit["served"]
            else f"FAILED: {legit.get('error')}"
        )
        abusers = {k: v for k, v in r.items() if k not in ("scenario", "legitimate_client")}
        ok = "met" if r["vmhwm_after_mb"] < TARGET_MB else "MISSED"
        print(
            f"| {r['scenario']} | {r['vmhwm_before_mb']:.0f} -> {r['vmhwm_after_mb']:.0f} MB "
            f"| < {TARGET_MB} MB: {ok} | {served} | {json.dumps(abusers)} |"
        )
    print(f"wall time {time.monotonic() - t0:.0f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["vmhwm_after_mb"] < TARGET_MB for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
