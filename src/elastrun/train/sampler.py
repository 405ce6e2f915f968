"""An elastic data sampler that resumes mid-epoch by global sample offset.

How it works (one epoch):

1. **Global order.** The epoch's order of the ``dataset_len`` indices is a
   permutation fixed by ``(seed, epoch)`` (or ``0..n-1`` with
   ``shuffle=False``). It does not depend on the world size, and it is
   computed by a small self-contained generator (SplitMix64 + Fisher-Yates),
   so every node computes the same order whatever its Python or torch version.
2. **Offset.** ``offset`` counts the samples of this epoch that the job has
   already consumed, globally. They are the first ``offset`` entries of the
   global order. The rest, ``order[offset:]``, is *the remainder*.
3. **Sharding.** Rank ``r`` of ``W`` takes ``remainder[r::W]`` (strided). When
   all ranks consume in step (each takes ``b`` samples per training step), the
   samples consumed so far are exactly a prefix of the remainder, of length
   ``W * consumed_per_rank``. So the new global offset is
   ``offset + W * consumed_per_rank`` — a number that means the same thing at
   any world size. After a restart at a different world size, the remainder is
   re-sharded by the new ranks: within an epoch no sample is lost or repeated.

The tail (the last round, when ``len(remainder)`` is not a multiple of ``W``):

- ``drop_last=False, pad=True`` (default): every sample of the remainder is
  yielded once, and the ranks that would come up short get fewer than ``W``
  extra indices taken from the start of the remainder (as torch's
  DistributedSampler does), so all ranks yield the same number of indices and
  collectives stay in step. At most ``W - 1`` samples per epoch are seen twice,
  all in the final round, after every real sample.
- ``drop_last=True``: the last ``len(remainder) % W`` samples of the remainder
  are skipped this epoch (fewer than ``W``); no sample is repeated.
- ``drop_last=False, pad=False``: exactly once, no padding; ranks then yield
  up to one index fewer than rank 0, so a DDP loop must cope with uneven inputs
  (e.g. ``DistributedDataParallel.join()``).

The training loop reports progress with :meth:`ElasticSampler.advance` after
each step (``len(batch)`` of this rank), and checkpoints
:meth:`ElasticSampler.state_dict` (JSON-able ints and a bool; no world size in
it, it is elastic). Without ``advance`` calls, the saved offset stays at the
segment's start and a resume replays the epoch from there (nothing lost).

Unlike torch's ``ElasticDistributedSampler``, the start offset is applied to
the global order before sharding (not to each rank's shard, which loses and
repeats samples when the world size changes), and there is no length assertion
to trip after scaling. The class is plain Python (no torch import); a
``DataLoader`` accepts it as ``sampler=``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

from elastrun.errors import ConfigError

__all__ = ["ElasticSampler", "global_order"]

_MASK64 = (1 << 64) - 1
_STATE_VERSION = 1


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def global_order(dataset_len: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's global order of ``range(dataset_len)``; same on every node.

    A Fisher-Yates shuffle driven by SplitMix64 seeded from ``(seed, epoch)``.
    The bounded draw is ``(x * (i + 1)) >> 64``, whose bias (below
    ``dataset_len / 2**64``) does not matter for sampling.
    """
    order = list(range(dataset_len))
    if not shuffle or dataset_len < 2:
        return order
    state, _ = _splitmix64((seed & _MASK64) ^ 0x5851F42D4C957F2D)
    state = (state ^ ((epoch & _MASK64) * 0xD1B54A32D192ED03)) & _MASK64
    for i in range(dataset_len - 1, 0, -1):
        state, x = _splitmix64(state)
        j = (x * (i + 1)) >> 64
        order[i], order[j] = order[j], order[i]
    return order


def _world_from_dist() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except (RuntimeError, ValueError):
        return None
    return None


class ElasticSampler:
    """Shards an epoch's global order by the current rank/world size; resumes by offset.

    ``rank``/``world_size`` default to the initialised default process group,
    else to the launcher's ``RANK``/``WORLD_SIZE`` (rank 0 of 1 without one).
    See the module documentation for the exact semantics.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 0:
            raise ConfigError(f"dataset_len must be an int >= 0, got {dataset_len!r}")
        if rank is None or world_size is None:
            found = _world_from_dist()
            if found is None:
                from elastrun.train.context import WorkerContext

                ctx = WorkerContext.from_env()
                found = (ctx.rank, ctx.world_size)
            rank = found[0] if rank is None else rank
            world_size = found[1] if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} is not in [0, world_size={world_size})")
        self.dataset_len = dataset_len
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pad = pad
        self.rank = rank
        self.world_size = world_size
        self._epoch = 0
        self._base = 0  # global offset where the current segment started
        self._consumed = 0  # samples this rank consumed in the current segment
        self._order: list[int] | None = None
        self._order_epoch = -1

    # -- position ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def offset(self) -> int:
        """Global number of this epoch's samples consumed so far (0..dataset_len)."""
        if self._consumed == 0:
            return self._base
        if self.drop_last and self._consumed >= self._segment_len(self._base):
            return self.dataset_len  # the skipped tail counts as consumed
        return min(self.dataset_len, self._base + self._consumed * self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (offset 0)."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        self._epoch = int(epoch)
        self._base, self._consumed = 0, 0

    def set_offset(self, global_offset: int) -> None:
        """Resume the current epoch after ``global_offset`` samples consumed job-wide."""
        if not 0 <= global_offset <= self.dataset_len:
            raise ConfigError(f"offset {global_offset} is not in [0, {self.dataset_len}]")
        self._base, self._consumed = int(global_offset), 0

    def advance(self, local_samples: int) -> None:
        """Record that this rank consumed ``local_samples`` more (call after each step)."""
        if local_samples < 0:
            raise ConfigError(f"local_samples must be >= 0, got {local_samples}")
        self._consumed += local_samples

    def state_dict(self) -> dict[str, Any]:
        """Where the job is: ``{"epoch", "offset", "seed", "dataset_len", ...}``."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "offset": self.offset,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` saved at any world size.

        Raises :class:`~elastrun.errors.ConfigError` if the data set length,
        seed or shuffle differ: the saved offset would then mean other samples.
        """
        for key, mine in (
            ("dataset_len", self.dataset_len),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if key in state and state[key] != mine:
                raise ConfigError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={mine!r}; resuming would visit other samples"
                )
        self.set_epoch(int(state["epoch"]))
        self.set_offset(int(state["offset"]))

    # -- iteration ---------------------------------------------------------

    def _global(self) -> list[int]:
        if self._order is None or self._order_epoch != self._epoch:
            self._order = global_order(
                self.dataset_len, seed=self.seed, epoch=self._epoch, shuffle=self.shuffle
            )
            self._order_epoch = self._epoch
        return self._order

    def _segment_len(self, base: int) -> int:
        remaining = self.dataset_len - base
        w, r = self.world_size, self.rank
        if self.drop_last:
            return remaining // w
        if self.pad:
            return -(-remaining // w)
        return max(0, -(-(remaining - r) // w))

    def indices(self) -> list[int]:
        """This rank's indices for the rest of the epoch, from the current offset."""
        remainder = self._global()[self.offset :]
        w = self.world_size
        if self.drop_last:
            remainder = remainder[: (len(remainder) // w) * w]
        elif self.pad and remainder and len(remainder) % w:
            extra = w - len(remainder) % w
            remainder = remainder + (remainder * (extra // len(remainder) + 1))[:extra]
        return remainder[self.rank :: w]

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current offset (starts a new segment)."""
        base = self.offset
        self._base, self._consumed = base, 0
        return iter(self.indices())

    def __len__(self) -> int:
        return self._segment_len(self.offset)

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(dataset_len={self.dataset_len}, rank={self.rank}, "
            f"world_size={self.world_size}, epoch={self._epoch}, offset={self.offset})"
        )
