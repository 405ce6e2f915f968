"""A training-like worker with memory checkpoints (test_memory_checkpoint.py).

Each step ``s`` (1..``MEM_STEPS``): an all-reduce of ``rank + 1`` gives ``c``,
then ``w = w * 0.5 + c + s`` (float64, exact to replay), and every rank saves
``{"step", "w", "rank"}`` with ``MemoryCheckpoint.save`` (to disk every
``MEM_PERSIST`` steps, from local rank 0 only, into ``MEM_DIR``; no disk at
all without ``MEM_DIR``). On start every rank calls ``MemoryCheckpoint.load``
and resumes from what it returns. With ``MEM_SHARED=1`` only rank 0 saves
(the state is the same on every rank), with ``MEM_SHARED=all`` every rank
does; both load with ``shared=True``. ``MEM_STEP_DELAY``: seconds of sleep
per step; ``MEM_PROGRESS``: a file each rank appends its steps to.

In the first attempt only, at step ``MEM_CRASH_AT``, once every rank has
committed that step, the last local rank SIGKILLs itself. With
``MEM_KILL_MID_COPY``, it instead starts saving a state of that many MiB
and SIGKILLs itself from another thread while the copy runs.

Rank 0 prints ``RESULT {"step", "w", "resumed_from", "restarts", "source"}``
and each rank ``LOADED {"rank", "step"}`` for the state it loaded.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from elastrun.train import MemoryCheckpoint, context


def kill_mid_copy(mem: MemoryCheckpoint, step: int, w: torch.Tensor, mib: int) -> None:
    big = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    slots = [n for n in os.listdir(os.environ["ELASTRUN_MEMORY_CHECKPOINT_DIR"]) if "slot" in n]

    folder = os.environ["ELASTRUN_MEMORY_CHECKPOINT_DIR"]

    def killer() -> None:
        # Once a slot has grown to hold the big state, the copy into it runs.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sizes = [os.stat(os.path.join(folder, n)).st_size for n in os.listdir(folder)]
            if max(sizes) >= big.numel() * 4:
                break
            time.sleep(0.001)
        time.sleep(0.005)
        print(f"[test] SIGKILL mid-copy at step {step + 1}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    print(f"[test] slots before the killed save: {sorted(slots)}", flush=True)
    threading.Thread(target=killer).start()
    mem.save({"step": step + 1, "w": w, "big": big}, step=step + 1)
    time.sleep(30)  # the copy finished first: the killer still comes


def main() -> None:
    ctx = context()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory = os.environ.get("MEM_DIR") or None
    steps = int(os.environ["MEM_STEPS"])
    crash_at = int(os.environ.get("MEM_CRASH_AT", "-1"))
    mid_copy = int(os.environ.get("MEM_KILL_MID_COPY", "0"))
    every = int(os.environ.get("MEM_PERSIST", "0"))
    last_local = ctx.local_rank == ctx.local_world_size - 1

    # "1": only rank 0 saves, as Lightning does; "all": every rank saves; both load shared
    shared = os.environ.get("MEM_SHARED") in ("1", "all")
    only_rank0 = os.environ.get("MEM_SHARED") == "1"
    delay = float(os.environ.get("MEM_STEP_DELAY", "0"))
    progress = os.environ.get("MEM_PROGRESS")
    mem = MemoryCheckpoint(directory, persist_every=every if ctx.local_rank == 0 else 0)
    state = mem.load(shared=shared)
    step = 0 if state is None else int(state["step"])
    world = dist.get_world_size()
    loaded = {"rank": rank, "step": step, "world": world, "restart": ctx.restart_count}
    print(f"LOADED {json.dumps(loaded)}", flush=True)
    w = torch.zeros(256, dtype=torch.float64) if state is None else state["w"]
    resumed_from = step
    while step < steps:
        step += 1
        c = torch.full((256,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(c)
        w = w * 0.5 + c + step
        if rank == 0 or not only_rank0:
            mem.save({"step": step, "w": w}, step=step)
        if progress:
            with open(progress, "a") as f:
                f.write(json.dumps({**loaded, "step": step}) + "\n")
        time.sleep(delay)
        if ctx.restart_count == 0 and step == crash_at:
            mem.wait()
            dist.barrier()  # every rank committed this step
            if last_local and mid_copy:
                kill_mid_copy(mem, step, w, mid_copy)
            elif last_local:
                print(f"[test] rank {rank} SIGKILLs itself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the others wait to be stopped
    mem.close()
    if rank == 0:
        result = {
            "step": step,
            "w": float(w[0]),
            "resumed_from": resumed_from,
            "restarts": ctx.restart_count,
        }
        print(f"RESULT {json.dumps(result)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
