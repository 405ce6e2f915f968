"""Which worker is its node's real local rank 0 (standard library only).

With ``--virtual-local-rank`` every worker sees ``LOCAL_RANK=0`` (each is
local rank 0 of its own device), so ``LOCAL_RANK`` no longer says which one
of a node's workers does the node's one-per-node work: listing the node's
memory-checkpoint replicas, writing node-local files. The agent then flags
the real local rank 0 in :data:`ENV` (``1`` on it, ``0`` on the others;
agent/env.py); without it, ``LOCAL_RANK`` says.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ENV", "is_local_main"]

ENV = "ELASTRUN_LOCAL_MAIN"


def is_local_main(env: Mapping[str, str]) -> bool:
    """Whether the worker of environment ``env`` is its node's real local rank 0."""
    flag = env.get(ENV)
    if flag is not None:
        return flag.strip() == "1"
    return env.get("LOCAL_RANK", "0").strip() in ("0", "")
