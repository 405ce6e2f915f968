"""Elastic data-parallel training of a small CNN on handwritten digits (CPU and gloo, or GPUs
and NCCL).

Run it the way you would run any torchrun script::

    torchrun --standalone --nproc-per-node=2 examples/train.py --epochs 10
    elastrun --standalone --nproc-per-node=2 examples/train.py --epochs 10

or alone (``python examples/train.py``: one process, world size 1). On GPUs,
one worker per GPU, each on the GPU of its local rank, over NCCL::

    elastrun --standalone --nproc-per-node=gpu examples/train.py --device cuda

The data set (UCI handwritten digits, 1797 8x8 images, vendored in
examples/data/) is split into 1437 training and 360 held-out test images.
Each rank trains on its shard (``ElasticSampler``), gradients are averaged by
DDP, a checkpoint is saved atomically at every epoch end (and every
``--checkpoint-every`` steps; in ``runs/train/checkpoints`` under the current
directory unless ``--checkpoint-dir`` says otherwise), and on start the ranks agree on the newest
checkpoint any of them holds and resume from it: the same epoch and the same
global sample offset inside it, at whatever world size the job now has.

Rank 0 prints progress; the last line is machine-checkable::

    final: epoch=10 test_acc=0.9861 world=2 restarts=0
"""

from __future__ import annotations

import argparse
import gzip
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elastrun.train import (
    ElasticSampler,
    MemoryCheckpoint,
    context,
    global_order,
    heartbeat,
    in_process,
    load_checkpoint,
    save_checkpoint,
)

DATA = Path(__file__).resolve().parent / "data" / "digits.csv.gz"
TEST_SIZE = 360
DEFAULT_CHECKPOINT_DIR = "runs/train/checkpoints"
SPLIT_SEED = 20240601  # fixed: the test set never changes with --seed
PIXEL_MEAN, PIXEL_STD = 0.30, 0.38  # of the training images scaled to [0, 1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10, help="total epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order (default 0)")
    p.add_argument(
        "--checkpoint-dir",
        default=DEFAULT_CHECKPOINT_DIR,
        help=f"node-local checkpoint directory (default {DEFAULT_CHECKPOINT_DIR}, under the "
        "current directory; runs/ is ignored by git)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also checkpoint every N global steps mid-epoch (default 0: epoch ends only)",
    )
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    p.add_argument(
        "--memory-checkpoint",
        action="store_true",
        help="checkpoint every step into memory held by elastrun's agent (a restarted worker "
        "resumes from it); disk checkpoints as without it, written by the agent",
    )
    p.add_argument("--log-every", type=int, default=20, help="print every N steps (default 20)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model and the data live (default cpu); cuda: the GPU of this worker's "
        "local rank (run one worker per GPU: --nproc-per-node=gpu)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="process-group backend (default: nccl with --device cuda, gloo otherwise)",
    )
    p.add_argument("--data", default=str(DATA), help="digits.csv.gz path")
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="sleep this many seconds per step (to watch kills/joins happen)",
    )
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=-1,
        help="fault injection: the last rank fails at this global step, only in a run that "
        "started from scratch (no checkpoint, restart count 0), so a restart goes on",
    )
    p.add_argument(
        "--crash-how",
        choices=["exit", "sigkill"],
        default="exit",
        help="how --crash-at-step fails: exit with code 1 (default), or SIGKILL itself, as the "
        "kernel's OOM killer would",
    )
    p.add_argument(
        "--raise-at-step",
        type=int,
        default=-1,
        help="fault injection: rank 0 raises an exception at this global step, only in the "
        "run of restart count 1 (after a --crash-at-step restart)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="train in elastrun.train.in_process: after a failure, the ranks whose processes "
        "survive enter the training function again, keeping their setup (docs/in_process.md)",
    )
    p.add_argument(
        "--setup-seconds",
        type=float,
        default=0.0,
        help="S seconds of CPU work per process before training, standing in for a script's "
        "own setup (data, model, compilation), ending with one 'setup done' line per process",
    )
    return p.parse_args(argv)


def load_digits(path: str) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) tensors: images 1x8x8, standardised; labels 0..9."""
    with gzip.open(path, "rt") as f:
        rows = [[int(v) for v in line.split(",")] for line in f if line.strip()]
    data = torch.tensor(rows, dtype=torch.float32)
    x = ((data[:, :64] / 16.0 - PIXEL_MEAN) / PIXEL_STD).reshape(-1, 1, 8, 8)
    y = data[:, 64].long()
    order = torch.tensor(global_order(len(rows), seed=SPLIT_SEED, epoch=0))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, ds: TensorDataset) -> float:
    model.eval()
    x, y = ds.tensors
    pred = model(x).argmax(dim=1)
    model.train()
    return float((pred == y).float().mean())


def select_device(name: str, local_rank: int) -> torch.device:
    """The device this worker trains on: the CPU, or the GPU of its local rank
    (made current, so that NCCL and torch.cuda calls use it). Exits with a
    message naming the problem when there is no such GPU."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            "train.py: --device cuda, but torch sees no GPU (torch.cuda.is_available() is False: "
            f"a CPU build of torch {torch.__version__}, no driver, or CUDA_VISIBLE_DEVICES empty)"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise SystemExit(
            f"train.py: --device cuda: local rank {local_rank} has no GPU of its own ({count} "
            "visible); start one worker per GPU (--nproc-per-node=gpu)"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init_distributed(backend: str, launched: bool) -> None:
    if launched:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(minutes=5))
    else:  # plain `python train.py`: a world of one
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1)


def inject_failure(how: str, rank: int, step: int) -> None:
    """The fault --crash-at-step asks for: say so, then SIGKILL this process (or return)."""
    what = "SIGKILL to itself" if how == "sigkill" else "exit code 1"
    print(f"[rank {rank}] injected failure at step {step}: {what}", flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def setup_work(seconds: float) -> None:
    """``seconds`` of CPU work (a script's own setup), then one ``setup done`` line."""
    end, x = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        x = (x * 1103515245 + 12345) % (1 << 31)
    print(f"setup done: pid {os.getpid()} ({seconds:g} s)", flush=True)


class Setup:
    """What a process builds once, before it trains: the data and the model
    (with --in-process, a kept process enters ``train`` again with them)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.train_ds, test_ds = load_digits(args.data)
        self.test_ds = TensorDataset(*(t.to(device) for t in test_ds.tensors))
        torch.manual_seed(args.seed)
        self.model = make_model().to(device)
        # The weights a run without a checkpoint starts from, in every entry.
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Once per process: with --in-process, a kept process does not do it again.
    device = select_device(args.device, context().local_rank)
    # Wrapped before the setup, as a decorator would: elastrun's standby
    # processes start now, beside this one's setup (docs/in_process.md).
    run = in_process(train) if args.in_process else train
    setup = Setup(args, device)
    if args.setup_seconds > 0:
        setup_work(args.setup_seconds)
    return run(args, setup)


def train(args: argparse.Namespace, setup: Setup) -> int:
    """Join the process group and train (again, after an in-process restart:
    the round's RANK, WORLD_SIZE, MASTER_PORT, ... are in os.environ)."""
    ctx, device = context(), setup.device
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    init_distributed(backend, ctx.launched)
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    train_ds, test_ds, model = setup.train_ds, setup.test_ds, setup.model
    n = len(train_ds)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticSampler(n, seed=args.seed, rank=rank, world_size=world)
    global_step = 0

    say(
        f"=> start: world {world} restarts {ctx.restart_count}/{ctx.max_restarts} "
        f"run_id {ctx.run_id} train {n} test {len(test_ds)} device {device} backend {backend} "
        f"pid {os.getpid()}"
    )
    mem = MemoryCheckpoint(args.checkpoint_dir, keep=args.keep) if args.memory_checkpoint else None
    state = mem.load(shared=True) if mem else load_checkpoint(args.checkpoint_dir, keep=args.keep)
    fresh = state is None and ctx.restart_count == 0
    if state is None:
        model.load_state_dict(setup.initial)
    else:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        global_step = int(state["global_step"])
        if sampler.offset >= n:  # saved after the last step of an epoch
            sampler.set_epoch(sampler.epoch + 1)
        say(
            f"=> resumed: epoch={sampler.epoch} offset={sampler.offset}/{n} "
            f"global_step={global_step} (world {world}, restart {ctx.restart_count})"
        )
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint(disk: bool = True) -> None:
        snap = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "sampler": sampler.state_dict(),
            "global_step": global_step,
        }
        # One disk copy per node; no shared filesystem needed.
        if mem is not None:  # every rank, every step; the agent writes the disk copy
            mem.save(snap, step=global_step, persist=disk and ctx.local_rank == 0)
        elif ctx.local_rank == 0 and disk:
            save_checkpoint(snap, args.checkpoint_dir, step=global_step, keep=args.keep)

    acc: float | None = None  # measured after each epoch (a run that trains none: at the end)
    for epoch in range(sampler.epoch, args.epochs):
        if sampler.epoch != epoch:
            sampler.set_epoch(epoch)
        loader = DataLoader(
            train_ds, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda"
        )
        start_offset, t0 = sampler.offset, time.perf_counter()
        loss_sum, batches = 0.0, 0
        for x_cpu, y_cpu in loader:
            x = x_cpu.to(device, non_blocking=True)
            y = y_cpu.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sampler.advance(len(y))
            global_step += 1
            loss_sum, batches = loss_sum + loss.item(), batches + 1
            heartbeat(global_step)
            if args.step_delay > 0:
                time.sleep(args.step_delay)
            if args.log_every > 0 and global_step % args.log_every == 0:
                say(
                    f"epoch {epoch} step {global_step} offset {sampler.offset}/{n} "
                    f"loss {loss.item():.4f}"
                )
            every = args.checkpoint_every
            if every > 0 and global_step % every == 0 and sampler.offset < n:
                checkpoint()
            elif mem is not None:
                checkpoint(disk=False)
            # After this step's checkpoint: a restart redoes no step.
            if fresh and global_step == args.crash_at_step and rank == world - 1:
                inject_failure(args.crash_how, rank, global_step)
                return 1
            if ctx.restart_count == 1 and global_step == args.raise_at_step and rank == 0:
                print(f"[rank {rank}] injected exception at step {global_step}", flush=True)
                raise ValueError(f"injected exception at step {global_step}")
        elapsed = time.perf_counter() - t0
        sampler.set_epoch(epoch + 1)
        acc = accuracy(model, test_ds)
        checkpoint()
        samples = n - start_offset
        say(
            f"epoch {epoch} step {global_step} loss {loss_sum / max(batches, 1):.4f} "
            f"test_acc {acc:.4f} samples/s {samples / max(elapsed, 1e-9):.0f} "
            f"world {world} restarts {ctx.restart_count}"
        )
    if acc is None:
        acc = accuracy(model, test_ds)
    say(f"final: epoch={args.epochs} test_acc={acc:.4f} world={world} restarts={ctx.restart_count}")
    if mem is not None:
        mem.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
