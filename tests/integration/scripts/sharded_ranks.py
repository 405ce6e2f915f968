"""Ranks with a sharded state (gloo on CPU), for test_sharded_checkpoint.py.

``python sharded_ranks.py BASE`` reads one ``PHASE WORLD PORT`` line at a
time from its stdin (until it ends) and runs WORLD ranks for it (processes of
``torch.multiprocessing``, forked: the phases share this process' imports,
torch's once in all), each with its memory checkpoint folder
``BASE/mem/r<rank>`` and its disk folder ``BASE/ckpt/rank-<rank>``; once the
ranks are done it writes ``BASE/<phase>.done``: ``ok``, or why it failed.

* ``save``: an FSDP2 model (``fully_shard`` on the world's mesh) after one
  Adam step, and two DTensors (``Shard(0)`` and ``Replicate()``), saved at
  step 7 with ``persist=True``; rank 0 writes the full tensors to
  ``BASE/ref.pt`` (the reference);
* ``restore``: a fresh model (another seed) loads the memory checkpoint,
  then the disk checkpoints (``load_checkpoint``);
* ``reshard``: at another world size: the memory checkpoint (falls back to
  the disk checkpoints, which are refused), then ``BASE/dcp`` with
  ``torch.distributed.checkpoint.load`` into this world's model.

Each rank writes what it saw to ``BASE/<phase>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.multiprocessing.spawn import start_processes


def build(world: int, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    g = torch.Generator().manual_seed(seed + 1)
    extra = {
        "rows": distribute_tensor(torch.randn(7, 3, generator=g), mesh, [Shard(0)]),
        "cols": distribute_tensor(torch.randn(2, 5, generator=g), mesh, [Shard(1)]),
        "bias": distribute_tensor(torch.randn(4, generator=g), mesh, [Replicate()]),
    }
    return model, opt, extra


def full(state: dict[str, Any]) -> dict[str, Any]:
    """Each DTensor's global tensor (collective), by a flat key."""
    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, DTensor):
            out[prefix] = obj.full_tensor()
        elif isinstance(obj, torch.Tensor):
            out[prefix] = obj.clone()

    walk("", state)
    return out


def state_of(model: Any, opt: Any, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict(), "extra": extra, "step": 7}


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys where ``a`` and ``b`` differ."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k])]


def kinds(state: dict[str, Any]) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in state["model"].items()} | {
        f"extra/{k}": f"{type(v).__name__}{list(getattr(v, 'placements', []))}"
        for k, v in state["extra"].items()
    }


def run(rank: int, phase: str, world: int, base: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ["ELASTRUN_MEMORY_CHECKPOINT_DIR"] = os.path.join(base, "mem", f"r{rank}")
    os.makedirs(os.environ["ELASTRUN_MEMORY_CHECKPOINT_DIR"], exist_ok=True)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from elastrun.errors import ConfigError
    from elastrun.train import MemoryCheckpoint, load_checkpoint

    ckpt = os.path.join(base, "ckpt", f"rank-{rank}")
    lines: list[str] = []
    seen: dict[str, Any] = {"rank": rank}
    if phase == "save":
        model, opt, extra = build(world, seed=1)
        mem = MemoryCheckpoint(ckpt, log=lines.append)
        state = state_of(model, opt, extra)
        mem.save(state, step=7, persist=True)
        mem.close()
        ref = full(state)
        if rank == 0:
            torch.save(ref, os.path.join(base, "ref.pt"))
        seen["local"] = {k: list(v.to_local().shape) for k, v in state["model"].items()}
    elif phase == "restore":
        ref = torch.load(os.path.join(base, "ref.pt"), weights_only=True)
        model, opt, extra = build(world, seed=2)
        for source in ("memory", "disk"):
            if source == "memory":
                got = MemoryCheckpoint(ckpt, log=lines.append).load()
            else:
                got = load_checkpoint(ckpt, log=lines.append)
            assert got is not None
            seen[f"{source}_kinds"] = kinds(got)
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["opt"])
            seen[f"{source}_differs"] = same(full(state_of(model, opt, got["extra"])), ref)
    else:  # reshard, at another world size
        ref = torch.load(os.path.join(base, "ref.pt"), weights_only=True)
        model, opt, extra = build(world, seed=2)
        try:  # the memory checkpoint falls back to the disk, which refuses
            seen["loaded"] = MemoryCheckpoint(ckpt, log=lines.append).load() is not None
        except ConfigError as e:
            seen["disk_error"] = str(e)
        from torch.distributed.checkpoint.state_dict_loader import load

        target = state_of(model, opt, extra)
        load(target, checkpoint_id=os.path.join(base, "dcp"))
        model.load_state_dict(target["model"])
        opt.load_state_dict(target["opt"])
        seen["dcp_differs"] = same(full(state_of(model, opt, target["extra"])), ref)
    seen["lines"] = lines
    with open(os.path.join(base, f"{phase}-{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def serve(base: str) -> None:
    for line in sys.stdin:
        phase, world, port = line.split()
        try:
            # forked: the ranks share this process' imports (torch once, not once per rank)
            start_processes(
                run,
                args=(phase, int(world), base, int(port)),
                nprocs=int(world),
                start_method="fork",
            )
            said = "ok"
        except Exception:
            said = traceback.format_exc()
        done = os.path.join(base, f"{phase}.done")
        with open(done + ".tmp", "w") as f:
            f.write(said)
        os.replace(done + ".tmp", done)  # whole, for the test that waits for it


if __name__ == "__main__":
    serve(sys.argv[1])
