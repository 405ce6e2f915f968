"""Worker: gloo all-reduce over env://, then records its environment.

Usage: gloo_env.py OUTDIR [--crash-rank R --crash-restart C] [--hold]
Writes OUTDIR/<pid>.json with the torchrun environment variables and the all-reduce
result. --crash-rank: rank R raises when TORCHELASTIC_RESTART_COUNT == C.
--hold: after writing, waits until OUTDIR/release exists.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

VARS = [
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "PYTHON_EXEC",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "EXTRA_FROM_SPEC",
]


def main() -> None:
    outdir = sys.argv[1]
    args = sys.argv[2:]
    dist.init_process_group("gloo")  # init_method env:// by default
    rank = dist.get_rank()
    if "--crash-rank" in args:
        crash_rank = int(args[args.index("--crash-rank") + 1])
        crash_restart = args[args.index("--crash-restart") + 1]
        if rank == crash_rank and os.environ["TORCHELASTIC_RESTART_COUNT"] == crash_restart:
            raise RuntimeError(f"planned crash on rank {rank}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    record: dict[str, object] = {v: os.environ.get(v) for v in VARS}
    record.update(
        pid=os.getpid(), allreduce=t.item(), dist_rank=rank, dist_world=dist.get_world_size()
    )
    tmp = os.path.join(outdir, f".{os.getpid()}.tmp")
    with open(tmp, "w") as fp:
        json.dump(record, fp)
    os.replace(tmp, os.path.join(outdir, f"{os.getpid()}.json"))
    print(f"hello from rank {rank}", flush=True)
    if "--hold" in args:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(outdir, "release")):
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
