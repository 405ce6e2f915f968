"""The training script both launchers run in the benchmarks.

By default (``BENCH_WORKLOAD=realistic``) it does what users' training
scripts do: it imports torch and its training modules at the top, joins a
gloo process group, builds a small MLP under ``DistributedDataParallel``, a
``torch.optim`` optimizer (SGD with momentum), a ``DataLoader`` over a
synthetic data set with a ``DistributedSampler``, loads the newest checkpoint
(model, optimizer and step, ``torch.load``) if there is one, and trains,
saving a checkpoint (``torch.save``, atomically) every few steps from rank 0.
``BENCH_WORKLOAD=floor`` is the trivial worker (no model, no optimizer, no data
loader: an all-reduce per step and a JSON step file): a labelled floor, never
the measure of a claim.

It writes one JSON line per event to the file named by ``$BENCH_EVENTS``
(``O_APPEND`` writes of one short line each, so many processes can share the
file). Times ``t`` are ``time.monotonic()``: CLOCK_MONOTONIC is one clock for
every process of a machine, and unlike the wall clock it never steps (``wall``
is for humans).

Events (``ev``): ``start`` (first thing the script does, before importing
torch; in a warm interpreter torch may be imported already), ``imported``
(the script's imports done), ``pg_ready`` (gloo process group up), ``resume``
(model, optimizer and data ready, checkpoint loaded: the step it resumes
from), ``step`` (after each step: forward, backward with DDP's all-reduce,
optimizer step, and the stop all-reduce), ``exit``. Every event carries ``t``,
``pid``, ``rank``, ``local_rank``, ``world``, ``node`` (``$BENCH_NODE``) and
``restart`` (``$TORCHELASTIC_RESTART_COUNT``); steps carry ``step``.

Environment:
  BENCH_EVENTS         events file (required)
  BENCH_DIR            checkpoint and control files (default: the events file's folder)
  BENCH_TARGET_STEP    stop after this step (0: run until the stop file appears)
  BENCH_STEP_INTERVAL  seconds from one step's start to the next (default 0.15)
  BENCH_MODE           ``train`` (default) or ``trivial`` (log ``start`` and exit 0,
                       for rendezvous timing)
  BENCH_WORKLOAD       ``realistic`` (default) or ``floor``
  BENCH_CKPT_EVERY     steps between checkpoints (default 5)
  BENCH_LOADER_WORKERS DataLoader worker processes (default 0)
  BENCH_NODE           a name for the node (agent) this worker runs under
  BENCH_FAULT          (realistic workload) ``bug``: rank BENCH_FAULT_RANK (default 1)
                       raises ValueError at global step BENCH_FAULT_STEP (default 8), every
                       time it gets there (a deterministic bug); ``bad_node``: the ranks of
                       node BENCH_FAULT_NODE raise a CUDA-like RuntimeError 3 + restart
                       steps after every start, once BENCH_DIR/faults_on exists (a failing GPU)

The group stops together: the stop decision travels in each step's all-reduce.
"""

import time

T_START = time.monotonic()

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

EVENTS = os.environ["BENCH_EVENTS"]
DIR = Path(os.environ.get("BENCH_DIR") or os.path.dirname(os.path.abspath(EVENTS)))
TARGET = int(os.environ.get("BENCH_TARGET_STEP", "0"))
INTERVAL = float(os.environ.get("BENCH_STEP_INTERVAL", "0.15"))
MODE = os.environ.get("BENCH_MODE", "train")
WORKLOAD = os.environ.get("BENCH_WORKLOAD", "realistic")
CKPT_EVERY = max(1, int(os.environ.get("BENCH_CKPT_EVERY", "5")))
LOADER_WORKERS = int(os.environ.get("BENCH_LOADER_WORKERS", "0"))
STOP_FILE = DIR / "stop"


def _env_int(name: str, default: int = -1) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


BASE: dict[str, object] = {
    "pid": os.getpid(),
    "rank": _env_int("RANK"),
    "local_rank": _env_int("LOCAL_RANK"),
    "world": _env_int("WORLD_SIZE"),
    "group_rank": _env_int("GROUP_RANK"),
    "node": os.environ.get("BENCH_NODE", ""),
    "restart": _env_int("TORCHELASTIC_RESTART_COUNT", 0),
}


def emit(ev: str, t: float | None = None, **fields: object) -> None:
    record = {
        "ev": ev,
        "t": time.monotonic() if t is None else t,
        "wall": time.time(),
        **BASE,
        **fields,
    }
    fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def stop_now(step: int, rank: int) -> bool:
    return rank == 0 and ((TARGET > 0 and step + 1 >= TARGET) or STOP_FILE.exists())


def pace(t_step: float) -> None:
    left = INTERVAL - (time.monotonic() - t_step)
    if left > 0:
        time.sleep(left)


# --------------------------------------------------------------------------- floor


def floor_main() -> None:
    """The trivial worker: an all-reduce per step, the step number in a JSON file."""
    import torch
    import torch.distributed as dist

    ckpt = DIR / "ckpt.json"
    emit("imported")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    BASE["rank"], BASE["world"] = rank, dist.get_world_size()
    emit("pg_ready")
    try:
        saved = int(json.loads(ckpt.read_text())["step"]) if rank == 0 else 0
    except (FileNotFoundError, ValueError, KeyError):
        saved = 0
    start = torch.tensor([saved])
    dist.broadcast(start, 0)
    step = int(start.item())
    emit("resume", step=step)
    while True:
        t_step = time.monotonic()
        flags = torch.tensor([1.0, 1.0 if stop_now(step, rank) else 0.0])
        dist.all_reduce(flags)
        step += 1
        emit("step", step=step)
        if rank == 0:
            tmp = DIR / f"ckpt.json.tmp{os.getpid()}"
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ckpt)
        if flags[1].item() > 0:
            break
        pace(t_step)
    emit("exit", step=step)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- realistic


def realistic_main() -> None:
    # What a training script imports at its top.
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    emit("imported")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    BASE["rank"], BASE["world"] = rank, world
    emit("pg_ready")

    torch.manual_seed(0)
    features = torch.randn(4096, 64)
    labels = (features[:, :8].sum(dim=1) > 0).long()
    data = TensorDataset(features, labels)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    loader = DataLoader(
        data,
        batch_size=32,
        sampler=sampler,
        num_workers=LOADER_WORKERS,
        persistent_workers=LOADER_WORKERS > 0,
    )
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = DIR / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    emit("resume", step=step)

    started_at = step
    epoch = step * 32 * world // len(data)
    sampler.set_epoch(epoch)
    batches = iter(loader)
    while True:
        t_step = time.monotonic()
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            x, y = next(batches)
        inject_fault(rank, step, step - started_at)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        flags = torch.tensor([1.0 if stop_now(step, rank) else 0.0])
        dist.all_reduce(flags)
        step += 1
        emit("step", step=step, loss=round(float(loss.item()), 4))
        if rank == 0 and step % CKPT_EVERY == 0:
            tmp = DIR / f"ckpt.pt.tmp{os.getpid()}"
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
            }
            torch.save(state, tmp)
            os.replace(tmp, ckpt)
        if flags[0].item() > 0:
            break
        pace(t_step)
    emit("exit", step=step)
    dist.destroy_process_group()


def inject_fault(rank: int, step: int, local: int) -> None:
    """``BENCH_FAULT``'s failure, when its time has come (see the docstring)."""
    fault = os.environ.get("BENCH_FAULT", "")
    bug_rank = int(os.environ.get("BENCH_FAULT_RANK", "1"))
    if fault == "bug" and rank == bug_rank and step == int(os.environ.get("BENCH_FAULT_STEP", "8")):
        raise ValueError("bad batch")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    bad = os.environ.get("BENCH_NODE") == os.environ.get("BENCH_FAULT_NODE")
    armed = (DIR / "faults_on").exists()  # the bad node fails once the benchmark says so
    if fault == "bad_node" and bad and armed and local >= 3 + restart:
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")


def main() -> None:
    emit("start", t=T_START, workload=WORKLOAD)
    if MODE == "trivial":
        emit("exit")
        return
    if WORKLOAD == "floor":
        floor_main()
    else:
        realistic_main()


if __name__ == "__main__":
    main()
