"""Restoring a memory checkpoint: the ranks agree on one step and load it.

Each rank lists the steps its own slots hold (at most ``MAX_SLOTS``, with
their sizes; their headers checked, not yet their data), and local rank 0
of each node the replicas its agent holds of the neighbour node's
snapshots (at most ``MAX_REPLICAS``: the rank that saved each, its step and
size); the ranks all-gather the lists (one collective), then (:func:`agree`):

* per-rank states (the default): the highest step for which every rank's
  state is somewhere: its own copy, or a replica of that rank held by some
  rank's node; each rank loads its own copy, and the holder of a replica
  sends it to the rank without one (checked against its digest). A
  node that replaces a lost one thus gets the lost ranks' states from the
  neighbour's memory;
* shared states (``shared=True``: the same on every rank, as under data
  parallelism, or saved by one rank only, as Lightning does): the highest
  step any rank holds; the ranks that hold it load their own copy, and the
  lowest such rank sends its snapshot's bytes to each rank without it,
  which checks them against the snapshot's digest before loading them
  (with no rank's own copy, a replica of any rank at that step serves).

Then each rank checks the data of what it uses against its digest (the
snapshot it loads, and those it sends), and only that: when one is damaged,
it is named and dropped, and the ranks agree again (one ``all_reduce`` says
whether any rank found damage; at most ``MAX_ROUNDS`` rounds). A snapshot
goes from its holder to each rank that lacks it and to no other, rank to
rank (``send``/``recv``), in chunks of at most ``TRANSFER_CHUNK`` bytes.

None on every rank when no step qualifies (the caller then falls back to the
disk checkpoints, agreed on in the same way by every rank).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.train.log import Log, say
from elastrun.train.state_codec import decode
from elastrun.worker.snapshot import MAX_SLOTS, SlotView, SnapshotError, check_data, header_of

__all__ = ["restore"]


def _newest_per_step(views: list[SlotView]) -> dict[int, SlotView]:
    out: dict[int, SlotView] = {}
    for v in sorted(views, key=lambda v: v.header.generation):
        out[v.header.step] = v  # the newest copy of a step saved twice
    return dict(sorted(out.items(), reverse=True)[:MAX_SLOTS])


MAX_REPLICAS = 64  # replicas one rank lists (its node holds one neighbour's ranks)


@frozen
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

    checked = _Checked(log)
    if not (dist.is_available() and dist.is_initialized()):
        own = list(views)
        while mine := _newest_per_step(own):
            step = max(mine)
            if checked.intact(mine[step]):
                say(
                    log,
                    f"=> using memory checkpoint: step {step} (held by the agent; no disk read)",
                )
                return _decoded(mine[step], map_location)
            own.remove(mine[step])
        return None

    rank = dist.get_rank(group)
    own, held_reps = list(views), list(replicas)
    for _ in range(MAX_ROUNDS):
        mine = _newest_per_step(own)
        reps = {(v.header.rank, v.header.step): v for v in held_reps}
        agreed = agree(_gather(_row(mine, reps), group), shared)
        if agreed is None:
            return None
        step, sources = agreed
        damaged = [
            v
            for v in _used(mine, reps, step, sources, rank=rank, shared=shared)
            if not checked.intact(v)
        ]
        if not _any_rank(bool(damaged), group):
            break
        own = [v for v in own if v not in damaged]
        held_reps = [v for v in held_reps if v not in damaged]
    else:  # every rank sees the same flags: all of them give up together
        say(
            log if rank == 0 else None,
            f"=> memory checkpoints: a damaged snapshot in each of {MAX_ROUNDS} rounds of "
            "agreement; not used (the disk checkpoints serve, if any)",
        )
        return None
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
    for r, (src, size) in sorted(sources.items()):  # only the two ranks of a pair take part
        if src == r == rank:  # this rank's own state, in its node's replicas
            got = _decoded(reps[(r, step)], map_location)
        elif src != r and rank == src:
            _send(_sent(mine, reps, step, r, shared), r, group)
        elif src != r and rank == r:
            got = _received(_receive(size, src, group), step, src, map_location)
    if got is None:
        got = _decoded(mine[step], map_location)
    return got


MAX_ROUNDS = 16  # rounds of agreement, each after damage found in what the last one chose
TRANSFER_CHUNK = 64 << 20  # bytes a snapshot is sent in, at most, from one rank to another


class _Checked:
    """The snapshots this rank checked against their digest (each once), and
    the line that names a damaged one."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self._seen: dict[int, bool] = {}

    def intact(self, view: SlotView) -> bool:
        if id(view) not in self._seen:
            try:
                view.verify()
                self._seen[id(view)] = True
            except SnapshotError as e:
                say(self.log, f"=> memory checkpoint {view.path} is damaged ({e}); not used")
                self._seen[id(view)] = False
        return self._seen[id(view)]


def _used(
    mine: dict[int, SlotView],
    reps: dict[tuple[int, int], SlotView],
    step: int,
    sources: dict[int, tuple[int, int]],
    *,
    rank: int,
    shared: bool,
) -> list[SlotView]:
    """The snapshots this rank reads for ``step``: the one it loads, and
    those it sends (as :func:`agree` chose)."""
    used = []
    if rank not in sources:
        used.append(mine[step])
    elif sources[rank][0] == rank:
        used.append(reps[(rank, step)])
    for r, (src, _) in sources.items():
        if src == rank != r:
            view = _sent(mine, reps, step, r, shared)
            if all(view is not u for u in used):
                used.append(view)
    return used


def _any_rank(flag: bool, group: Any) -> bool:
    """Whether ``flag`` is set on any rank (every rank calls it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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


def _global(rank: int, group: Any) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _send(view: SlotView, dst: int, group: Any) -> None:
    """The bytes of ``view`` sent to rank ``dst`` alone, ``TRANSFER_CHUNK`` at a time."""
    import torch
    import torch.distributed as dist

    device = _device(group)
    whole = view.whole
    try:
        for i in range(0, len(whole), TRANSFER_CHUNK):
            with warnings.catch_warnings():  # read-only memory, only read
                warnings.simplefilter("ignore", UserWarning)
                chunk = torch.frombuffer(whole[i : i + TRANSFER_CHUNK], dtype=torch.uint8)
            dist.send(chunk.to(device), dst=_global(dst, group), group=group)
            del chunk
    finally:
        whole.release()


def _receive(size: int, src: int, group: Any) -> bytearray:
    """``size`` bytes from rank ``src``, ``TRANSFER_CHUNK`` at a time (into
    the result on the CPU; through one buffer of that size on a GPU)."""
    import torch
    import torch.distributed as dist

    device = _device(group)
    out = bytearray(size)
    staging = None
    for i in range(0, size, TRANSFER_CHUNK):
        n = min(TRANSFER_CHUNK, size - i)
        if device.type == "cpu":
            into = torch.frombuffer(out, dtype=torch.uint8, count=n, offset=i)
        else:
            if staging is None:
                staging = torch.empty(min(TRANSFER_CHUNK, size), dtype=torch.uint8, device=device)
            into = staging[:n]
        dist.recv(into, src=_global(src, group), group=group)
        if device.type != "cpu":
            out[i : i + n] = into.cpu().numpy().tobytes()
        del into
    return out


def _decoded(view: SlotView, map_location: Any) -> dict[str, Any]:
    state = decode(view.header, view.data, map_location)
    return state if isinstance(state, dict) else {"state": state}


def _received(data: bytes | bytearray, step: int, src: int, map_location: Any) -> dict[str, Any]:
    try:
        found = header_of(data)
        if found is None:
            raise SnapshotError("no snapshot")
        header, start = found
        view = memoryview(data)[start : start + header.data_size]
        if header.step != step:
            raise SnapshotError(f"it holds step {header.step}")
        check_data(header, view)
        state = decode(header, view, map_location)
    except SnapshotError as e:
        raise ConfigError(
            f"memory checkpoint step {step} received from rank {src} is damaged in transit: {e}"
        ) from e
    return state if isinstance(state, dict) else {"state": state}
