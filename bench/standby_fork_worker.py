"""The process bench/standby_fork.py measures: a setup, then one training step.

``--wait``: set up, print ``ready``, train once on a ``go`` line (a standby).
``--fork``: set up, print ``ready``, and on a ``go`` line fork: the child
trains once and prints ``stepped <s> <fork() s>``.
``--go``: import torch, set up and train at once (a new process).
``--one-thread``: no intra-op threads (``torch.set_num_threads(1)``) before the setup.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mb", type=int, required=True)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--wait", action="store_true")
    how.add_argument("--fork", action="store_true")
    how.add_argument("--go", action="store_true")
    p.add_argument("--one-thread", action="store_true", help="torch.set_num_threads(1) first")
    args = p.parse_args()

    import torch
    from torch import nn

    if args.one_thread:
        torch.set_num_threads(1)

    # The setup: data in memory (every page touched), a model, its optimizer,
    # one step (which starts torch's intra-op threads, as a real setup does).
    data = torch.randn(args.size_mb * 2**20 // 4).view(-1, 1024)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(offset: int) -> None:
        # A batch from across the data set (a random sampler touches it all
        # over an epoch; here a strided slice of it), then an update.
        x = data[offset :: max(1, len(data) // 64)][:64]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step(0)
    if args.go:
        step(1)
        print("stepped 0", flush=True)
        return 0
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    t0 = time.perf_counter()
    if args.wait:
        step(1)
        print(f"stepped {time.perf_counter() - t0:.6f}", flush=True)
        return 0
    pid = os.fork()
    fork_s = time.perf_counter() - t0
    if pid == 0:
        try:
            step(1)
            print(f"stepped {time.perf_counter() - t0:.6f} {fork_s:.6f}", flush=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
