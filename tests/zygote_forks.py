"""Workers forked from a warm pool the way the agent forks them, for the tests
of the pool (tests/unit/test_warm_needed.py, tests/integration/test_zygote.py)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from elastrun.agent.warm_pool import WarmPool
from elastrun.worker._messages import Go, encode_line

GO = encode_line(Go())  # what the agent sends a forked worker it registered


async def fork_many(pool: WarmPool, envs: dict[int, dict[str, str]], **kw: Any) -> dict[int, str]:
    """Fork one worker per entry of ``envs`` (``kw``: to ``WarmPool.fork``);
    each one's output (they must all be forked)."""
    pairs = {lr: socket.socketpair() for lr in envs}
    try:
        forked = await pool.fork(
            envs, {lr: theirs.fileno() for lr, (_, theirs) in pairs.items()}, **kw
        )
    finally:
        for _, theirs in pairs.values():
            theirs.close()
    assert set(forked) == set(envs)
    loop = asyncio.get_running_loop()
    out = {}
    for lr, proc in forked.items():
        pairs[lr][0].send(GO)
        assert proc.stdout is not None
        out[lr] = (await loop.run_in_executor(None, proc.stdout.read)).decode()
        assert await loop.run_in_executor(None, proc.wait, 60) == 0
        pairs[lr][0].close()
    return out
