"""Conformance worker: form the process group with an explicit init method
(``tcp://host:port`` or ``env://``) and check the world size by all-reduce."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description="init method check")
    parser.add_argument("--init-method", "--init_method", required=True)
    parser.add_argument("--world-size", "--world_size", type=int, default=None)
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args()
    world = args.world_size if args.world_size is not None else int(os.environ["WORLD_SIZE"])
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=args.init_method, world_size=world, rank=rank)
    marks = torch.zeros(world)
    marks[dist.get_rank()] = 1.0
    dist.all_reduce(marks)
    counted = int(marks.sum().item())
    dist.destroy_process_group()
    if counted != world:
        sys.exit(f"all-reduce counted {counted} ranks, expected {world}")
    print(f"rank {rank} of {world}: all-reduce ok")


if __name__ == "__main__":
    main()
