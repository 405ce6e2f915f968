"""``elastrun checkpoint-convert``: the ranks' disk checkpoints of a sharded
state put together, for tools that do not know elastrun.

A memory checkpoint of a sharded state (DTensors: FSDP2, tensor parallelism)
is written to disk by each rank's agent as that rank's ``ckpt-<step>.pt``: a
``torch.save`` file that holds the rank's *local* shards
(:mod:`elastrun.worker.torch_file`). Given one such file per rank (any
order), this command puts each DTensor's shards together into its global
tensor (each shard's place from its layout:
:func:`~elastrun.worker.shard_layout.shard_slices`) and writes the state:

* ``--format dcp`` (default): a ``torch.distributed.checkpoint`` folder
  (``dcp.save(..., no_dist=True)``). ``dcp.load`` reads it into a state dict
  of DTensors at any world size and mesh: it reshards;
* ``--format torch``: one ``torch.save`` file of plain tensors, which
  ``torch.load(weights_only=True)`` reads (an export, an evaluation).

Values that are not DTensors (a step count, plain tensors) are taken from the
lowest rank's file. Every rank's file must be of the same step and world, and
every shard of every DTensor must be there (a missing rank is named).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from elastrun.errors import ConfigError
from elastrun.train.sharded import LocalShard, shard_leaves
from elastrun.worker.shard_layout import shard_slices

__all__ = ["assemble", "convert", "main"]


def _read(path: Path) -> tuple[dict[str, Any], int, int]:
    """A rank's disk checkpoint: its state (LocalShards in place), the rank
    that saved it and its world size."""
    import io

    import torch

    from elastrun.train.sharded import with_layouts
    from elastrun.train.state_codec import decode
    from elastrun.worker.snapshot import SnapshotError, header_of
    from elastrun.worker.torch_file import header_record

    data = path.read_bytes()
    try:
        snap = header_of(data)  # a disk copy written before the torch format
        if snap is not None:
            header, start = snap
            state = decode(header, memoryview(data)[start : start + header.data_size])
        else:
            found = header_record(data)
            if found is None:
                raise ConfigError(
                    f"{path} is not a memory checkpoint written by elastrun's agent (no "
                    "snapshot header in it): it needs no conversion, torch.load reads it"
                )
            header = found
            plain = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            state = with_layouts(plain, header)
    except (SnapshotError, RuntimeError, ValueError, KeyError, EOFError) as e:
        raise ConfigError(f"{path} is damaged: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state, header.rank, header.world_size


def assemble(states: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The lowest rank's state with each DTensor's shards (from every rank's
    state: rank -> state) put together into its global tensor."""
    import torch

    first = min(states)
    shards: dict[str, dict[int, LocalShard]] = {}
    for rank, state in states.items():
        for _, _, s in shard_leaves(state):
            shards.setdefault(s.key, {})[rank] = s
    out = states[first]
    for parent, k, s in shard_leaves(out):
        lay = s.layout
        full = torch.empty(lay.shape, dtype=s.tensor.dtype)
        placed: set[tuple[tuple[int, int], ...]] = set()
        covered = 0
        for r in lay.mesh:
            held = shards[s.key].get(r)
            if held is None:
                continue
            where = shard_slices(lay, r)
            assert where is not None
            if tuple(held.tensor.shape) != tuple(n for _, n in where):
                raise ConfigError(
                    f"{s.key}: rank {r}'s shard is {tuple(held.tensor.shape)}, and its layout "
                    f"places {tuple(n for _, n in where)}"
                )
            if tuple(where) in placed:
                continue  # a replica of a shard already placed
            placed.add(tuple(where))
            index = tuple(slice(a, a + n) for a, n in where)
            full[index] = held.tensor
            volume = 1
            for _, n in where:
                volume *= n
            covered += volume
        if covered != full.numel():
            missing = sorted(set(lay.mesh) - set(shards[s.key]))
            raise ConfigError(
                f"{s.key}: its shards do not cover the whole tensor: the files of rank(s) "
                f"{missing} are missing"
            )
        parent[k] = full
    return out


def convert(files: list[Path], out: Path, fmt: str) -> str:
    """Convert (see the module doc); the line that says what was written."""
    import torch

    states: dict[int, dict[str, Any]] = {}
    worlds = set()
    for path in files:
        state, rank, world = _read(path)
        if rank in states:
            raise ConfigError(f"{path}: rank {rank} is given twice")
        states[rank] = state
        worlds.add(world)
    if len(worlds) != 1:
        raise ConfigError(f"the files are of different world sizes ({sorted(worlds)})")
    steps = {s.get("step") for s in states.values() if isinstance(s, dict)}
    if len(steps) > 1:
        raise ConfigError(f"the files hold different steps ({sorted(map(str, steps))})")
    state = assemble(states)
    if fmt == "torch":
        torch.save(state, out)
    else:
        import warnings

        from torch.distributed.checkpoint.state_dict_saver import save

        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            save(state, checkpoint_id=str(out), no_dist=True)
    world = worlds.pop()
    return f"=> wrote {out} ({fmt}): the shards of {len(states)} rank(s) of a world of {world}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="elastrun checkpoint-convert",
        description="Put the ranks' disk checkpoints of a sharded state (DTensors) together: "
        "a torch.distributed.checkpoint folder (loads and reshards at any world size) or "
        "one torch.save file of plain tensors.",
    )
    parser.add_argument("out", type=Path, help="the folder (dcp) or file (torch) to write")
    parser.add_argument("files", type=Path, nargs="+", help="one ckpt-<step>.pt per rank")
    parser.add_argument("--format", choices=("dcp", "torch"), default="dcp")
    args = parser.parse_args(argv)
    try:
        print(convert(args.files, args.out, args.format))
    except (ConfigError, OSError) as e:
        print(f"elastrun checkpoint-convert: {e}", file=sys.stderr)
        return 1
    return 0
