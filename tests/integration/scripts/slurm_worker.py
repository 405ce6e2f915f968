"""Worker for the SLURM recipe test: gloo all-reduce steps until the file ``finish`` appears.

Every step appends a JSON line to ``$SLURM_TEST_DIR/steps.jsonl`` (rank, world, group rank,
run id, the SLURM node it runs on, pid). SIGUSR1 (what SLURM's ``--signal=USR1@T`` sends, and
elastrun forwards when ``--signals-to-handle`` lists it) is answered by a ``usr1`` line: a real
script would save a checkpoint there and train on.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

DIR = Path(os.environ["SLURM_TEST_DIR"])
MAX_STEPS = 3000  # bounded: 0.05 s a step, a few minutes at most
pending: list[int] = []


def log(record: dict[str, object]) -> None:
    fd = os.open(DIR / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    signal.signal(signal.SIGUSR1, lambda signum, frame: pending.append(signum))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    me = {
        "rank": rank,
        "world": world,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        "slurm_node": os.environ.get("SLURM_NODEID"),
        "pid": os.getpid(),
    }
    for step in range(1, MAX_STEPS + 1):
        stop = torch.tensor([1 if (DIR / "finish").exists() else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        while pending:
            pending.pop()
            log({**me, "step": step, "usr1": True})
        log({**me, "step": step})
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
