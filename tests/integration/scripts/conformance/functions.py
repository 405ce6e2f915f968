"""Function entrypoints for the ``launch()`` conformance cases."""

from __future__ import annotations

import os


def rank_plus_ten() -> int:
    """Each worker returns 10 + its global rank."""
    return 10 + int(os.environ["RANK"])


def rank_sum() -> int:
    """Each worker all-reduces its rank over gloo and returns the sum."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor(int(os.environ["RANK"]))
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())
