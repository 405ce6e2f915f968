"""The device a checkpoint's collectives run on: where the bytes travel.

A process group on NCCL moves CUDA tensors only; on gloo, CPU tensors. With a
group of several backends (``init_process_group("cpu:gloo,cuda:nccl")``) the
CUDA side is taken: NCCL moves large buffers much faster. The GPU is the one
the group is bound to (``init_process_group(device_id=...)``), else the
worker's ``LOCAL_RANK`` (when the process sees that many GPUs), else torch's
current device: never GPU 0 by default for every rank of a node, which is
what ``current_device()`` alone gives when the script did not call
``torch.cuda.set_device``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["choose_device", "transfer_device"]


def _uses_nccl(backend: str) -> bool:
    """Whether a backend string (``nccl``, ``cpu:gloo,cuda:nccl``) has NCCL for CUDA."""
    for part in backend.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        if name == "nccl" and device in ("", "cuda"):
            return True
    return False


def choose_device(
    backend: str, *, bound: int | None, local_rank: str | None, device_count: int, current: int
) -> str:
    """``"cpu"`` or ``"cuda:<index>"`` for a group of ``backend`` (see the module doc)."""
    if not _uses_nccl(backend):
        return "cpu"
    if bound is not None and 0 <= bound < max(device_count, 1):
        return f"cuda:{bound}"
    if local_rank is not None and local_rank.isdigit() and int(local_rank) < device_count:
        return f"cuda:{int(local_rank)}"
    return f"cuda:{current}"


def transfer_device(group: Any = None) -> Any:
    """The ``torch.device`` for ``group``'s collectives (default: the default group)."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if not _uses_nccl(backend):
        return torch.device("cpu")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    bound = getattr(pg, "bound_device_id", None)
    return torch.device(
        choose_device(
            backend,
            bound=None if bound is None else bound.index,
            local_rank=os.environ.get("LOCAL_RANK"),
            device_count=torch.cuda.device_count(),
            current=torch.cuda.current_device(),
        )
    )
