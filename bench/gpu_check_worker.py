"""The worker of ``python -m bench.gpu_check`` (run by elastrun, one per GPU).

``GPUCHECK_MODE``:

* ``memckpt``: a state of ``GPUCHECK_GB`` GiB per rank on its device, saved
  into a :class:`~elastrun.train.MemoryCheckpoint` every step for
  ``GPUCHECK_STEPS`` steps; in the first attempt the last rank SIGKILLs itself
  after the save of step ``GPUCHECK_KILL_AT``, and the restarted ranks load
  the state back from memory.
* ``peer``: an all-reduce every step over the process group (NCCL on GPUs);
  in the first attempt the last rank SIGKILLs itself at step
  ``GPUCHECK_KILL_AT`` while the others are in the collective.

Each rank prints one ``GPUCHECK {json}`` line per attempt (what the driver's
table reads): its attempt, rank, the first and last step, and the times
(``first_step_at``: the wall clock at its first step, as the event log's).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastrun.train import MemoryCheckpoint

PREFIX = "GPUCHECK "


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Setup:
    """What one rank runs, from its environment."""

    device: torch.device
    steps: int
    kill_at: int
    gb: float
    attempt: int
    rank: int
    world: int

    def killed_at(self, step: int) -> bool:
        """Whether this rank dies at ``step`` (the last rank, first attempt)."""
        return self.attempt == 0 and step == self.kill_at and self.rank == self.world - 1


def main() -> None:
    mode = os.environ.get("GPUCHECK_MODE", "memckpt")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = os.environ.get("GPUCHECK_DEVICE", "cuda") == "cuda"
    run = Setup(
        device=torch.device("cuda", local) if cuda else torch.device("cpu"),
        steps=int(os.environ.get("GPUCHECK_STEPS", "6")),
        kill_at=int(os.environ.get("GPUCHECK_KILL_AT", "3")),
        gb=float(os.environ.get("GPUCHECK_GB", "1")),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
    )
    if cuda:
        torch.cuda.set_device(run.device)
    t0 = time.perf_counter()
    dist.init_process_group("nccl" if cuda else "gloo", device_id=run.device if cuda else None)
    record: dict[str, object] = {"mode": mode, "attempt": run.attempt, "rank": run.rank}
    record["world"] = run.world
    record["init_s"] = round(time.perf_counter() - t0, 3)
    if mode == "peer":
        _peer(run, record)
    else:
        _memckpt(run, record)
    print(PREFIX + json.dumps(record), flush=True)
    dist.destroy_process_group()


def _memckpt(run: Setup, record: dict[str, object]) -> None:
    device = run.device
    state: dict[str, Any] = {"w": torch.zeros(int(run.gb * 2**30) // 4, device=device), "step": -1}
    mem = MemoryCheckpoint(slots=2)
    t = time.perf_counter()
    got = mem.load(map_location=device)
    _sync(device)
    record["load_s"] = round(time.perf_counter() - t, 3)
    record["in_memory"] = mem.in_memory
    if got is not None:
        state = got
    first = int(state["step"]) + 1
    record["first_step"] = first
    blocked, committed = [], []
    record["first_step_at"] = time.time()  # the restart's end, for the driver's gap
    tick = torch.ones(1, device=device)
    for step in range(first, run.steps):
        # The training step's stand-in: a collective keeps the ranks in step
        # (no rank saves a step another never reaches), and the state changes.
        dist.all_reduce(tick)
        state["w"].add_(1.0)
        state["step"] = step
        _sync(device)
        t = time.perf_counter()
        mem.save(state, step=step)
        blocked.append(time.perf_counter() - t)
        t = time.perf_counter()
        mem.wait()
        committed.append(time.perf_counter() - t)
        if run.killed_at(step):
            os.kill(os.getpid(), signal.SIGKILL)
    if blocked:
        record["save_blocked_median_s"] = round(statistics.median(blocked), 3)
        record["save_blocked_max_s"] = round(max(blocked), 3)
        record["commit_median_s"] = round(statistics.median(committed), 3)
    record["last_step"] = run.steps - 1
    mem.close()


def _peer(run: Setup, record: dict[str, object]) -> None:
    t = torch.ones(1 << 20, device=run.device)
    record["first_step_at"] = time.time()
    for step in range(run.steps):
        if run.killed_at(step):
            os.kill(os.getpid(), signal.SIGKILL)  # the others are in (or enter) the all-reduce
        dist.all_reduce(t)
        _sync(run.device)
    record["first_step"] = 0
    record["last_step"] = run.steps - 1


if __name__ == "__main__":
    main()
