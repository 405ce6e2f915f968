"""A sharded tensor's place in its job, as a snapshot records it: without torch.

A memory checkpoint holds each rank's *local* shard of a ``DTensor`` (FSDP2's
``state_dict``, tensor parallelism) as a plain tensor, and beside it a
:class:`ShardLayout`: the device mesh (its device type, its ranks in row-major
order, its shape and dimension names), the placements (``"R"``: replicated
along that mesh dimension, ``"S<d>"``: sharded along tensor dimension ``d``)
and the global shape and stride. The snapshot's tree names such a leaf
``{"s": [<tensor index>, <layout>]}``
(:func:`~elastrun.worker.snapshot_bounds.check_tree` reads the layout with
:meth:`ShardLayout.from_json`, within bounds, before anything uses it).

That is everything needed to give a rank its shard back as a ``DTensor`` on
the same mesh (:mod:`elastrun.train.sharded`), and to put the shards of every
rank together into the global tensor (:func:`shard_slices`, the conversion of
disk copies, :mod:`elastrun.train.convert`).

Standard library only (the agent reads snapshot headers).
"""

from __future__ import annotations

import re
from typing import Any

from elastrun.frozen import frozen

__all__ = ["MAX_MESH", "LayoutError", "ShardLayout", "mesh_coordinate", "shard_slices"]

MAX_MESH = 1 << 24  # ranks in a mesh (the format's world bound)
MAX_MESH_DIMS = 8
MAX_NAME = 64
_PLACEMENT = re.compile(r"^(R|S\d{1,2})$")
_DEVICE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


class LayoutError(ValueError):
    """A layout that is not one (the message says which field)."""


def _ints(value: Any, what: str, low: int, high: int, count: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > count:
        raise LayoutError(f"its {what} is not a list of at most {count} integers")
    for v in value:
        if type(v) is not int or not low <= v <= high:
            raise LayoutError(f"its {what} holds {v!r}, not an integer in {low}..{high}")
    return tuple(value)


@frozen(slots=True)
class ShardLayout:
    """Where a local shard sits in its global tensor (see the module doc)."""

    device_type: str
    mesh: tuple[int, ...]  # the mesh's global ranks, row-major
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    placements: tuple[str, ...]  # one per mesh dimension: "R" or "S<tensor dim>"
    shape: tuple[int, ...]  # the global tensor's
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device_type,
            "mesh": list(self.mesh),
            "mesh_shape": list(self.mesh_shape),
            "names": None if self.dim_names is None else list(self.dim_names),
            "placements": list(self.placements),
            "shape": list(self.shape),
            "stride": list(self.stride),
        }

    @classmethod
    def from_json(cls, obj: Any) -> ShardLayout:
        """The layout ``obj`` describes (LayoutError: not one)."""
        if not isinstance(obj, dict):
            raise LayoutError("it is not an object")
        device = obj.get("device")
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise LayoutError(f"its device type {str(device)[:20]!r} is not one")
        mesh = _ints(obj.get("mesh"), "mesh", 0, MAX_MESH - 1, MAX_MESH)
        mesh_shape = _ints(obj.get("mesh_shape"), "mesh shape", 1, MAX_MESH, MAX_MESH_DIMS)
        size = 1
        for d in mesh_shape:
            size *= d
        if not mesh_shape or size != len(mesh) or len(set(mesh)) != len(mesh):
            raise LayoutError("its mesh is not its shape's count of distinct ranks")
        names = obj.get("names")
        if names is not None:
            ok = isinstance(names, list) and len(names) == len(mesh_shape)
            if not ok or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names):
                raise LayoutError("its mesh dimension names are not one name per dimension")
            names = tuple(names)
        placements = obj.get("placements")
        if (
            not isinstance(placements, list)
            or len(placements) != len(mesh_shape)
            or not all(isinstance(p, str) and _PLACEMENT.match(p) for p in placements)
        ):
            raise LayoutError("its placements are not one R or S<dim> per mesh dimension")
        shape = _ints(obj.get("shape"), "shape", 0, 1 << 62, 64)
        stride = _ints(obj.get("stride"), "stride", 0, 1 << 62, 64)
        if len(stride) != len(shape):
            raise LayoutError("its stride is not one per dimension of its shape")
        if any(p != "R" and int(p[1:]) >= len(shape) for p in placements):
            raise LayoutError("a placement shards a dimension its shape does not have")
        return cls(device, mesh, mesh_shape, names, tuple(placements), shape, stride)


def mesh_coordinate(layout: ShardLayout, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinate in the layout's mesh (None: not in it)."""
    try:
        flat = layout.mesh.index(rank)
    except ValueError:
        return None
    coord = []
    for d in reversed(layout.mesh_shape):
        coord.append(flat % d)
        flat //= d
    return tuple(reversed(coord))


def shard_slices(layout: ShardLayout, rank: int) -> list[tuple[int, int]] | None:
    """The ``(start, length)`` of ``rank``'s shard along each dimension of the
    global tensor, as torch's ``Shard`` places it (``torch.chunk``'s split:
    ceil(n / k) per shard, the last ones shorter or empty), mesh dimensions
    applied in order; None when ``rank`` is not in the mesh."""
    coord = mesh_coordinate(layout, rank)
    if coord is None:
        return None
    out = [(0, n) for n in layout.shape]
    for mesh_dim, p in enumerate(layout.placements):
        if p == "R":
            continue
        dim = int(p[1:])
        start, n = out[dim]
        k, i = layout.mesh_shape[mesh_dim], coord[mesh_dim]
        per = -(-n // k) if n else 0
        lo = min(i * per, n)
        out[dim] = (start + lo, min(per, n - lo))
    return out
