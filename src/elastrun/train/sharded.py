"""Sharded states in a memory checkpoint: each rank's local shards of its DTensors.

A ``DTensor`` (FSDP2's ``state_dict``, tensor parallelism) is saved as its
local shard (a plain tensor: ``to_local()``) with its
:class:`~elastrun.worker.shard_layout.ShardLayout`: the mesh, the placements
(``Shard(d)``, ``Replicate()``), the global shape and stride
(:func:`describe`, called by :func:`~elastrun.train.state_codec.flatten`). A
snapshot read back holds a :class:`LocalShard` in each such place
(:func:`~elastrun.train.state_codec.decode`), and :func:`finish` makes them
``DTensor`` again, on a mesh of the same ranks, once every rank agrees that
this can be done:

* before the ranks agree on a step, the snapshots of sharded states saved in
  a world of another size are set aside (:func:`usable`; rank 0 says so in
  one line): the shards of the old world are not redistributed in memory (a
  new world's shards need the lost ranks' too), so the ranks fall back to the
  disk checkpoints;
* each rank checks that the snapshot it loaded was saved by itself, in a world
  of the current size, on meshes that fit this world (:func:`finish`); a
  disk checkpoint of another world's shards is refused by a ConfigError that
  says how to convert it (``elastrun checkpoint-convert``,
  :mod:`elastrun.train.convert`, whose output ``torch.distributed.checkpoint``
  loads and reshards).

``ShardedTensor`` (torch's older sharded type, still in torch 2.13 and used by
FSDP1's ``SHARDED_STATE_DICT``) is refused by name: save it as a DTensor
(FSDP2, or FSDP1 with ``StateDictType.SHARDED_STATE_DICT`` and DTensor on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastrun.errors import ConfigError
from elastrun.train.log import Log, say
from elastrun.worker.shard_layout import ShardLayout
from elastrun.worker.snapshot import SlotView, SnapshotHeader

__all__ = [
    "LocalShard",
    "describe",
    "finish",
    "first_shard",
    "is_sharded",
    "refuse_sharded_tensor",
    "shard_leaves",
    "usable",
]


@dataclass
class LocalShard:
    """A rank's shard as read back: the tensor, its layout, its key, and the
    rank and world size of the snapshot it came from."""

    tensor: Any
    layout: ShardLayout
    key: str
    saved_rank: int
    saved_world: int


def _refuse(key: str, why: str) -> ConfigError:
    return ConfigError(f"memory checkpoint: {key} {why}")


def is_sharded(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (torch loaded: the caller holds a tensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def refuse_sharded_tensor(obj: Any, key: str) -> None:
    """ConfigError naming ``key`` when ``obj`` is a ShardedTensor."""
    try:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    except ImportError:  # a torch without it
        return
    if isinstance(obj, ShardedTensor):
        raise _refuse(
            key,
            "is a ShardedTensor, which a memory checkpoint does not hold; save DTensors "
            "(FSDP2's state_dict, or torch.distributed.tensor) instead",
        )


def _placement(p: Any, key: str) -> str:
    from torch.distributed.tensor import Replicate, Shard

    if type(p) is Replicate:
        return "R"
    if type(p) is Shard:
        return f"S{p.dim}"
    raise _refuse(
        key,
        f"is a DTensor placed {p} on its mesh; a memory checkpoint holds Shard(dim) and "
        "Replicate() placements (redistribute it, or call full_tensor(), before saving)",
    )


def describe(dt: Any, key: str, rank: int, world: int) -> tuple[Any, ShardLayout]:
    """A DTensor's local shard and layout; ConfigError naming ``key`` when its
    placements cannot be held or its mesh does not fit this rank's world."""
    mesh = dt.device_mesh
    ranks = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
    if max(ranks) >= world or rank not in ranks:
        raise _refuse(
            key,
            f"is a DTensor on a mesh of ranks {_short(ranks)}, which does not match this "
            f"rank's world (rank {rank} of {world})",
        )
    names = mesh.mesh_dim_names
    layout = ShardLayout(
        device_type=str(mesh.device_type),
        mesh=tuple(ranks),
        mesh_shape=tuple(int(d) for d in mesh.mesh.shape),
        dim_names=None if names is None else tuple(str(n) for n in names),
        placements=tuple(_placement(p, key) for p in dt.placements),
        shape=tuple(int(d) for d in dt.shape),
        stride=tuple(int(s) for s in dt.stride()),
    )
    return dt.to_local(), layout


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}] ({len(ranks)})"


def shard_leaves(state: Any) -> list[tuple[Any, Any, LocalShard]]:
    """Every LocalShard in ``state``: (its container, its key there, it)."""
    out: list[tuple[Any, Any, LocalShard]] = []
    stack = [state]
    while stack:
        node = stack.pop()
        items: Any = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(v, LocalShard):
                out.append((node, k, v))
            elif isinstance(v, dict | list | tuple):
                stack.append(v)
    return out


def _mismatch(shards: list[LocalShard], rank: int, world: int) -> str | None:
    """Why this rank cannot take its shards back as they are (None: it can)."""
    for s in shards:
        if s.saved_world != world:
            return (
                f"its sharded tensors ({s.key}, ...) are shards of a world of {s.saved_world} "
                f"ranks, and the world is now {world}"
            )
        if s.saved_rank != rank:
            return f"rank {rank} got rank {s.saved_rank}'s shards ({s.key}, ...)"
        if max(s.layout.mesh) >= world or rank not in s.layout.mesh:
            return f"{s.key} is on a mesh that does not match the world (rank {rank} of {world})"
    return None


def finish(state: Any, *, what: str, advice: str) -> Any:
    """``state`` with its LocalShards made DTensors again; ConfigError (``what``:
    the state's name, then why, then ``advice``) when this rank cannot take
    them back as they are. No collective: the snapshots of another world were
    set aside before the ranks agreed (:func:`usable`), and a disk checkpoint
    of another world is one on every rank."""
    import torch.distributed as dist

    shards = shard_leaves(state)
    if not shards:
        return state
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{what} holds sharded tensors ({shards[0][2].key}, ...): initialise the "
            "process group (and its device mesh) before loading it"
        )
    why = _mismatch([s for _, _, s in shards], dist.get_rank(), dist.get_world_size())
    if why is not None:
        raise ConfigError(f"{what} cannot be loaded as it is: {why}. {advice}")
    meshes: dict[tuple[Any, ...], Any] = {}
    for parent, k, s in shards:
        if isinstance(parent, tuple):
            raise ConfigError(f"{what}: {s.key} is a sharded tensor inside a tuple")
        parent[k] = _rebuild(s, meshes)
    return state


def _rebuild(s: LocalShard, meshes: dict[tuple[Any, ...], Any]) -> Any:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from elastrun.train.transfer_device import transfer_device

    lay = s.layout
    mkey = (lay.device_type, lay.mesh, lay.mesh_shape, lay.dim_names)
    if mkey not in meshes:  # one mesh per distinct one (its groups made once, in order)
        ranks = torch.tensor(lay.mesh, dtype=torch.int64).reshape(lay.mesh_shape)
        meshes[mkey] = DeviceMesh(lay.device_type, ranks, mesh_dim_names=lay.dim_names)
    placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in lay.placements]
    local = s.tensor
    if lay.device_type != local.device.type:
        local = local.to(transfer_device() if lay.device_type == "cuda" else lay.device_type)
    return DTensor.from_local(
        local,
        meshes[mkey],
        placements,
        run_check=False,
        shape=torch.Size(lay.shape),
        stride=lay.stride,
    )


CONVERT = (
    "Convert the ranks' disk checkpoints with `elastrun checkpoint-convert` and load the "
    "result with torch.distributed.checkpoint.load, which reshards it (docs/training.md: "
    "sharded states)"
)


def memory_state(state: Any) -> Any:
    """A memory checkpoint's state with its shards made DTensors again."""
    return finish(
        state,
        what="memory checkpoint",
        advice="Load a sharded state with shared=False (each rank its own shards). " + CONVERT,
    )


def disk_state(state: Any, *, directory: str) -> Any:
    """A disk checkpoint's state with its shards made DTensors again."""
    return finish(state, what=f"the checkpoint in {directory}", advice=CONVERT)


def with_layouts(state: Any, header: SnapshotHeader) -> Any:
    """``state`` (a disk copy as ``torch.load`` read it: local shards as plain
    tensors) with a LocalShard in each place the snapshot's tree says held a
    DTensor (:mod:`elastrun.worker.torch_file`)."""

    def walk(node: Any, value: Any) -> Any:
        ((tag, v),) = node.items()
        if tag == "s":
            lay = ShardLayout.from_json(v[1])
            return LocalShard(value, lay, header.tensors[v[0]].key, header.rank, header.world_size)
        if tag == "d":
            for k, child in v:
                value[k] = walk(child, value[k])
        elif tag == "l":
            for i, child in enumerate(v):
                value[i] = walk(child, value[i])
        elif tag == "u":
            return tuple(walk(child, x) for child, x in zip(v, value, strict=True))
        return value

    return walk(header.tree, state)


def first_shard(header: SnapshotHeader) -> str | None:
    """The key of the first DTensor shard a snapshot holds (None: none)."""
    found = -1
    stack = [header.tree]
    while stack:
        ((tag, v),) = stack.pop().items()
        if tag == "s" and (found < 0 or v[0] < found):
            found = v[0]
        elif tag == "d":
            stack.extend(child for _, child in v)
        elif tag in ("l", "u"):
            stack.extend(v)
    return None if found < 0 else header.tensors[found].key


def usable(
    views: list[SlotView], replicas: list[SlotView], *, group: Any, log: Log
) -> tuple[list[SlotView], list[SlotView]]:
    """``views`` (this rank's slots) and ``replicas`` less the snapshots of
    sharded states that cannot serve (closed here): those saved in a world of
    another size (their shards are not resharded in memory; rank 0 says so in
    one line), and this rank's own saved by another rank (it says so). The
    ranks then agree on what is left, or fall back to the disk checkpoints."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return views, replicas
    world, rank = dist.get_world_size(group), dist.get_rank()
    kept: tuple[list[SlotView], list[SlotView]] = ([], [])
    said: dict[str, set[int]] = {}  # why -> the steps set aside for it
    for own, group_views in ((True, views), (False, replicas)):
        for v in group_views:
            h = v.header
            key = first_shard(h) if h.world_size != world or (own and h.rank != rank) else None
            if key is None:
                kept[0 if own else 1].append(v)
                continue
            if h.world_size != world:
                why = (
                    f"its sharded tensors ({key}, ...) are shards of a world of {h.world_size} "
                    f"ranks, and the world is now {world}"
                )
            else:
                why = f"rank {rank}'s copy holds rank {h.rank}'s shards ({key}, ...)"
            said.setdefault(why, set()).add(h.step)
            v.close()
    for why, steps in said.items():
        if rank == 0 or why.startswith(f"rank {rank}'s"):
            say(
                log,
                f"=> memory checkpoint step {', '.join(map(str, sorted(steps)))} not used: "
                f"{why}; sharded states are not resharded in memory (the disk checkpoints "
                "serve, if any)",
            )
            break  # one line
    return kept
