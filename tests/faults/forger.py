"""A stranger against a failover job without a token: run
inside a network namespace that reaches the candidates, it knows only the
public candidate list.

Every ``--every`` seconds until ``--seconds`` pass, for each candidate:

* a standby of term ``t`` gets votes for term ``t + 1`` in the names of every
  other candidate (with the list's digest and a random nonce);
* a host, and each standby, gets a store connection whose hello names each
  other candidate, kept open with a request every 0.2 s: bytes that would
  keep a forged host armed, or a cut-off host serving.

It prints what it did, one line each. ``python forger.py LIST SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import sys
import time
from typing import Any

from elastrun.endpoint import Endpoint, parse_endpoint_list
from elastrun.store import codec
from elastrun.store.term import list_digest

EVERY = 0.5


async def first_answer(where: Endpoint, frame: dict[str, Any]) -> dict[str, Any]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(where.host, where.port), 1.0)
    try:
        writer.write(codec.encode_frame({"v": 1, **frame}))
        decoder = codec.FrameDecoder(1 << 16)
        while (reply := decoder.pop()) is None:
            data = await asyncio.wait_for(reader.read(4096), 2.0)
            if not data:
                return {}
            decoder.push(data)
        return reply
    finally:
        writer.close()


async def keep_talking(where: Endpoint, term: int, candidate: int) -> None:
    """A hello in ``candidate``'s name, then a request every 0.2 s."""
    with contextlib.suppress(OSError, TimeoutError):
        await _talk(where, term, candidate)


async def _talk(where: Endpoint, term: int, candidate: int) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(where.host, where.port), 1.0)
    try:
        hello = {"v": 1, "t": "hello", "token": None, "term": term, "candidate": candidate,
                 "nonce": secrets.token_hex(16)}  # fmt: skip
        writer.write(codec.encode_frame(hello))
        for number in itertools.count(1):
            writer.write(codec.encode_frame({"v": 1, "t": "req", "id": number, "op": "ping"}))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                if not await asyncio.wait_for(reader.read(1 << 16), 0.2):
                    return
            await asyncio.sleep(0.2)
    finally:
        writer.close()


async def main(endpoints: tuple[Endpoint, ...], seconds: float) -> None:
    digest = list_digest(",".join(str(e) for e in endpoints))
    talking: dict[tuple[int, int], asyncio.Task[None]] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for index, where in enumerate(endpoints):
            try:
                seen = await first_answer(where, {"t": "hello", "token": None, "term": 0})
            except (OSError, TimeoutError, ValueError):
                continue
            term = seen.get("term")
            if type(term) is not int:
                continue
            role = seen.get("role")
            others = [i for i in range(len(endpoints)) if i != index]
            if role == "standby":
                for voter in others:
                    vote = {"t": "vote", "token": None, "term": term + 1, "voter": voter,
                            "list": digest, "nonce": secrets.token_hex(16)}  # fmt: skip
                    with contextlib.suppress(OSError, TimeoutError, ValueError):
                        answer = await first_answer(where, vote)
                        print(f"forger: vote term {term + 1} as {voter} to {where}: {answer}")
            for voter in others:
                task = talking.get((index, voter))
                if task is None or task.done():
                    talking[(index, voter)] = asyncio.ensure_future(
                        keep_talking(where, term + (role == "standby"), voter)
                    )
        await asyncio.sleep(EVERY)
    for task in talking.values():
        task.cancel()
    sys.stdout.flush()


if __name__ == "__main__":
    eps, _ = parse_endpoint_list(sys.argv[1], 0, "candidates")
    asyncio.run(main(eps, float(sys.argv[2])))
