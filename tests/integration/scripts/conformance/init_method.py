"""Conformance worker: form the process group with an explicit init method
(``tcp://host:port`` or ``env://``) and check the world size by all-reduce.

Given ``--init-method`` more than once, the worker does it for each method in
turn (one ``import torch`` for several of upstream's cases): the group is
destroyed between two, and as both stores listen on the same port (rank 0's),
the other ranks wait until the store there is the next one, not the last one
(which holds the key ``DONE`` with the method's index) before they join.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

DONE = "conformance_init_method_done"
WAIT_S = 120.0  # for rank 0's next store, at most


def store_address(method: str) -> tuple[str, int]:
    if method.startswith("tcp://"):
        url = urlparse(method)
        assert url.hostname is not None and url.port is not None, method
        return url.hostname, url.port
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def wait_for_the_next_store(method: str, last: int) -> None:
    """Until the store at the next method's address is not the one whose
    group ``last`` ended (bounded)."""
    host, port = store_address(method)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            probe = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
            old = probe.check([DONE]) and probe.get(DONE) == str(last).encode()
            del probe
            if not old:
                return
        except (RuntimeError, TimeoutError):
            pass  # none listening yet (rank 0 is between two stores)
        time.sleep(0.05)
    sys.exit(f"no new store at {host}:{port} after {WAIT_S:g}s")


def main() -> None:
    parser = argparse.ArgumentParser(description="init method check")
    parser.add_argument("--init-method", "--init_method", action="append", required=True)
    parser.add_argument("--world-size", "--world_size", type=int, default=None)
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args()
    world = args.world_size if args.world_size is not None else int(os.environ["WORLD_SIZE"])
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    methods: list[str] = args.init_method
    for index, method in enumerate(methods):
        if index and rank != 0:
            wait_for_the_next_store(method, index - 1)
        dist.init_process_group("gloo", init_method=method, world_size=world, rank=rank)
        marks = torch.zeros(world)
        marks[dist.get_rank()] = 1.0
        dist.all_reduce(marks)
        counted = int(marks.sum().item())
        if index + 1 < len(methods):
            if rank == 0:  # marks this store, through a client of its own
                host, port = store_address(method)
                marker = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
                marker.set(DONE, str(index))
                del marker
            dist.barrier()  # the key is set before any rank looks for it
        dist.destroy_process_group()
        if counted != world:
            sys.exit(f"all-reduce counted {counted} ranks, expected {world}")
        print(f"rank {rank} of {world}: {method} all-reduce ok", flush=True)


if __name__ == "__main__":
    main()
