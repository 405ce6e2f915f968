"""Restoring a memory checkpoint: the ranks agree on one step and load it.

Each rank lists the steps its own slots hold intact (at most ``MAX_SLOTS``,
with their sizes); the ranks all-gather the lists (one collective), then:

* per-rank states (the default): the highest step that every rank holds;
  each rank loads its own copy;
* shared states (``shared=True``: the same on every rank, as under data
  parallelism, or saved by one rank only, as Lightning does): the highest
  step any rank holds; the ranks that hold it load their own copy, and the
  lowest such rank broadcasts its snapshot's bytes to the others, which
  check them against the snapshot's SHA-256 before loading them. A node that
  replaces a lost one thus gets the state from the survivors' memory.

None on every rank when no step qualifies (the caller then falls back to the
disk checkpoints, agreed on in the same way by every rank).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from elastrun.errors import ConfigError
from elastrun.train.state_codec import decode
from elastrun.worker.snapshot import MAX_SLOTS, SlotView, SnapshotError, header_of, sha256_of

__all__ = ["restore"]

Log = Callable[[str], None] | None


def _newest_per_step(views: list[SlotView]) -> dict[int, SlotView]:
    out: dict[int, SlotView] = {}
    for v in sorted(views, key=lambda v: v.header.generation):
        out[v.header.step] = v  # the newest copy of a step saved twice
    return dict(sorted(out.items(), reverse=True)[:MAX_SLOTS])


def _say(log: Log, rank: int, line: str) -> None:
    if log is not None and rank == 0:
        log(line)


def restore(
    views: list[SlotView], *, shared: bool, group: Any, map_location: Any, log: Log
) -> dict[str, Any] | None:
    """The state the ranks agree on (see the module doc), or None."""
    import torch
    import torch.distributed as dist

    mine = _newest_per_step(views)
    if not (dist.is_available() and dist.is_initialized()):
        if not mine:
            return None
        step = max(mine)
        _say(log, 0, f"=> using memory checkpoint: step {step} (held by the agent; no disk read)")
        return _decoded(mine[step], map_location)

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    row = torch.full((2 * MAX_SLOTS,), -1, dtype=torch.int64)
    for i, (step, view) in enumerate(mine.items()):
        row[i], row[MAX_SLOTS + i] = step, view.size
    rows = [torch.empty_like(row, device=device) for _ in range(world)]
    dist.all_gather(rows, row.to(device), group=group)
    held: list[dict[int, int]] = []
    for r in rows:
        values = [int(v) for v in r.cpu().tolist()]
        held.append({values[i]: values[MAX_SLOTS + i] for i in range(MAX_SLOTS) if values[i] >= 0})
    # shared: a step any rank holds; per rank: a step every rank holds
    candidates = set().union(*held) if shared else set.intersection(*(set(h) for h in held))
    if not candidates:
        return None
    step = max(candidates)
    holders = [r for r in range(world) if step in held[r]]
    if len(holders) == world:
        _say(
            log,
            rank,
            f"=> using memory checkpoint: step {step} (each rank's copy held by its "
            "agent; no disk read)",
        )
        return _decoded(mine[step], map_location)
    src, size = holders[0], held[holders[0]][step]
    _say(
        log,
        rank,
        f"=> using memory checkpoint: step {step} from rank {src}'s agent, sent to "
        f"{world - len(holders)} rank(s) without it ({size} bytes; no disk read)",
    )
    if rank == src:
        with warnings.catch_warnings():  # read-only memory, only read
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(mine[step].whole, dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    src_global = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast(buf, src=src_global, group=group)
    if step in mine:
        del buf
        return _decoded(mine[step], map_location)
    data = buf.cpu().numpy().tobytes() if buf.numel() else b""
    del buf
    return _received(data, step, src, map_location)


def _decoded(view: SlotView, map_location: Any) -> dict[str, Any]:
    state = decode(view.header, view.data, map_location)
    return state if isinstance(state, dict) else {"state": state}


def _received(data: bytes, step: int, src: int, map_location: Any) -> dict[str, Any]:
    try:
        found = header_of(data)
        if found is None:
            raise SnapshotError("no snapshot")
        header, start = found
        view = memoryview(data)[start : start + header.data_size]
        if header.step != step or sha256_of(view) != header.sha256:
            raise SnapshotError("its bytes do not match its header's step and SHA-256")
        state = decode(header, view, map_location)
    except SnapshotError as e:
        raise ConfigError(
            f"memory checkpoint step {step} received from rank {src} is damaged in transit: {e}"
        ) from e
    return state if isinstance(state, dict) else {"state": state}
