"""A training worker with a sharded state (FSDP2 on CPU, gloo), for
test_sharded_checkpoint.py.

Each step ``s`` (1..``MEM_STEPS``) trains an FSDP2 model (``fully_shard`` on
the world's mesh) one Adam step on inputs seeded by ``s`` and the rank, and
every rank saves ``{"model", "opt", "extra", "step"}`` (``extra``: a DTensor
sharded on rows, ``Shard(0)``, and one replicated) with
``MemoryCheckpoint.save``, then appends ``{"rank", "step", "fp"}`` to
``MEM_PROGRESS`` (``fp``: a fingerprint of the rank's local shards). In the
first attempt only, once every rank has committed step ``MEM_CRASH_AT``, the
last local rank SIGKILLs itself.

Each rank prints ``LOADED {"rank", "step", "fp", "kinds"}`` for the state it
loaded at start (``kinds``: the types of the loaded values).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from elastrun.train import MemoryCheckpoint, context


def fingerprint(state: dict[str, Any]) -> float:
    total = 0.0
    stack: list[Any] = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, DTensor):
            total += float(node.to_local().double().abs().sum())
        elif isinstance(node, torch.Tensor):
            total += float(node.double().abs().sum())
    return total


def main() -> None:
    ctx = context()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    extra: dict[str, Any] = {
        "rows": distribute_tensor(torch.arange(21.0).reshape(7, 3), mesh, [Shard(0)]),
        "bias": distribute_tensor(torch.ones(4), mesh, [Replicate()]),
    }
    mem = MemoryCheckpoint(None)
    state = mem.load()
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        extra = state["extra"]
        step = int(state["step"])
        kinds = sorted({type(v).__name__ for v in [*state["model"].values(), *extra.values()]})
        fp = fingerprint(state)
    else:
        kinds, fp = [], 0.0
    print(
        f"LOADED {json.dumps({'rank': rank, 'step': step, 'fp': fp, 'kinds': kinds})}", flush=True
    )
    steps = int(os.environ["MEM_STEPS"])
    crash_at = int(os.environ["MEM_CRASH_AT"])
    while step < steps:
        step += 1
        g = torch.Generator().manual_seed(step * 100 + rank)
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).sum().backward()
        opt.step()
        extra["rows"] = extra["rows"] * 0.5 + step
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "extra": extra, "step": step}
        mem.save(state, step=step)
        with open(os.environ["MEM_PROGRESS"], "a") as f:
            f.write(json.dumps({"rank": rank, "step": step, "fp": fingerprint(state)}) + "\n")
        if ctx.restart_count == 0 and step == crash_at:
            mem.wait()
            dist.barrier()  # every rank committed this step
            if ctx.local_rank == ctx.local_world_size - 1:
                print(f"[test] rank {rank} SIGKILLs itself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the others wait to be stopped
    mem.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
