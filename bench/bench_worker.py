"""The training script both launchers run in the benchmarks.

It writes one JSON line per event to the file named by ``$BENCH_EVENTS``
(``O_APPEND`` writes of one short line each, so many processes can share the
file). Times ``t`` are ``time.monotonic()``: CLOCK_MONOTONIC is one clock for every
process of a machine, and unlike the wall clock it never steps (``wall`` is for humans).

Events (``ev``): ``start`` (first thing the script does, before importing
torch; in a warm spare interpreter torch is imported already), ``imported``
(torch imported), ``pg_ready`` (gloo process group up),
``step`` (after each step's all-reduce), ``exit``. Every event carries ``t``,
``pid``, ``rank``, ``local_rank``, ``world``, ``restart``
(``$TORCHELASTIC_RESTART_COUNT``) and, for steps, ``step``.

Environment:
  BENCH_EVENTS         events file (required)
  BENCH_DIR            checkpoint and control files (default: the events file's folder)
  BENCH_TARGET_STEP    stop after this step (0: run until the stop file appears)
  BENCH_STEP_INTERVAL  seconds between steps (default 0.15)
  BENCH_MODE           ``train`` (default) or ``trivial`` (log ``start`` and exit 0,
                       for rendezvous timing)

Rank 0 checkpoints the step number atomically after every step, so a
restarted group continues where it stopped. The group stops together: the
stop decision travels in each step's all-reduce.
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
STOP_FILE = DIR / "stop"
CKPT = DIR / "ckpt.json"


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


def load_step() -> int:
    try:
        return int(json.loads(CKPT.read_text())["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def save_step(step: int) -> None:
    tmp = DIR / f"ckpt.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, CKPT)


def main() -> None:
    emit("start", t=T_START)
    if MODE == "trivial":
        emit("exit")
        return
    import torch
    import torch.distributed as dist

    emit("imported")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    BASE["rank"], BASE["world"] = rank, world
    emit("pg_ready")
    start = torch.tensor([load_step() if rank == 0 else 0])
    dist.broadcast(start, 0)
    step = int(start.item())
    emit("resume", step=step)
    while True:
        stop = rank == 0 and ((TARGET and step + 1 >= TARGET) or STOP_FILE.exists())
        flags = torch.tensor([1.0, 1.0 if stop else 0.0])
        dist.all_reduce(flags)
        step += 1
        emit("step", step=step)
        if rank == 0:
            save_step(step)
        if flags[1].item() > 0:
            break
        time.sleep(INTERVAL)
    emit("exit", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
