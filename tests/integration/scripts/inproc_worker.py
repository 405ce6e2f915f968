"""A worker for the in-process restart tests (tests/faults/test_in_process_random.py).

Trains in ``elastrun.train.in_process``: each entry joins the round's process
group, gathers every member's (round, pid, rank) over the group itself and
appends what it saw to ``$ELASTIC_TEST_DIR/views.jsonl``, then runs a few
all-reduce steps. ``INPROC_PLAN`` (JSON, one entry per restart count:
``{"rank": r, "how": "kill" | "raise" | "hang", "step": s}``) says which
rank fails, how and at which step, in the run of that restart count (``hang``:
it sleeps, out of any collective, until the hang watchdog declares it).
An entry's ``"stuck": r2``: at that step, rank ``r2`` waits in the group's
store for a key no rank sets (a wait no process group abort ends).
``INPROC_UNTIL`` (a path): after the steps, more steps until that file exists
(the ranks agree on it over the group).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from elastrun.train import current_round, heartbeat, in_process

OUT = os.path.join(os.environ["ELASTIC_TEST_DIR"], "views.jsonl")
PLAN = json.loads(os.environ.get("INPROC_PLAN", "[]"))
STEPS = int(os.environ.get("INPROC_STEPS", "6"))
UNTIL = os.environ.get("INPROC_UNTIL")


def record(line: dict[str, object]) -> None:
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


record({"setup": os.getpid()})  # once per process


def until_exists(path: str) -> bool:
    """Whether ``path`` exists on any rank (every rank learns the same)."""
    flag = torch.tensor([int(os.path.exists(path))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@in_process
def train() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    r = current_round()
    me = torch.tensor([-1 if r is None else r, os.getpid(), rank], dtype=torch.int64)
    views = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(views, me)
    record(
        {
            "round": r,
            "restarts": restarts,
            "pid": os.getpid(),
            "rank": rank,
            "members": [v.tolist() for v in views],
        }
    )
    fault = PLAN[restarts] if restarts < len(PLAN) else None
    for step in itertools.count():
        if step >= STEPS and (UNTIL is None or until_exists(UNTIL)):
            break
        t = torch.ones(1)
        dist.all_reduce(t)
        heartbeat(step + 1)
        if fault is not None and fault.get("stuck") == rank and fault["step"] == step:
            record({"stuck": os.getpid(), "rank": rank, "round": r})
            dist.distributed_c10d._get_default_store().get("never-set")
        if fault is not None and fault["rank"] == rank and fault["step"] == step:
            record({"fault": fault["how"], "pid": os.getpid(), "rank": rank, "round": r})
            if fault["how"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault["how"] == "hang":
                time.sleep(3600)
            raise ValueError(f"injected at step {step}")
        time.sleep(0.05)
    dist.destroy_process_group()


train()
