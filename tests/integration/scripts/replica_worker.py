"""A worker with per-rank memory checkpoints, for node loss (test_memory_replica.py).

Each step ``s``: an all-reduce of ``rank + 1`` gives ``c``, then
``w = w * 0.5 + c * (rank + 1) + s`` (float64, exact to replay, and different
on every rank: a rank given another rank's state is caught), saved with
``MemoryCheckpoint.save`` every step, marked for the neighbour's replica every
``MEM_REPLICATE`` steps (and for the disk every ``MEM_PERSIST`` steps into
``MEM_DIR``/rank-<rank>, when set). On start every rank loads with
``MemoryCheckpoint.load`` and appends ``{"node", "rank", "step", "world",
"w_ok"}`` to ``loaded.jsonl`` in ``ELASTIC_TEST_DIR`` (``w_ok``: the state
loaded is the one this rank had at that step). Each step appends
``{"node", "rank", "step", "world", "pid"}`` to ``steps.jsonl``. At step
``MEM_HOLD_AT`` each rank waits (at most 120 s) until the file ``go``
exists; the job ends at step ``MEM_STEPS``, or at the first step after the
file ``MEM_STOP`` names exists there (when set; agreed by the ranks).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastrun.train import MemoryCheckpoint


def replay(rank: int, world: int, steps: int) -> torch.Tensor:
    w = torch.zeros(64, dtype=torch.float64)
    c = sum(r + 1 for r in range(world))
    for s in range(1, steps + 1):
        w = w * 0.5 + c * (rank + 1) + s
    return w


def append(path: Path, record: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(os.environ["ELASTIC_TEST_DIR"])
    node = os.environ["ELASTIC_TEST_NODE"]
    steps = int(os.environ["MEM_STEPS"])
    hold_at = int(os.environ.get("MEM_HOLD_AT", "-1"))
    stop = os.environ.get("MEM_STOP")
    base = os.environ.get("MEM_DIR")
    mem = MemoryCheckpoint(
        os.path.join(base, f"rank-{rank}") if base else None,  # a state per rank
        persist_every=int(os.environ.get("MEM_PERSIST", "0")),
        replicate_every=int(os.environ.get("MEM_REPLICATE", "0")),
    )
    state = mem.load()
    step = 0 if state is None else int(state["step"])
    w = replay(rank, world, 0) if state is None else state["w"]
    ok = bool(torch.equal(w, replay(rank, world, step)))
    append(
        out / "loaded.jsonl", {"node": node, "rank": rank, "step": step, "world": world, "w_ok": ok}
    )
    while step < steps:
        step += 1
        c = torch.full((1,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(c)
        w = w * 0.5 + float(c) * (rank + 1) + step
        mem.save({"step": step, "w": w}, step=step)
        append(
            out / "steps.jsonl",
            {"node": node, "rank": rank, "step": step, "world": world, "pid": os.getpid()},
        )
        time.sleep(0.05)
        if step == hold_at:
            deadline = time.monotonic() + 120
            while not (out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if stop:
            seen = torch.tensor([float((out / stop).exists())])
            dist.all_reduce(seen)
            if seen.item() > 0:
                break
    mem.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
