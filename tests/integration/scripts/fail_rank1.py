"""Worker: rank 1 raises a distinctive exception; rank 0 waits in a barrier.

Usage: fail_rank1.py MODE   (MODE: torch | elastrun | plain)
"""

import sys

import torch.distributed as dist


def explode_on_rank_one() -> None:
    raise ValueError("rank one exploded: sentinel-7f3a")


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        explode_on_rank_one()
    dist.barrier()  # rank 0: broken by rank 1's death, or stopped by the agent
    dist.barrier()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "torch":
        from torch.distributed.elastic.multiprocessing.errors import record as torch_record

        torch_record(main)()
    elif mode == "elastrun":
        from elastrun import record

        record(main)()
    else:
        main()
