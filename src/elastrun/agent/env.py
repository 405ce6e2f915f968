"""The environment of each worker (RANK, WORLD_SIZE, MASTER_ADDR, ...), as torchrun sets it.

Precedence, lowest first: the agent's own environment, ``WorkerSpec.env``,
then the variables computed here (they always win: a worker must never see a
stale ``RANK``). ``OMP_NUM_THREADS`` and ``PYTHONUNBUFFERED`` default to ``1``
only when neither the agent's environment nor ``WorkerSpec.env`` set them;
``TORCHINDUCTOR_COMPILE_THREADS`` likewise defaults to the node's usable CPUs
shared among its workers (each restarted worker starts its own
``torch.compile`` pool, which would otherwise take every CPU).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from elastrun.agent.spec import WorkerSpec
from elastrun.errors import WorkerError
from elastrun.rendezvous.api import RoundResult
from elastrun.worker._messages import MAX_ENTER_VARS
from elastrun.worker._restart import STANDBY_ENV
from elastrun.worker.local_main import ENV as LOCAL_MAIN_ENV

__all__ = [
    "ROUND_ENV_VARS",
    "WORKER_ENV_VARS",
    "check_round",
    "compile_threads",
    "rank_vars",
    "stable_env",
    "standby_env",
    "virtual_local_rank",
    "worker_env",
]

# The variables that change from round to round; the rest of a worker's
# environment is the same in every round (stable_env).
ROUND_ENV_VARS = (
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
)

# Every variable the agent computes per worker (for docs and tests).
WORKER_ENV_VARS = (
    "LOCAL_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
    "PYTHON_EXEC",
    "OMP_NUM_THREADS",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "PYTHONUNBUFFERED",
    *ROUND_ENV_VARS,
)


def check_round(spec: WorkerSpec, result: RoundResult) -> None:
    """Refuse a round whose idea of this node disagrees with the spec."""
    if not 0 <= result.group_rank < result.group_world_size:
        raise WorkerError(
            f"rendezvous round {result.round} gave this node group rank {result.group_rank}, "
            f"outside [0, {result.group_world_size})"
        )
    if result.me.nproc != spec.nproc:
        raise WorkerError(
            f"rendezvous round {result.round} says this node runs {result.me.nproc} "
            f"worker{'' if result.me.nproc == 1 else 's'} "
            f"but the worker spec says {spec.nproc} (--nproc-per-node)"
        )


def stable_env(
    spec: WorkerSpec,
    local_rank: int,
    run_id: str,
    max_restarts: int,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The part of a worker's environment that is the same in every round
    (what a warm interpreter starts with, see agent/warm.py)."""
    inherited = os.environ if base is None else base
    env = {k: v for k, v in inherited.items() if k not in spec.hidden_env}
    env.update(spec.env)
    # Both spellings, one value: torch 2.2+ reads TORCH_NCCL_*, 2.0 and 2.1
    # NCCL_*; a user's choice in either spelling is kept for both.
    nccl = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING", "1"))
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            # False: with env://, rank 0 hosts torch's TCPStore on
            # MASTER_ADDR:MASTER_PORT and the others connect. "True" would tell
            # every rank to connect to a TCPStore the agent serves there, as
            # torchrun's c10d agent does; ours serves no TCPStore, so
            # init_process_group() would wait for one that never comes.
            "TORCHELASTIC_USE_AGENT_STORE": str(False),
            # As torchrun: the signals the launcher handles (read by torch's
            # own process launching, should a worker start processes with it).
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(
                s.name for s in (*spec.signals_to_handle, *spec.signals_to_forward)
            ),
            # As torchrun: on unless the user chose otherwise.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", nccl),
            "NCCL_ASYNC_ERROR_HANDLING": env.get("NCCL_ASYNC_ERROR_HANDLING", nccl),
            "PYTHON_EXEC": env.get("PYTHON_EXEC", sys.executable),
        }
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(compile_threads(spec.nproc)))
    if spec.virtual_local_rank:
        env.update(virtual_local_rank(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES")))
    return env


def compile_threads(nproc: int, cpus: int | None = None) -> int:
    """Each worker's share of the node's usable CPUs (``cpus``: this
    process' affinity) for its ``torch.compile`` pool; at least 1."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, nproc))


def virtual_local_rank(local_rank: int, visible: str | None) -> dict[str, str]:
    """torchrun's --virtual-local-rank: every worker is local rank 0 of its
    own device (the local rank's entry of ``CUDA_VISIBLE_DEVICES``, else the
    local rank), and the node's real local rank 0 is flagged
    (``ELASTRUN_LOCAL_MAIN``: worker/local_main.py). Raises WorkerError when
    the list is shorter."""
    device = str(local_rank)
    if visible is not None:
        devices = [d.strip() for d in visible.split(",")]
        if local_rank >= len(devices):
            raise WorkerError(
                f"--virtual-local-rank: local rank {local_rank} has no device in "
                f"CUDA_VISIBLE_DEVICES={visible!r}"
            )
        device = devices[local_rank]
    return {
        "LOCAL_RANK": "0",
        "CUDA_VISIBLE_DEVICES": device,
        LOCAL_MAIN_ENV: "1" if local_rank == 0 else "0",
    }


def worker_env(
    spec: WorkerSpec,
    result: RoundResult,
    local_rank: int,
    error_file: str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of local rank ``local_rank`` for round ``result``."""
    env = stable_env(spec, local_rank, result.run_id, result.max_restarts, base)
    rank = result.rank_offset + local_rank
    env.update(
        {
            "RANK": str(rank),
            "GROUP_RANK": str(result.group_rank),
            # As torch: ranks within this node's role (rendezvous/ranks.py).
            "ROLE_RANK": str(result.role_rank_offset + local_rank),
            "WORLD_SIZE": str(result.world_size),
            "GROUP_WORLD_SIZE": str(result.group_world_size),
            "ROLE_WORLD_SIZE": str(result.role_world_size),
            "MASTER_ADDR": result.master_addr,
            "MASTER_PORT": str(result.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(result.restart_count),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
    )
    return env


def standby_env(
    spec: WorkerSpec, run_id: str, max_restarts: int, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """A standby's environment (agent/standby.py): a worker's that is the same
    in every round, without any rank variable (no ``LOCAL_RANK``: it has no
    rank yet), flagged for the runner (``ELASTRUN_STANDBY=1``)."""
    env = stable_env(spec, 0, run_id, max_restarts, base)
    for name in ("LOCAL_RANK", *ROUND_ENV_VARS):  # the agent's own environment may hold some
        env.pop(name, None)
    env[STANDBY_ENV] = "1"
    return env


def rank_vars(standby: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """What a standby started with ``standby`` is told when it takes the rank
    whose environment is ``env``: every variable ``env`` sets otherwise (its
    rank's, the round's, the features' files of its local rank). Raises
    WorkerError past an ``Enter``'s bound (MAX_ENTER_VARS)."""
    given = {k: v for k, v in env.items() if standby.get(k) != v}
    if len(given) > MAX_ENTER_VARS:
        raise WorkerError(
            f"a standby would be given {len(given)} variables, more than {MAX_ENTER_VARS}"
        )
    return given
