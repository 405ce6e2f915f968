"""Benchmark worker: PyTorch Lightning training as users write it (CPU, gloo).

A ``LightningModule`` (an MLP, 64-256-256-1) under ``Trainer(strategy="ddp")``,
SGD, a ``DataLoader`` over a synthetic data set, a ``ModelCheckpoint`` saving
``last.ckpt`` every 10 steps and resuming from it (``ckpt_path="last"``), and
a rank-zero-only banner before the Trainer (its rank is the one Lightning read
when imported). Each step sleeps to ``BENCH_STEP_INTERVAL`` (default 0.15 s)
and appends ``{"kind": "step", "rank", "pid", "restart", "step", "t"}`` to
``BENCH_DIR/events.jsonl``; the fit ends, on every rank at the same step, once
``BENCH_DIR/stop`` exists on any (or after 100000 steps).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

OUT = Path(os.environ["BENCH_DIR"])
INTERVAL = float(os.environ.get("BENCH_STEP_INTERVAL", "0.15"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def emit(kind: str, **fields: object) -> None:
    line = json.dumps(
        {
            "kind": kind,
            "rank": RANK,
            "pid": os.getpid(),
            "restart": RESTART,
            "t": time.time(),
            **fields,
        }
    )
    fd = os.open(OUT / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@rank_zero_only
def banner() -> None:
    emit("banner")


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 1),
        )
        self.last = time.monotonic()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        emit("step", step=self.trainer.global_step)
        left = INTERVAL - (time.monotonic() - self.last)
        if left > 0:
            time.sleep(left)
        self.last = time.monotonic()
        # Every rank stops at the same step (one rank stopping alone would
        # leave the other waiting in its next all-reduce).
        stop = self.trainer.strategy.reduce_boolean_decision((OUT / "stop").exists(), all=False)
        if stop:
            self.trainer.should_stop = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    banner()
    emit("start")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=100_000,
        max_epochs=-1,
        default_root_dir=OUT / "root",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=OUT / "ckpt", save_last=True, every_n_train_steps=10)],
    )
    trainer.fit(Model(), loader, ckpt_path="last")


if __name__ == "__main__":
    main()
