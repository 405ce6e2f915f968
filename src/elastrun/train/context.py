"""Who am I? The worker's view of the job, read from the launcher's environment.

elastrun (like torchrun) tells each worker its place in the job through
environment variables. :func:`context` reads them once into a
:class:`WorkerContext`. Run without a launcher (``python train.py``), the
worker is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.untrusted import ascii_int, printable
from elastrun.worker.local_main import is_local_main

__all__ = ["WorkerContext", "context", "env_int"]


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """The integer in the variable ``name`` of ``env`` (unset or empty:
    ``default``), ASCII digits only; else ConfigError naming the variable."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = ascii_int(raw)
    if value is None:
        raise ConfigError(
            f"environment variable {name}={printable(repr(raw[:64]))} is not an integer "
            "(ASCII digits); it is set by the launcher (elastrun/torchrun), do not override it"
        )
    return value


@frozen(slots=True)
class WorkerContext:
    """This worker's place in the job (torchrun-compatible variables).

    ``launched`` is False when no launcher set ``RANK``/``WORLD_SIZE``; then
    the worker is rank 0 of 1 and ``restart_count`` is 0.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    role_rank: int = 0
    role_world_size: int = 1
    role: str = "default"
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "none"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launched: bool = False
    local_main: bool = True  # the node's real local rank 0 (worker/local_main.py)

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the one that should print and log)."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on the node's real local rank 0 (one per node: e.g. the one that
        writes node-local files), also under ``--virtual-local-rank``, where
        every worker's ``local_rank`` is 0."""
        return self.local_rank == 0 and self.local_main

    @property
    def is_restart(self) -> bool:
        """True when the launcher restarted this worker group at least once."""
        return self.restart_count > 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerContext:
        """Read the context from ``env`` (default: ``os.environ``).

        Raises :class:`~elastrun.errors.ConfigError` naming the variable when
        one holds a non-integer or the ranks are out of range.
        """
        e = os.environ if env is None else env
        launched = "RANK" in e and "WORLD_SIZE" in e
        world_size = env_int(e, "WORLD_SIZE", 1)
        rank = env_int(e, "RANK", 0)
        local_world_size = env_int(e, "LOCAL_WORLD_SIZE", world_size if launched else 1)
        local_rank = env_int(e, "LOCAL_RANK", rank if local_world_size == world_size else 0)
        ctx = cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            group_rank=env_int(e, "GROUP_RANK", 0),
            group_world_size=env_int(e, "GROUP_WORLD_SIZE", 1),
            role_rank=env_int(e, "ROLE_RANK", rank),
            role_world_size=env_int(e, "ROLE_WORLD_SIZE", world_size),
            role=e.get("ROLE_NAME", "default") or "default",
            restart_count=env_int(e, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=env_int(e, "TORCHELASTIC_MAX_RESTARTS", 0),
            run_id=e.get("TORCHELASTIC_RUN_ID", "none") or "none",
            master_addr=e.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1",
            master_port=env_int(e, "MASTER_PORT", 29500),
            launched=launched,
            local_main=is_local_main(e),
        )
        if ctx.world_size < 1 or not 0 <= ctx.rank < ctx.world_size:
            raise ConfigError(f"RANK={ctx.rank} is not in [0, WORLD_SIZE={ctx.world_size})")
        if ctx.local_world_size < 1 or not 0 <= ctx.local_rank < ctx.local_world_size:
            raise ConfigError(
                f"LOCAL_RANK={ctx.local_rank} is not in "
                f"[0, LOCAL_WORLD_SIZE={ctx.local_world_size})"
            )
        return ctx


def context() -> WorkerContext:
    """This worker's :class:`WorkerContext`, read from the environment now."""
    return WorkerContext.from_env()
