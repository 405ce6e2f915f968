"""A training state as a snapshot (:mod:`elastrun.worker.snapshot`): flattened
into its tensors and a JSON tree, copied into a buffer, and read back.

A state is any ``state_dict``-shaped tree: dicts (string or integer keys),
lists, tuples, tensors and plain values (None, bool, int, float, str). Each
tensor becomes a :class:`~elastrun.worker.snapshot.TensorEntry` (its raw
bytes at an aligned offset); the tree keeps everything else, with
``{"t": i}`` where tensor ``i`` was. Floats are kept exactly (``float.hex``:
infinities and NaN too). Anything else (a set, a module, a numpy array, a
sparse or quantized tensor, a tensor on a device other than the CPU or a
GPU) is refused with a :class:`~elastrun.errors.ConfigError` that names its
key, before a byte is written; so is a state whose tensors lie on more than
one GPU (``cuda:0`` and ``cuda:1``: CPU tensors beside one GPU's are fine).

A ``DTensor`` is held as its local shard with its layout (tree node
``{"s": [i, layout]}``) and read back as a
:class:`~elastrun.train.sharded.LocalShard`, which
:func:`~elastrun.train.sharded.finish` makes a DTensor again
(:mod:`elastrun.train.sharded`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from elastrun.errors import ConfigError
from elastrun.worker.shard_layout import ShardLayout
from elastrun.worker.snapshot import (
    DTYPE_SIZES,
    MAX_DEPTH,
    SnapshotHeader,
    TensorEntry,
    aligned,
)

__all__ = ["Flat", "decode", "flatten"]

COPYABLE_DEVICES = ("cpu", "cuda")
_DEPTH = MAX_DEPTH - 8  # room for the header's own nesting


def _path(key: str, k: object) -> str:
    return f"{key}[{k!r}]"


def _refuse(key: str, why: str) -> ConfigError:
    return ConfigError(
        f"memory checkpoint: {key} {why}; a memory checkpoint holds tensors (on the CPU or a "
        "GPU), dicts, lists, tuples, numbers, strings and None"
    )


@dataclass
class Flat:
    """A state flattened: its tensors (key, tensor), the tree, the entries
    laid out in the data, and the data's size."""

    tensors: list[tuple[str, Any]]
    tree: Any
    entries: tuple[TensorEntry, ...] = ()
    data_size: int = 0


def _tensor_entry(key: str, t: Any, offset: int) -> TensorEntry:
    import torch

    if t.layout != torch.strided:
        raise _refuse(key, f"is a {t.layout} tensor (only dense tensors are copied)")
    if t.device.type not in COPYABLE_DEVICES:
        raise _refuse(key, f"is a tensor on device {t.device} (only cpu and cuda are copied)")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise _refuse(key, f"is a tensor of dtype {dtype}, which cannot be copied")
    return TensorEntry(key, dtype, tuple(t.shape), offset, t.numel() * DTYPE_SIZES[dtype])


def flatten(state: Any, root: str = "state") -> Flat:
    """``state`` as tensors and a tree (ConfigError naming the key of
    anything that cannot be copied)."""
    import torch

    from elastrun.train import sharded

    flat = Flat([], None)
    gpus: dict[Any, str] = {}  # the first key on each GPU

    def walk(obj: Any, key: str, depth: int) -> Any:
        if depth > _DEPTH:
            raise _refuse(key, f"is nested more than {_DEPTH} levels deep")
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor:  # a subclass: Parameter, DTensor, ShardedTensor
                sharded.refuse_sharded_tensor(obj, key)
            if type(obj) is not torch.Tensor and sharded.is_sharded(obj):
                local, layout = sharded.describe(obj, key, *_rank_world())
                _one_gpu(gpus, local, key)
                flat.tensors.append((key, local))
                return {"s": [len(flat.tensors) - 1, layout.to_json()]}
            _one_gpu(gpus, obj, key)
            flat.tensors.append((key, obj))
            return {"t": len(flat.tensors) - 1}
        if obj is None or type(obj) in (bool, int, str):
            return {"v": obj}
        if type(obj) is float:
            return {"f": obj.hex()}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if type(k) not in (str, int):
                    raise _refuse(_path(key, k), f"has a key of type {type(k).__name__}")
                items.append([k, walk(v, _path(key, k), depth + 1)])
            return {"d": items}
        if type(obj) in (list, tuple) or isinstance(obj, torch.Size):
            tag = "l" if type(obj) is list else "u"
            return {tag: [walk(v, f"{key}[{i}]", depth + 1) for i, v in enumerate(obj)]}
        raise _refuse(key, f"is a {type(obj).__module__}.{type(obj).__qualname__}")

    flat.tree = walk(state, root, 0)
    offset, entries = 0, []
    for key, t in flat.tensors:
        entry = _tensor_entry(key, t, offset)
        entries.append(entry)
        offset += aligned(entry.nbytes)
    flat.entries, flat.data_size = tuple(entries), offset
    return flat


def _one_gpu(gpus: dict[Any, str], t: Any, key: str) -> None:
    """ConfigError naming ``key`` when ``t`` is on a GPU other than the state's first."""
    if t.device.type == "cpu":
        return
    if gpus and t.device not in gpus:
        ((device, first),) = gpus.items()
        raise ConfigError(
            f"memory checkpoint: {key} is on {t.device}, and {first} on {device}: the state "
            "mixes devices (a rank's state lies on one GPU, beside CPU tensors)"
        )
    gpus.setdefault(t.device, key)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def copy_into(flat: Flat, buffer: Any, start: int) -> None:
    """Copy ``flat``'s tensors into ``buffer`` (writable, e.g. an mmap) at
    ``start`` + each entry's offset. A CPU tensor's bytes are copied in this
    thread (a plain memory copy: torch's own copy spreads small copies over
    its thread pool, which on a busy machine costs more than it saves); a
    GPU tensor is copied to the host by torch."""
    import torch

    view = memoryview(buffer)
    try:
        for (_key, t), e in zip(flat.tensors, flat.entries, strict=True):
            if e.nbytes == 0:
                continue
            at = start + e.offset
            if t.device.type == "cpu":
                raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
                view[at : at + e.nbytes] = memoryview(raw.numpy())
                del raw
            else:
                dst = torch.frombuffer(buffer, dtype=t.dtype, count=t.numel(), offset=at)
                dst.view(t.shape).copy_(t.detach())
                del dst
    finally:
        view.release()


def _tensor(entry: TensorEntry, data: Any, map_location: Any) -> Any:
    import torch

    dtype = getattr(torch, entry.dtype)
    numel = entry.nbytes // DTYPE_SIZES[entry.dtype]
    if numel == 0:
        t = torch.empty(entry.shape, dtype=dtype)
    else:
        with warnings.catch_warnings():  # read-only memory: cloned at once
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=dtype, count=numel, offset=entry.offset)
        t = src.view(entry.shape).clone()
        del src
    return t if map_location in (None, "cpu") else t.to(map_location)


def decode(header: SnapshotHeader, data: Any, map_location: Any = "cpu") -> Any:
    """The state a snapshot holds: ``data`` is its data region (a buffer).
    The header was checked when it was read
    (:func:`~elastrun.worker.snapshot.parse_header`: each tensor's place in
    the data, and a tree of known nodes that names each tensor once)."""
    from elastrun.train.sharded import LocalShard

    tensors = [_tensor(e, data, map_location) for e in header.tensors]

    def build(node: Any) -> Any:
        ((tag, value),) = node.items()
        if tag == "t":
            return tensors[value]
        if tag == "s":
            i, layout = value
            key = header.tensors[i].key
            lay = ShardLayout.from_json(layout)
            return LocalShard(tensors[i], lay, key, header.rank, header.world_size)
        if tag == "v":
            return value
        if tag == "f":
            return float.fromhex(value)
        if tag == "d":
            return {k: build(v) for k, v in value}
        items = [build(v) for v in value]
        return items if tag == "l" else tuple(items)

    return build(header.tree)
