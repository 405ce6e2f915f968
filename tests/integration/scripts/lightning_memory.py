"""Worker: a Lightning DDP fit (CPU, gloo) with elastrun's MemoryCheckpointIO.

Usage: lightning_memory.py OUT --kill-at N --max-steps M [--persist-every P]

A linear model on random tensors, ``ModelCheckpoint(every_n_train_steps=1)``
(a checkpoint every step: a memory copy on rank 0, written to disk every
``P`` steps, default 10), ``fit(ckpt_path=
io.resume_path())``. In the first attempt, rank 1 SIGKILLs itself when step
``N`` starts. Each rank appends ``{"rank", "restart", "start_step",
"end_step"}`` to OUT/fits.jsonl after its fit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from elastrun.integrations.lightning import MemoryCheckpointIO


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Kill(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at = at
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.start = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.restart == 0 and trainer.global_rank == 1 and trainer.global_step == self.at:
            print(f"[test] rank 1 SIGKILLs itself at step {self.at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--persist-every", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    io = MemoryCheckpointIO(args.out / "ckpt", persist_every=args.persist_every)
    kill = Kill(args.kill_at)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.max_steps,
        plugins=[io],
        callbacks=[
            ModelCheckpoint(dirpath=args.out / "lightning", every_n_train_steps=1, save_top_k=1),
            kill,
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=4), ckpt_path=io.resume_path())
    record = {
        "rank": trainer.global_rank,
        "restart": kill.restart,
        "start_step": kill.start,
        "end_step": trainer.global_step,
    }
    with open(args.out / "fits.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
