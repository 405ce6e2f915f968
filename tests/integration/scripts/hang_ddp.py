"""A real DDP training script for the hang tests (gloo, CPU), unchanged for elastrun:
a model under DistributedDataParallel, an SGD optimizer, a DataLoader, about 50 ms steps.
It never calls elastrun.train.heartbeat: progress is recorded automatically.

Usage: hang_ddp.py OUTDIR MODE [STEPS]
MODE stuck:     first attempt: at step 30 rank STUCK_RANK (default 1) calls
                stuck_in_my_function() and never returns; the other ranks block in the
                backward pass's all-reduce. Later attempts train STEPS steps and exit 0.
MODE pauses:    a long evaluation over a DataLoader (EVAL_S s), a long checkpoint save
                through elastrun.train.save_checkpoint and one through torch.save
                (SAVE_S s each), between training steps; exits 0.
MODE straggler: rank SLOW_RANK sleeps SLOW_S more than the others in every step; the
                job runs until OUTDIR/stop exists (at most 120 s).
Each rank appends {"rank", "restart", "step"} lines to OUTDIR/steps.<rank>.jsonl.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

outdir, mode = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 60
rank = int(os.environ["RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEP_S = 0.05


class SlowToSave:
    """A state entry that takes SAVE_S seconds to serialise (a big model on a slow disk)."""

    def __reduce__(self):
        time.sleep(float(os.environ.get("SAVE_S", "8")))
        return (dict, ())


def stuck_in_my_function() -> None:
    while True:
        time.sleep(1)


def log(step: int) -> None:
    with open(os.path.join(outdir, f"steps.{rank}.jsonl"), "a") as fp:
        fp.write(json.dumps({"rank": rank, "restart": restart, "step": step}) + "\n")


dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))


def batches():
    while True:
        yield from DataLoader(data, batch_size=16)


def train_step(x, y, extra: float = 0.0) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    time.sleep(STEP_S + extra)


it = batches()
if mode == "stuck":
    stuck_rank = int(os.environ.get("STUCK_RANK", "1"))
    for step in range(steps):
        x, y = next(it)
        if restart == 0 and step == 30 and rank == stuck_rank:
            with open(os.path.join(outdir, f"stuck.{rank}"), "w") as fp:
                fp.write(str(time.monotonic()))
            stuck_in_my_function()
        train_step(x, y)
        log(step)
elif mode == "pauses":
    from elastrun.train import save_checkpoint

    eval_s = float(os.environ.get("EVAL_S", "8"))
    for step in range(steps):
        x, y = next(it)
        train_step(x, y)
        log(step)
        if step == 15:  # evaluation: no optimizer step, batches from a DataLoader
            model.eval()
            with torch.no_grad():
                for i, (x, _y) in enumerate(DataLoader(data, batch_size=64)):
                    model(x)
                    time.sleep(eval_s / 64)
                    if i >= 63:
                        break
            model.train()
        if step == 30:
            save_checkpoint(
                {"w": torch.ones(4), "slow": SlowToSave()},
                os.path.join(outdir, f"ckpt{rank}"),
                step=step,
            )
        if step == 45:
            torch.save({"slow": SlowToSave()}, os.path.join(outdir, f"own{rank}.pt"))
elif mode == "straggler":
    slow_rank, slow_s = (
        int(os.environ.get("SLOW_RANK", "2")),
        float(os.environ.get("SLOW_S", "0.05")),
    )
    end = time.monotonic() + 120
    step = 0
    while True:
        # Every rank stops at the same step (a rank leaving alone would wait
        # in the barrier while the others wait in the all-reduce).
        stop = torch.tensor(
            [float(os.path.exists(os.path.join(outdir, "stop")) or time.monotonic() > end)]
        )
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        x, y = next(it)
        train_step(x, y, slow_s if rank == slow_rank else 0.0)
        log(step)
        step += 1
dist.barrier()
dist.destroy_process_group()
