"""Worker: a tiny PyTorch Lightning DDP fit on CPU (gloo), as users write one.

Usage: lightning_fit.py OUT --root DIR [--devices N] [--num-nodes N] [--epochs E]
       [--batches B] [--resume] [--hold-at STEP]

``Trainer(accelerator="cpu", devices=N, num_nodes=M, strategy="ddp")`` fits a
linear model on random tensors, ``B`` batches per rank and epoch, with a
``ModelCheckpoint(save_last=True)`` in ``DIR/ckpt`` saved at every epoch end.
``--resume`` fits with ``ckpt_path="last"`` (a fresh start when there is none).
``--hold-at STEP``: in the first attempt, rank 1 stops after that step (the
other rank waits for it in DDP's next gradient sum) until the test kills it.

Before its Trainer, the script logs through a rank-zero-only function, as
scripts do (a banner, the config): Lightning read the rank when it was
imported, so a worker started with another rank's import would log on the
wrong rank.

What Lightning saw is written for the test to check:
  OUT/steps.jsonl                 one line per training step and rank:
                                  rank, pid, restart, step (global), epoch
  OUT/fit-r{RANK}-a{RESTART}.json one per rank and attempt, after the fit:
                                  Lightning's cluster environment, launcher, ranks,
                                  world size; the launcher's variables; the step
                                  and epoch it started and ended at; a weights
                                  checksum; this process's children
  OUT/rank-zero.jsonl             one line per rank_zero_only call: pid, RANK, restart
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

# Lightning reads the rank from the environment when it is imported (its
# rank-zero-only logging): a worker must have its variables before the script runs.
IMPORT_RANK = getattr(rank_zero_only, "rank", None)

FEATURES = 8
BATCH = 4
ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


def append(path: Path, record: Mapping[str, object]) -> None:
    """One JSON line, appended in one write (several ranks share the file)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def progress_seen() -> dict[str, object] | None:
    mod = sys.modules.get("_elastrun_progress")
    p = mod.current() if mod is not None else None
    if p is None:
        return None
    return {"steps": p.steps, "batches": p.changes, "step_time": p.step_time()}


def children() -> list[int]:
    """This process's child processes (a launcher Lightning started would show here)."""
    out: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


@rank_zero_only
def announce(out: Path) -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    append(
        out / "rank-zero.jsonl",
        {"pid": os.getpid(), "rank": os.environ.get("RANK"), "restart": restart},
    )


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(pl.Callback):
    """Logs every step; remembers where the fit started (after any resume)."""

    def __init__(self, out: Path, hold_at: int) -> None:
        self.out = out
        self.hold_at = hold_at
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.start: dict[str, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = {"step": trainer.global_step, "epoch": trainer.current_epoch}

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        record = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "restart": self.restart,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }
        append(self.out / "steps.jsonl", record)
        if self.restart == 0 and trainer.global_rank == 1 and trainer.global_step == self.hold_at:
            # The test kills this process here (bounded: 10 minutes, then it trains on).
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-at", type=int, default=-1)
    args = parser.parse_args()
    announce(args.out)

    world = args.devices * args.num_nodes
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batches * BATCH * world, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, num_workers=0)

    pl.seed_everything(0, verbose=False)
    model = Regression()
    record = Record(args.out, args.hold_at)
    checkpoint = ModelCheckpoint(dirpath=args.root / "ckpt", save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp",
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, checkpoint],
    )
    trainer.fit(model, loader, ckpt_path="last" if args.resume else None)

    strategy = trainer.strategy
    env = getattr(strategy, "cluster_environment", None)
    launcher = getattr(strategy, "launcher", None)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    result = {
        "pid": os.getpid(),
        "cluster_environment": type(env).__name__,
        "launcher": None if launcher is None else type(launcher).__name__,
        "creates_processes_externally": getattr(env, "creates_processes_externally", None),
        "launcher_spawned": len(getattr(launcher, "procs", []) or []),
        "strategy": type(strategy).__name__,
        "import_rank": IMPORT_RANK,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "num_devices": trainer.num_devices,
        "dist_world_size": dist.get_world_size() if dist.is_initialized() else None,
        "dist_rank": dist.get_rank() if dist.is_initialized() else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "env": {name: os.environ.get(name) for name in ENV},
        "restart": restart,
        "start_step": record.start.get("step"),
        "start_epoch": record.start.get("epoch"),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "ckpt_path": trainer.ckpt_path,
        "checksum": checksum,
        "children": children(),
        # What elastrun's runner recorded, through torch's hooks, with no
        # change to this script (None under another launcher).
        "progress": progress_seen(),
    }
    rank = os.environ.get("RANK", "0")
    (args.out / f"fit-r{rank}-a{restart}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
