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
key, before a byte is written.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastrun.errors import ConfigError
from elastrun.worker.snapshot import (
    DTYPE_SIZES,
    MAX_DEPTH,
    SnapshotError,
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

    flat = Flat([], None)

    def walk(obj: Any, key: str, depth: int) -> Any:
        if depth > _DEPTH:
            raise _refuse(key, f"is nested more than {_DEPTH} levels deep")
        if isinstance(obj, torch.Tensor):
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
    SnapshotError when the tree does not match the header."""
    tensors = [_tensor(e, data, map_location) for e in header.tensors]
    used = [False] * len(tensors)

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise SnapshotError("its tree holds a node that is not a one-key object")
        ((tag, value),) = node.items()
        make: Callable[..., Any] = _BUILD.get(tag, _bad)
        return make(value, build, tensors, used)

    state = build(header.tree)
    if not all(used):
        raise SnapshotError("its header lists tensors that its tree does not use")
    return state


def _bad(value: Any, *_: Any) -> Any:
    raise SnapshotError("its tree holds a node of an unknown kind")


def _b_tensor(value: Any, _b: Any, tensors: list[Any], used: list[bool]) -> Any:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tensors):
        raise SnapshotError("its tree names a tensor that is not in its header")
    used[value] = True
    return tensors[value]


def _b_value(value: Any, *_: Any) -> Any:
    if value is not None and type(value) not in (bool, int, str):
        raise SnapshotError("its tree holds a value of an unknown type")
    return value


def _b_float(value: Any, *_: Any) -> float:
    try:
        return float.fromhex(value)
    except (TypeError, ValueError):
        raise SnapshotError("its tree holds a float that is not one") from None


def _b_dict(value: Any, build: Callable[[Any], Any], *_: Any) -> dict[Any, Any]:
    if not isinstance(value, list):
        raise SnapshotError("its tree holds a dict that is not a list of pairs")
    out: dict[Any, Any] = {}
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) not in (str, int):
            raise SnapshotError("its tree holds a dict entry that is not a [key, value] pair")
        out[pair[0]] = build(pair[1])
    return out


def _b_list(value: Any, build: Callable[[Any], Any], *_: Any) -> list[Any]:
    if not isinstance(value, list):
        raise SnapshotError("its tree holds a list that is not one")
    return [build(v) for v in value]


def _b_tuple(value: Any, build: Callable[[Any], Any], *rest: Any) -> tuple[Any, ...]:
    return tuple(_b_list(value, build, *rest))


_BUILD: dict[str, Callable[..., Any]] = {
    "t": _b_tensor,
    "v": _b_value,
    "f": _b_float,
    "d": _b_dict,
    "l": _b_list,
    "u": _b_tuple,
}
