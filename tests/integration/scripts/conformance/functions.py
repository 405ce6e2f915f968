"""Function entrypoints for the ``launch()`` conformance cases that use torch
(those that do not: plain_functions.py)."""

from __future__ import annotations

import os


def rank_sum() -> int:
    """Each worker all-reduces its rank over gloo and returns the sum."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor(int(os.environ["RANK"]))
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


def dummy_compute() -> object:
    """upstream's ``_dummy_compute``: returns a tensor (here 4 ones times the rank)."""
    import torch

    return torch.ones(4) * int(os.environ["RANK"])


def state_dict_tree() -> object:
    """A ``state_dict``-shaped tree: tensors, numbers and strings in dicts and lists."""
    import torch

    rank = int(os.environ["RANK"])
    return {
        "model": {"w": torch.full((2, 2), float(rank)), "b": torch.arange(3)},
        "step": rank,
        "history": [torch.tensor([0.5]), "sgd", None, (1, 2.5)],
    }


def returns_an_object() -> object:
    """A value that is neither JSON nor tensors (it would need pickle)."""
    import torch

    return {"w": torch.ones(1), "fn": os.path.join}
