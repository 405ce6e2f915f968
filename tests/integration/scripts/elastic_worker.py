"""A real elastic training-like worker for end-to-end tests.

Each step: a gloo all-reduce across the world, then rank 0 checkpoints the
step number atomically. Every step appends one JSON line to
``$ELASTIC_TEST_DIR/steps.jsonl`` (rank, world size, step, restart count,
group rank, pid, wall-clock time). Control files in that directory:
  crash_rank_<R>  worker with global rank R exits 1 at its next step (file removed);
                  if the file holds "exception" it raises instead, if it holds a
                  signal name ("SIGSEGV", "SIGKILL"...) it sends itself that signal
  crash_node_<N>  the worker on node N (its ``ELASTIC_TEST_NODE``) fails at its next
                  step (file removed): "exit <code>" exits with that code, "raise <text>"
                  raises RuntimeError(text); it first appends what it does, with its pid,
                  to ``injected.jsonl`` (a checker matches failures to injections)
  finish          the group stops after the current step and exits 0

``FAULT_MODE`` (fault attribution's tests; each step then also steps an
optimizer, the progress elastrun sees):
  bug       rank ``FAULT_RANK`` (default 1) raises ValueError at its 3rd step
            after every start (a deterministic bug)
  bad_node  the ranks on node ``FAULT_NODE`` (its ``ELASTIC_TEST_NODE``) raise
            a CUDA-like RuntimeError a few steps after every start (2 + the
            starts of that rank on that node before: never twice at the same
            step, whether or not a restart was counted)
  slow_node the ranks on node ``FAULT_NODE`` sleep ``SLOW_STEP_SLEEP`` (default
            0.4) s more in every step: a persistent straggler
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

DIR = Path(os.environ["ELASTIC_TEST_DIR"])
STEP_SLEEP = float(os.environ.get("ELASTIC_STEP_SLEEP", "0.2"))
FAULT_MODE = os.environ.get("FAULT_MODE", "")
NODE = os.environ.get("ELASTIC_TEST_NODE", "")


def log(record: dict[str, object]) -> None:
    line = json.dumps(record) + "\n"
    fd = os.open(DIR / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def load_step() -> int:
    try:
        return int(json.loads((DIR / "ckpt.json").read_text())["step"])
    except FileNotFoundError:
        return 0


def save_step(step: int) -> None:
    tmp = DIR / f"ckpt.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, DIR / "ckpt.json")


def starts_before(rank: int) -> int:
    """How many times this rank started on this node before (this start
    recorded): a restart excused by a membership change is not counted in
    ``TORCHELASTIC_RESTART_COUNT``, a start is."""
    fd = os.open(DIR / f"starts_{NODE}_{rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)
    return (DIR / f"starts_{NODE}_{rank}").stat().st_size - 1


def inject_fault(rank: int, local: int, before: int) -> None:
    """``FAULT_MODE``'s failure, when its time has come (``before``: this
    rank's earlier starts on this node)."""
    if FAULT_MODE == "bug" and rank == int(os.environ.get("FAULT_RANK", "1")) and local == 3:
        raise ValueError("bad batch")
    if FAULT_MODE == "bad_node" and os.environ.get("FAULT_NODE") == NODE and local == 2 + before:
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")


def node_crash() -> None:
    """The ``crash_node_<NODE>`` control file's failure, if it is there."""
    path = DIR / f"crash_node_{NODE}"
    try:
        how = path.read_text().strip()
        path.unlink()
    except FileNotFoundError:
        return
    fd = os.open(DIR / "injected.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        record = {"node": NODE, "pid": os.getpid(), "how": how, "t": time.time()}
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)
    verb, _, arg = how.partition(" ")
    if verb == "raise":
        raise RuntimeError(arg)
    raise SystemExit(int(arg or 1))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    group_rank = int(os.environ["GROUP_RANK"])
    start = torch.tensor([load_step()])
    dist.broadcast(start, 0)
    step = int(start.item())
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1) if FAULT_MODE else None
    before = starts_before(rank) if FAULT_MODE == "bad_node" else 0
    local = 0  # steps since this worker started
    while True:
        inject_fault(rank, local, before)
        node_crash()
        crash = DIR / f"crash_rank_{rank}"
        if crash.exists():
            how = crash.read_text().strip()
            crash.unlink()
            if how == "exception":
                raise RuntimeError(f"injected failure on rank {rank}")
            if how.startswith("SIG"):
                os.kill(os.getpid(), signal.Signals[how])
                time.sleep(10)  # a caught or ignored signal falls through to exit 1
            raise SystemExit(1)
        finish = torch.tensor([1 if (rank == 0 and (DIR / "finish").exists()) else 0])
        dist.all_reduce(finish)
        if finish.item():
            break
        t = torch.ones(1)
        dist.all_reduce(t)
        assert int(t.item()) == world
        if opt is not None:
            (w * t).sum().backward()
            opt.step()
        local += 1
        step += 1
        if rank == 0:
            save_step(step)
        log(
            {
                "rank": rank,
                "world": world,
                "step": step,
                "restart": restart,
                "group_rank": group_rank,
                "pid": os.getpid(),
                "node": NODE,
                "t": time.time(),  # wall clock: one machine (namespaces share it)
            }
        )
        time.sleep(STEP_SLEEP)
        if FAULT_MODE == "slow_node" and os.environ.get("FAULT_NODE") == NODE:
            time.sleep(float(os.environ.get("SLOW_STEP_SLEEP", "0.4")))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
