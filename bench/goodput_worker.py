"""The goodput benchmark's worker (bench/goodput.py): realistic training that
checkpoints the way its launcher's users do.

The model of bench's realistic worker under DDP (an MLP, 83 k parameters),
SGD with momentum, a shuffled data loader over a sharded data set, one step
every ``GP_INTERVAL`` seconds at most. ``GP_MODE``:

* ``torchsave``: rank 0 ``torch.save``\\s model, optimizer and step every
  ``GP_EVERY`` steps (atomically: a temporary file, then a rename), every
  rank loads it at start: what a torchrun script does today;
* ``memory``: every rank ``MemoryCheckpoint.save``\\s every step (written to
  disk by the agent every ``GP_EVERY`` steps), and loads with
  ``MemoryCheckpoint.load`` (``GP_SHARED=1``, the default: ``shared=True``,
  the state being the same on every rank under DDP; ``0``: per-rank states,
  which a lost node's rank gets back from the neighbour's replica);
  ``GP_REPLICATE``: steps between the marks the agent sends to the next node
  as a replica (default: ``GP_EVERY``);
* ``none``: no checkpoint (the failure-free reference).

``GP_PACE``: ``step`` (the default) paces whole steps, their checkpoint
call included, so a save shorter than the pause costs no step; ``compute``
pads the compute alone to ``GP_INTERVAL`` (the pause stands in for a GPU's
compute) and the checkpoint call comes on top, as in a script whose steps
are compute-bound: a save then costs its blocked time
(bench/goodput_accounting.py).

``GP_SETUP``: seconds of CPU work once per process before training (a
script's own setup: data, model, compilation; default 0). ``GP_IN_PROCESS=1``:
the training runs in ``elastrun.train.in_process``, so that a kept process
enters it again without its setup (its ``resume`` event's ``script`` and
``start`` phases are then the time it entered again).

Events (JSON lines in ``GP_EVENTS``): ``resume`` (the step resumed from,
the rank, the world size, the pid, the node: ``GP_NODE``, and when each
phase of the start ended: ``phases``), ``step`` (its
number, the world size, when it ended, the seconds of compute, and the
seconds the checkpoint call kept training waiting).
"""

from __future__ import annotations

import time

T_FIRST_LINE = time.time()  # the script began (its imports next)

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from elastrun.train import MemoryCheckpoint, context, in_process  # noqa: E402

MODE = os.environ.get("GP_MODE", "none")
DIR = Path(os.environ.get("GP_DIR", "."))
EVERY = int(os.environ.get("GP_EVERY", "50"))
INTERVAL = float(os.environ.get("GP_INTERVAL", "0.05"))
EVENTS = os.environ.get("GP_EVENTS", str(DIR / "events.jsonl"))
SHARED = os.environ.get("GP_SHARED", "1") == "1"
NODE = os.environ.get("GP_NODE", "")
SETUP = float(os.environ.get("GP_SETUP", "0"))
IN_PROCESS = os.environ.get("GP_IN_PROCESS") == "1"
PACE_COMPUTE = os.environ.get("GP_PACE", "step") == "compute"
ENTERED = 0  # times this process entered main()


def emit(**fields: object) -> None:
    fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"t": time.time(), **fields}) + "\n").encode())
    finally:
        os.close(fd)


def setup_work(seconds: float) -> None:
    """``seconds`` of CPU work: a script's own setup, once per process."""
    end, x = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        x = (x * 1103515245 + 12345) % (1 << 31)


def main() -> None:
    global ENTERED
    ENTERED += 1
    now = time.time()
    # where a restart's time goes (a kept process: from its entry again)
    phases = {"script": T_FIRST_LINE if ENTERED == 1 else now, "start": now}
    ctx = context()
    dist.init_process_group("gloo")
    phases["process_group"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    features = torch.randn(8192, 64)
    labels = (features[:, :8].sum(dim=1) > 0).long()
    data = TensorDataset(features, labels)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    phases["model"] = time.time()
    loss_fn = nn.CrossEntropyLoss()

    ckpt = DIR / "ckpt.pt"
    mem = None
    state = None
    if MODE == "memory":
        replicate = os.environ.get("GP_REPLICATE")  # marks for the neighbour's replica
        mem = MemoryCheckpoint(
            DIR / "disk",
            persist_every=EVERY if ctx.local_rank == 0 else 0,
            replicate_every=int(replicate) if replicate else None,
        )
        state = mem.load(shared=SHARED)
    elif MODE == "torchsave" and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
    step = 0
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    phases["checkpoint"] = time.time()
    emit(
        ev="resume",
        step=step,
        rank=rank,
        world=world,
        restart=ctx.restart_count,
        pid=os.getpid(),
        node=NODE,
        phases=phases,
    )

    epoch = step * 32 * world // len(data)
    sampler.set_epoch(epoch)
    batches = iter(loader)
    while True:
        t0 = time.monotonic()
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        step += 1
        if PACE_COMPUTE:  # the compute padded to the interval; the save on top
            time.sleep(max(0.0, INTERVAL - (time.monotonic() - t0)))
        t1 = time.monotonic()
        snap = None
        if mem is not None or (MODE == "torchsave" and rank == 0 and step % EVERY == 0):
            snap = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}
        if mem is not None:
            mem.save(snap or {}, step=step)
        elif snap is not None:
            tmp = DIR / f"ckpt.pt.tmp{os.getpid()}"
            torch.save(snap, tmp)
            os.replace(tmp, ckpt)
        t2 = time.monotonic()
        emit(
            ev="step",
            step=step,
            rank=rank,
            world=world,
            compute=t1 - t0,
            blocked=t2 - t1,
            saved=snap is not None,
        )
        left = INTERVAL - (time.monotonic() - t0)
        if left > 0 and not PACE_COMPUTE:
            time.sleep(left)


if __name__ == "__main__":
    setup_work(SETUP)
    (in_process(main) if IN_PROCESS else main)()
