"""A worker with a ``torch.compile``\\d model that counts its compilations
(bench/compile_restart.py; tests/integration/test_in_process.py).

Once per process, outside the training function: the model (an MLP) is
built, wrapped in ``torch.compile`` with a backend that counts its calls
(each call is one graph compiled; it hands the graph to the real backend,
``CW_BACKEND``: ``inductor`` by default, ``aot_eager`` for a cheap one) and
run once forward and backward, so that the compilation is part of the
process's setup, as in a real script. The training function
(``elastrun.train.in_process`` when ``CW_IN_PROCESS=1``) joins the round's
process group, wraps the compiled model in DDP, resumes from the memory
checkpoint (in place: the parameters stay the same tensors) and trains
``CW_STEPS`` steps in all, one every ``CW_INTERVAL`` seconds at most; in the
first run (restart count 0) the last rank SIGKILLs itself after step
``CW_KILL_AT`` (its checkpoint saved; 0: never).

Events (JSON lines appended to ``CW_EVENTS``): ``setup`` (the pid, the
compilations of the setup and its seconds), and per step of every rank
``step`` (its number, rank, pid, restart count and the process's
compilations so far); ``kill`` just before the SIGKILL. Rank 0 also prints
``step N`` lines, for the launcher's log.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastrun.train import MemoryCheckpoint, context, heartbeat, in_process

BACKEND = os.environ.get("CW_BACKEND", "inductor")
EVENTS = os.environ.get("CW_EVENTS", "compile-events.jsonl")
STEPS = int(os.environ.get("CW_STEPS", "20"))
KILL_AT = int(os.environ.get("CW_KILL_AT", "5"))
INTERVAL = float(os.environ.get("CW_INTERVAL", "0.1"))
CKPT = os.environ.get("CW_CKPT", "ckpt")
COMPILES = 0  # graphs this process compiled


def emit(**fields: object) -> None:
    fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n").encode())
    finally:
        os.close(fd)


def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """A dynamo backend: count the graph, compile it with ``BACKEND``."""
    global COMPILES
    COMPILES += 1
    return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)


t0 = time.perf_counter()
torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)
)
compiled = torch.compile(model, backend=counting)
features = torch.randn(1024, 64)
labels = (features[:, :8].sum(dim=1) > 0).long()
nn.functional.cross_entropy(compiled(features[:32]), labels[:32]).backward()  # compiles
model.zero_grad(set_to_none=True)
emit(ev="setup", compiles=COMPILES, seconds=time.perf_counter() - t0, backend=BACKEND)
print(f"setup done: pid {os.getpid()} ({COMPILES} graph(s) compiled)", flush=True)


def train() -> None:
    ctx = context()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(compiled)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mem = MemoryCheckpoint(CKPT, persist_every=1 if ctx.local_rank == 0 else 0, log=None)
    state = mem.load(shared=True)
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])  # in place: the same parameters
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    while step < STEPS:
        t = time.monotonic()
        i = (step * 32 * world + rank * 32) % len(features)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(features[i : i + 32]), labels[i : i + 32]).backward()
        opt.step()
        step += 1
        mem.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, step=step
        )
        heartbeat(step)
        emit(ev="step", step=step, rank=rank, restart=ctx.restart_count, compiles=COMPILES)
        if rank == 0:
            print(f"step {step} world {world} restart {ctx.restart_count}", flush=True)
        if ctx.restart_count == 0 and step == KILL_AT and rank == world - 1:
            emit(ev="kill", step=step, rank=rank)
            print(f"[rank {rank}] injected failure at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(max(0.0, INTERVAL - (time.monotonic() - t)))
    mem.close()
    dist.destroy_process_group()


(in_process(train) if os.environ.get("CW_IN_PROCESS") == "1" else train)()
