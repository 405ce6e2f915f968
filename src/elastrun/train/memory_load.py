"""Restoring a memory checkpoint: the ranks agree on one step and load it.

Each rank lists the steps its own slots hold intact (at most ``MAX_SLOTS``,
with their sizes), and local rank 0 of each node the replicas its agent
holds of the neighbour node's snapshots (at most ``MAX_REPLICAS``: the rank
that saved each, its step and size); the ranks all-gather the lists (one
collective), then (:func:`agree`):

* per-rank states (the default): the highest step for which every rank's
  state is somewhere: its own copy, or a replica of that rank held by some
  rank's node; each rank loads its own copy, and the holder of a replica
  broadcasts it to the rank without one (checked against its SHA-256). A
  node that replaces a lost one thus gets the lost ranks' states from the
  neighbour's memory;
* shared states (``shared=True``: the same on every rank, as under data
  parallelism, or saved by one rank only, as Lightning does): the highest
  step any rank holds; the ranks that hold it load their own copy, and the
  lowest such rank broadcasts its snapshot's bytes to the others, which
  check them against the snapshot's SHA-256 before loading them (with no
  rank's own copy, a replica of any rank at that step serves).

None on every rank when no step qualifies (the caller then falls back to the
disk checkpoints, agreed on in the same way by every rank).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastrun.errors import ConfigError
from elastrun.train.log import Log, say
from elastrun.train.state_codec import decode
from elastrun.worker.snapshot import MAX_SLOTS, SlotView, SnapshotError, header_of, sha256_of

__all__ = ["restore"]


def _newest_per_step(views: list[SlotView]) -> dict[int, SlotView]:
    out: dict[int, SlotView] = {}
    for v in sorted(views, key=lambda v: v.header.generation):
        out[v.header.step] = v  # the newest copy of a step saved twice
    return dict(sorted(out.items(), reverse=True)[:MAX_SLOTS])


MAX_REPLICAS = 64  # replicas one rank lists (its node holds one neighbour's ranks)


@dataclass(frozen=True)
class Held:
    """What one rank listed: its own steps (step -> size) and the replicas
    its node holds ((origin rank, step) -> size)."""

    own: dict[int, int]
    replicas: dict[tuple[int, int], int]


def _row(mine: dict[int, SlotView], reps: dict[tuple[int, int], SlotView]) -> list[int]:
    row = [-1] * (2 * MAX_SLOTS + 3 * MAX_REPLICAS)
    for i, (step, view) in enumerate(mine.items()):
        row[i], row[MAX_SLOTS + i] = step, view.size
    base = 2 * MAX_SLOTS
    for i, ((origin, step), view) in enumerate(list(reps.items())[:MAX_REPLICAS]):
        row[base + 3 * i : base + 3 * i + 3] = [origin, step, view.size]
    return row


def _parse(values: list[int]) -> Held:
    own = {values[i]: values[MAX_SLOTS + i] for i in range(MAX_SLOTS) if values[i] >= 0}
    base = 2 * MAX_SLOTS
    reps = {}
    for i in range(MAX_REPLICAS):
        origin, step, size = values[base + 3 * i : base + 3 * i + 3]
        if origin >= 0:
            reps[(origin, step)] = size
    return Held(own, reps)


def _sources(held: list[Held], step: int, shared: bool) -> dict[int, tuple[int, int]] | None:
    """For step ``step``: rank without its own copy -> (rank that sends it,
    size); None when some rank's state is nowhere."""
    world = len(held)
    out: dict[int, tuple[int, int]] = {}
    for r in range(world):
        if step in held[r].own:
            continue
        if shared:  # any copy of the step will do: a rank's own first, then a replica
            found = [(h, held[h].own[step]) for h in range(world) if step in held[h].own]
            for h in range(world) if not found else ():
                origin = _any_origin(held[h].replicas, step)
                if origin is not None:
                    found.append((h, held[h].replicas[(origin, step)]))
        else:
            found = [
                (h, held[h].replicas[(r, step)])
                for h in range(world)
                if (r, step) in held[h].replicas
            ]
        if not found:
            return None
        out[r] = found[0]
    return out


def _any_origin(replicas: Mapping[tuple[int, int], object], step: int) -> int | None:
    """The lowest origin rank among the replicas of ``step`` (None: none)."""
    return min((o for (o, s) in replicas if s == step), default=None)


def agree(held: list[Held], shared: bool) -> tuple[int, dict[int, tuple[int, int]]] | None:
    """The highest step whose state every rank can have (its own copy, or
    one sent by a rank whose own copy or node's replica holds it), and who
    sends it to whom; None: no such step."""
    steps = {s for h in held for s in h.own} | {s for h in held for (_, s) in h.replicas}
    for step in sorted(steps, reverse=True):
        sources = _sources(held, step, shared)
        if sources is not None:
            return step, sources
    return None


def restore(
    views: list[SlotView],
    *,
    replicas: list[SlotView] = (),  # type: ignore[assignment]
    shared: bool,
    group: Any,
    map_location: Any,
    log: Log,
) -> dict[str, Any] | None:
    """The state the ranks agree on (see the module doc), or None."""
    import torch.distributed as dist

    mine = _newest_per_step(views)
    reps = {(v.header.rank, v.header.step): v for v in replicas}
    if not (dist.is_available() and dist.is_initialized()):
        if not mine:
            return None
        step = max(mine)
        say(log, f"=> using memory checkpoint: step {step} (held by the agent; no disk read)")
        return _decoded(mine[step], map_location)

    rank = dist.get_rank(group)
    held = _gather(_row(mine, reps), group)
    agreed = agree(held, shared)
    if agreed is None:
        return None
    step, sources = agreed
    log = log if rank == 0 else None  # rank 0 says what the ranks agreed on
    if not sources:
        say(
            log,
            f"=> using memory checkpoint: step {step} (each rank's copy held by its "
            "agent; no disk read)",
        )
        return _decoded(mine[step], map_location)
    say(log, _line(step, sources, shared))
    got: dict[str, Any] | None = None
    for r, (src, size) in sorted(sources.items()):
        if src == r == rank:  # this rank's own state, in its node's replicas
            got = _decoded(reps[(r, step)], map_location)
            continue
        if src == r:
            continue
        data = _broadcast(
            _sent(mine, reps, step, r, shared) if rank == src else None, size, src, group
        )
        if rank == r:
            got = _received(data, step, src, map_location)
    if got is None:
        got = _decoded(mine[step], map_location)
    return got


def _line(step: int, sources: dict[int, tuple[int, int]], shared: bool) -> str:
    if shared:
        src, size = next(iter(sources.values()))
        return (
            f"=> using memory checkpoint: step {step} from rank {src}'s agent, sent to "
            f"{len(sources)} rank(s) without it ({size} bytes; no disk read)"
        )
    moved = ", ".join(f"rank {r}'s from rank {h}" for r, (h, _) in sorted(sources.items()))
    return (
        f"=> using memory checkpoint: step {step}; the other ranks' copies held by their "
        f"agents, and from a neighbour node's replica: {moved} (no disk read)"
    )


def _sent(
    mine: dict[int, SlotView],
    reps: dict[tuple[int, int], SlotView],
    step: int,
    r: int,
    shared: bool,
) -> SlotView:
    """What this rank sends to rank ``r`` (as :func:`_sources` chose it)."""
    if shared:
        if step in mine:
            return mine[step]
        origin = _any_origin(reps, step)
        assert origin is not None
        return reps[(origin, step)]
    return reps[(r, step)]


def _gather(row: list[int], group: Any) -> list[Held]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    device = _device(group)
    t = torch.tensor(row, dtype=torch.int64)
    rows = [torch.empty_like(t, device=device) for _ in range(world)]
    dist.all_gather(rows, t.to(device), group=group)
    return [_parse([int(v) for v in r.cpu().tolist()]) for r in rows]


def _device(group: Any) -> Any:
    from elastrun.train.transfer_device import transfer_device

    return transfer_device(group)


def _broadcast(view: SlotView | None, size: int, src: int, group: Any) -> bytes:
    """The bytes of ``view`` (on rank ``src``), sent to every rank."""
    import torch
    import torch.distributed as dist

    device = _device(group)
    if view is not None:
        with warnings.catch_warnings():  # read-only memory, only read
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(view.whole, dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    src_global = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast(buf, src=src_global, group=group)
    data = buf.cpu().numpy().tobytes() if view is None and buf.numel() else b""
    del buf
    return data


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
