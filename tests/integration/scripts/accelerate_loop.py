"""Worker: a Hugging Face ``accelerate`` training loop on CPU, as users write one.

Usage: accelerate_loop.py OUT [--steps-per-epoch B] [--epochs E] [--in-process --kill-at S]

``Accelerator()`` (no arguments: everything from the launcher's environment)
prepares a linear model, an optimizer and a DataLoader over random tensors,
trains ``E`` epochs with ``accelerator.backward``, then gathers every rank's
loss. Writes OUT/accelerate-r{RANK}.json: what accelerate saw (distributed
type, process index and count, local process index, backend), the launcher's
variables, the number of steps this rank took, a weights checksum (equal on
every rank when gradients were synchronised), the gathered losses, and this
process's children.

``--in-process``: the loop (from ``Accelerator()`` on) runs in
``elastrun.train.in_process``, and each entry first resets accelerate's
process-wide state (``AcceleratorState._reset_state(reset_partial_state=True)``),
which otherwise keeps the aborted round's setup (docs/in_process.md,
*Frameworks*); ``--kill-at S``: in the first run, rank 1 SIGKILLs itself
after its step ``S``. The record also says how many times this process
entered the loop (``entries``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.state import AcceleratorState  # type: ignore[import-untyped]
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 8
BATCH = 4
ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENTRIES = 0  # times this process entered the loop


def children() -> list[int]:
    out: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps-per-epoch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    if args.in_process:
        from elastrun.train import in_process

        in_process(loop)(args)
    else:
        loop(args)


def loop(args: argparse.Namespace) -> None:
    global ENTRIES
    ENTRIES += 1
    if args.in_process:  # the previous entry's state holds the aborted round's setup
        AcceleratorState._reset_state(reset_partial_state=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    accelerator = Accelerator()
    world = accelerator.num_processes
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps_per_epoch * BATCH * world, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # The global data set, batch size per process: prepare() shards it by rank.
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, num_workers=0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    steps = 0
    loss = torch.zeros(())
    for epoch in range(args.epochs):
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            steps += 1
            if restart == 0 and steps == args.kill_at and accelerator.process_index == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        accelerator.print(f"epoch {epoch} loss {loss.item():.4f}")
    losses = accelerator.gather(loss.detach().reshape(1))
    accelerator.wait_for_everyone()

    state = accelerator.state
    checksum = float(
        sum(p.detach().double().sum() for p in accelerator.unwrap_model(model).parameters())
    )
    result = {
        "pid": os.getpid(),
        "distributed_type": str(state.distributed_type),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "local_process_index": accelerator.local_process_index,
        "is_main_process": accelerator.is_main_process,
        "device": str(accelerator.device),
        "backend": state.backend,
        "model_class": type(model).__name__,
        "dist_world_size": dist.get_world_size() if dist.is_initialized() else None,
        "dist_rank": dist.get_rank() if dist.is_initialized() else None,
        "env": {name: os.environ.get(name) for name in ENV},
        "steps": steps,
        "gathered_losses": [float(v) for v in losses.tolist()],
        "checksum": checksum,
        "children": children(),
        "entries": ENTRIES,
    }
    rank = os.environ.get("RANK", "0")
    (args.out / f"accelerate-r{rank}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
