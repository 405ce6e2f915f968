"""A training-like worker whose newest checkpoint gets damaged (test_checkpoint_damage.py).

Each step ``s`` (1..``CKPT_STEPS``): an all-reduce of ``rank + 1`` gives ``c``,
then ``w = w * 0.5 + c + s`` (float64, exact to replay), and local rank 0
saves ``{"step", "w"}`` with ``elastrun.train.save_checkpoint`` into
``CKPT_DIR`` (its node's own folder). On start every rank calls
``load_checkpoint`` and resumes from what it returns.

In the first attempt only (``TORCHELASTIC_RESTART_COUNT=0``), once step
``CKPT_DAMAGE_AT`` is saved everywhere: local rank 0 of a node started with
``CKPT_DAMAGE`` (``flip``: two bytes of w's data; ``truncate``: cut in half)
damages its newest checkpoint; then the last local rank of a node started
with ``CKPT_CRASH_AT`` exits 1, so the agents restart the group.

Rank 0 ends by printing ``RESULT {"step", "w", "resumed_from", "restarts", "world"}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from elastrun.train import context, latest_checkpoint, load_checkpoint, save_checkpoint


def damage(directory: str, how: str, w: torch.Tensor) -> None:
    newest = latest_checkpoint(directory)
    assert newest is not None
    data = bytearray(newest.path.read_bytes())
    if how == "truncate":
        del data[len(data) // 2 :]
    else:
        at = data.find(w.numpy().tobytes())
        assert at >= 0, "w's data not found in the checkpoint"
        at += w.numel() * w.element_size() // 2
        data[at] ^= 0x40
        data[at + 1] ^= 0x01
    Path(newest.path).write_bytes(bytes(data))
    print(f"[test] damaged {newest.path} ({how})", flush=True)


def main() -> None:
    ctx = context()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = os.environ["CKPT_DIR"]
    steps = int(os.environ["CKPT_STEPS"])
    damage_at = int(os.environ.get("CKPT_DAMAGE_AT", "-1"))
    crash_at = int(os.environ.get("CKPT_CRASH_AT", "-1"))

    state = load_checkpoint(directory)
    step = 0 if state is None else int(state["step"])
    w = torch.zeros(256, dtype=torch.float64) if state is None else state["w"]
    resumed_from = step
    while step < steps:
        step += 1
        c = torch.full((256,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(c)
        w = w * 0.5 + c + step
        if ctx.local_rank == 0:
            save_checkpoint({"step": step, "w": w}, directory, step=step, keep=3)
        if ctx.restart_count == 0 and step == damage_at:
            dist.barrier()  # every node saved this step
            if ctx.local_rank == 0 and os.environ.get("CKPT_DAMAGE"):
                damage(directory, os.environ["CKPT_DAMAGE"], w)
            dist.barrier()  # and the damage is done
            if step == crash_at and ctx.local_rank == ctx.local_world_size - 1:
                print(f"[test] rank {rank} exits 1 after step {step}", flush=True)
                raise SystemExit(1)
    if rank == 0:
        result = {
            "step": step,
            "w": float(w[0]),
            "resumed_from": resumed_from,
            "restarts": ctx.restart_count,
            "world": world,
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
