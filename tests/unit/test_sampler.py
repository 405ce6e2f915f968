"""ElasticSampler: every sample once per epoch, across world-size changes mid-epoch."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastrun.errors import ConfigError
from elastrun.train import ElasticSampler, global_order

MODES = {
    "pad": {"drop_last": False, "pad": True},
    "drop": {"drop_last": True},
    "uneven": {"drop_last": False, "pad": False},
}


def _run_epoch(
    n: int,
    segments: list[tuple[int, int, float]],
    final: tuple[int, int],
    mode: str,
    seed: int,
    epoch: int,
) -> list[int]:
    """Simulate an epoch interrupted by restarts at other world sizes.

    Each segment starts fresh samplers (as restarted processes would) from the
    state rank 0 saved, every rank consumes one batch per step in lock-step,
    and the segment is cut after a fraction of its steps. The last segment
    runs to the end of the epoch. Returns every index consumed by any rank.
    """
    state: dict[str, Any] = ElasticSampler(n, seed=seed, rank=0, world_size=1).state_dict()
    state["epoch"] = epoch
    consumed: list[int] = []
    plan: list[tuple[int, int, float | None]] = [*segments, (final[0], final[1], None)]
    for world, batch, cut in plan:
        samplers = [
            ElasticSampler(n, seed=seed, rank=r, world_size=world, **MODES[mode])
            for r in range(world)
        ]
        for s in samplers:
            s.load_state_dict(state)
        shards = [list(s) for s in samplers]
        for s, shard in zip(samplers, shards, strict=True):
            assert len(s) == len(shard)
        if mode != "uneven":
            assert len({len(shard) for shard in shards}) == 1, "ranks must take equal steps"
        steps = math.ceil(max(len(shard) for shard in shards) / batch) if shards[0] else 0
        stop = steps if cut is None else int(cut * steps)
        for k in range(stop):
            for s, shard in zip(samplers, shards, strict=True):
                taken = shard[k * batch : (k + 1) * batch]
                consumed.extend(taken)
                s.advance(len(taken))
        states = [s.state_dict() for s in samplers]
        if cut is not None:
            assert all(st_ == states[0] for st_ in states), "ranks disagree on the offset"
        else:
            left = n - states[0]["offset"]
            assert left == 0 or (mode == "drop" and left < world), "the epoch must be finished"
        state = states[0]
    return consumed


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.integers(0, 240),
    segments=st.lists(
        st.tuples(st.integers(1, 7), st.integers(1, 9), st.floats(0.0, 0.999)), max_size=4
    ),
    final=st.tuples(st.integers(1, 7), st.integers(1, 9)),
    mode=st.sampled_from(sorted(MODES)),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
)
def test_every_sample_once_per_epoch_across_world_size_changes(
    n: int,
    segments: list[tuple[int, int, float]],
    final: tuple[int, int],
    mode: str,
    seed: int,
    epoch: int,
) -> None:
    consumed = _run_epoch(n, segments, final, mode, seed, epoch)
    counts = Counter(consumed)
    w_final = final[0]
    if mode == "uneven":
        assert sorted(consumed) == list(range(n))
    elif mode == "pad":
        # every sample at least once; fewer than W_final padded repeats, all in the last round
        assert set(counts) == set(range(n))
        assert len(consumed) - n < w_final
    else:
        # no repeats; fewer than W_final samples skipped (the final partial round)
        assert all(c == 1 for c in counts.values())
        assert n - len(consumed) < w_final


def test_resume_after_scale_up_continues_the_global_order() -> None:
    # torch's ElasticDistributedSampler applied the start index per shard, so a
    # restart at another world size lost and repeated samples. Here: 2 ranks
    # consume 3 steps of 4, then 3 ranks take over the rest of the same order.
    n = 50
    order = global_order(n, seed=7, epoch=2)
    a = [ElasticSampler(n, seed=7, rank=r, world_size=2) for r in range(2)]
    for s in a:
        s.set_epoch(2)
    firsts = [list(s)[:12] for s in a]
    for s in a:
        s.advance(12)
    state = a[0].state_dict()
    assert state["offset"] == 24
    assert sorted(firsts[0] + firsts[1]) == sorted(order[:24])
    b = [ElasticSampler(n, seed=7, rank=r, world_size=3) for r in range(3)]
    for s in b:
        s.load_state_dict(state)
    rest = [list(s) for s in b]
    assert rest[0][:3] == [order[24], order[27], order[30]]
    assert {len(r) for r in rest} == {9}  # 26 left -> 9 each, one pad
    assert set(rest[0] + rest[1] + rest[2]) == set(order[24:])


def test_order_depends_on_seed_and_epoch_only() -> None:
    base = global_order(100, seed=1, epoch=0)
    assert sorted(base) == list(range(100))
    assert base == global_order(100, seed=1, epoch=0)
    assert base != global_order(100, seed=1, epoch=1)
    assert base != global_order(100, seed=2, epoch=0)
    assert global_order(10, seed=1, epoch=0, shuffle=False) == list(range(10))
    # the union of the shards is the global order, interleaved, at any world size
    for world in (1, 2, 3, 7):
        shards = [list(ElasticSampler(100, seed=1, rank=r, world_size=world)) for r in range(world)]
        merged = [shards[i % world][i // world] for i in range(100)]
        assert merged == base


def test_state_from_another_dataset_is_refused() -> None:
    s = ElasticSampler(10, seed=1, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="dataset_len"):
        ElasticSampler(11, seed=1, rank=0, world_size=1).load_state_dict(s.state_dict())
    with pytest.raises(ConfigError, match="seed"):
        ElasticSampler(10, seed=2, rank=0, world_size=1).load_state_dict(s.state_dict())
    with pytest.raises(ConfigError, match="offset"):
        s.set_offset(11)
    with pytest.raises(ConfigError, match="rank"):
        ElasticSampler(10, seed=1, rank=2, world_size=2)


def test_rank_and_world_come_from_the_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    s = ElasticSampler(20, seed=0)
    assert (s.rank, s.world_size, len(s)) == (2, 4, 5)


def test_works_as_a_torch_dataloader_sampler() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(23))
    s = ElasticSampler(23, seed=3, rank=1, world_size=2)
    s.set_epoch(1)
    s.set_offset(5)
    loader = DataLoader(ds, batch_size=4, sampler=s)
    got = [int(v) for (batch,) in loader for v in batch]
    assert got == global_order(23, seed=3, epoch=1)[5:][1::2]  # 18 left: 9 each
    assert len(loader) == 3


def test_importing_the_helpers_does_not_import_torch() -> None:
    code = "import sys, elastrun.train; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
