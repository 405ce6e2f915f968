"""Worker: a Lightning DDP fit whose first attempt trains until it is killed
and whose later attempts fit a few steps and end (CPU, gloo).

Usage: lightning_ranks.py OUT --root DIR [--devices N] [--steps S] [--step-delay S]

Lightning reads the rank from the environment when it is imported and keeps it
for its rank-zero-only functions until a Trainer sets it again. The script
logs through one such function before it builds its Trainer, as scripts do
(a banner, the config), so a worker started with another rank's import would
log on the wrong rank.

What it writes for the test:
  OUT/steps.jsonl                 one line per training step and rank: rank, pid, restart, step
  OUT/rank-zero.jsonl             one line per rank_zero_only call: pid, RANK, restart
  OUT/fit-r{RANK}-a{RESTART}.json the rank Lightning read at import, its global rank, pid
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

IMPORT_RANK = getattr(rank_zero_only, "rank", None)
FEATURES = 8
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def append(path: Path, record: Mapping[str, object]) -> None:
    """One JSON line, appended in one write (several ranks share the file)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


@rank_zero_only
def announce(out: Path) -> None:
    append(
        out / "rank-zero.jsonl",
        {"pid": os.getpid(), "rank": os.environ.get("RANK"), "restart": RESTART},
    )


class Regression(pl.LightningModule):
    def __init__(self, out: Path, step_delay: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 1)
        self.out = out
        self.step_delay = step_delay

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_delay and RESTART == 0:
            time.sleep(self.step_delay)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        record = {
            "rank": self.global_rank,
            "pid": os.getpid(),
            "restart": RESTART,
            "step": self.trainer.global_step,
        }
        append(self.out / "steps.jsonl", record)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-delay", type=float, default=0.1)
    args = parser.parse_args()
    announce(args.out)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, FEATURES, generator=generator)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    # The first attempt trains until the test kills it (bounded: 100000 steps).
    steps = 100_000 if RESTART == 0 else args.steps
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_steps=steps,
        max_epochs=-1,
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(args.out, args.step_delay), loader)
    result = {"pid": os.getpid(), "import_rank": IMPORT_RANK, "global_rank": trainer.global_rank}
    (args.out / f"fit-r{os.environ['RANK']}-a{RESTART}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
