"""Sharded states in memory checkpoints, the parts without a job: a shard's
place in its global tensor, the layout's bounds, the states refused (a mesh
that does not fit the world, a placement that cannot be held, a
ShardedTensor, a state on two GPUs), the disk copy in torch's format, and the
device the collectives use."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.errors import ConfigError
from elastrun.train.transfer_device import choose_device
from elastrun.worker.shard_layout import LayoutError, ShardLayout, shard_slices
from elastrun.worker.snapshot import DTYPE_SIZES, SnapshotError, SnapshotHeader
from elastrun.worker.snapshot_bounds import check_tree

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def layout(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[str, ...]
) -> ShardLayout:
    n = 1
    for d in mesh_shape:
        n *= d
    stride = (*shape[1:], 1)
    return ShardLayout("cpu", tuple(range(n)), mesh_shape, None, placements, shape, stride)


@pytest.mark.parametrize("n", range(10))
@pytest.mark.parametrize("k", range(1, 6))
def test_a_shard_sits_where_torch_puts_it(n: int, k: int) -> None:
    chunks = torch.arange(n).chunk(k) if n else ()
    sizes = [len(c) for c in chunks] + [0] * (k - len(chunks))
    lay = layout((n,), (k,), ("S0",))
    got = [shard_slices(lay, r) for r in range(k)]
    assert [g[0][1] for g in got if g] == sizes
    covered = [i for g in got if g for i in range(g[0][0], g[0][0] + g[0][1])]
    assert covered == list(range(n))  # in order, each index once


def test_a_2d_mesh_shards_each_mesh_dimension_in_turn() -> None:
    lay = layout((7, 4), (2, 2), ("S0", "S1"))
    assert shard_slices(lay, 0) == [(0, 4), (0, 2)]
    assert shard_slices(lay, 1) == [(0, 4), (2, 2)]
    assert shard_slices(lay, 3) == [(4, 3), (2, 2)]
    rep = layout((7, 4), (2, 2), ("S0", "R"))
    assert shard_slices(rep, 1) == shard_slices(rep, 0) == [(0, 4), (0, 4)]
    assert shard_slices(rep, 9) is None  # not in the mesh


def test_a_layout_round_trips_and_damage_is_named() -> None:
    lay = ShardLayout("cuda", (0, 2, 1, 3), (2, 2), ("dp", "tp"), ("S0", "R"), (8, 2), (2, 1))
    assert ShardLayout.from_json(lay.to_json()) == lay
    bad: list[tuple[str, Any, str]] = [
        ("mesh", [0, 0, 1, 3], "distinct ranks"),
        ("mesh", [0, 1, 2], "distinct ranks"),
        ("placements", ["S0", "P"], "one R or S<dim>"),
        ("placements", ["S2", "R"], "does not have"),
        ("stride", [1], "one per dimension"),
        ("shape", [-1, 2], "not an integer"),
        ("device", "../x", "device type"),
        ("names", ["dp"], "one name per dimension"),
    ]
    for field, value, why in bad:
        with pytest.raises(LayoutError, match=why):
            ShardLayout.from_json({**lay.to_json(), field: value})
    tree = {"d": [["w", {"s": [0, {**lay.to_json(), "mesh": "x"}]}]]}
    assert "layout is damaged" in str(check_tree(tree, 1))
    assert check_tree({"s": [0, lay.to_json()]}, 1) is None
    assert "twice" in str(check_tree({"l": [{"s": [0, lay.to_json()]}, {"t": 0}]}, 1))


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_states_that_cannot_be_held_are_refused_naming_their_key(world_of_one: None) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from elastrun.train.state_codec import flatten

    wide = DeviceMesh("cpu", torch.tensor([0, 1]), _init_backend=False)  # 2 ranks; world 1
    t = DTensor.from_local(torch.ones(2, 2), wide, [Shard(0)], run_check=False)
    with pytest.raises(
        ConfigError,
        match=r"state\['m'\]\['w'\] is a DTensor on a mesh of ranks "
        r"\[0, 1\], which does not match this rank's world \(rank 0 of 1\)",
    ):
        flatten({"m": {"w": t}})
    one = DeviceMesh("cpu", torch.tensor([0]))
    p = DTensor.from_local(torch.ones(2), one, [Partial()], run_check=False)
    with pytest.raises(ConfigError, match=r"state\['p'\] is a DTensor placed P\(sum\)"):
        flatten({"p": p})
    with FakeTensorMode():
        a, b = torch.empty(3, device="cuda:0"), torch.empty(3, device="cuda:1")
    with pytest.raises(
        ConfigError,
        match=r"state\['b'\] is on cuda:1, and state\['a'\] on "
        r"cuda:0: the state mixes devices",
    ):
        flatten({"a": a, "step": torch.ones(1), "b": b})
    flatten({"a": a, "step": torch.ones(1)})  # one GPU beside CPU tensors: fine


def test_a_sharded_tensor_is_refused_by_name(world_of_one: None) -> None:
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from elastrun.train.state_codec import flatten

    st = empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4)
    with pytest.raises(ConfigError, match=r"state\['st'\] is a ShardedTensor.*save DTensors"):
        flatten({"st": st})


def test_the_disk_copy_is_a_torch_file_with_every_dtype_and_value() -> None:
    from elastrun.train.state_codec import copy_into, flatten
    from elastrun.worker.torch_file import header_record, write_torch_file

    state: dict[Any, Any] = {
        "plain": [1, -7, 2**40, -(2**62), 2.5, float("inf"), "x", None, True, False],
        "nested": {"t": (torch.zeros(2, 2, dtype=torch.bfloat16),), 5: {}, "e": [], "u": ()},
        "empty": torch.zeros(0, 3, dtype=torch.uint16),
    }
    for name in DTYPE_SIZES:
        state[name] = torch.arange(6).reshape(2, 3).to(getattr(torch, name))
    flat = flatten(state)
    buf = bytearray(flat.data_size)
    copy_into(flat, buf, 0)
    header = SnapshotHeader(1, 0, 1, 1, flat.data_size, "0" * 64, flat.entries, flat.tree)
    raw = header.encode()

    def written(header_bytes: bytes) -> bytes:
        f = io.BytesIO()
        chunks = lambda e: iter([memoryview(buf)[e.offset :][: e.nbytes]])  # noqa: E731
        write_torch_file(f, "archive", header, header_bytes, chunks)
        return f.getvalue()

    data = written(raw)
    got = torch.load(io.BytesIO(data), weights_only=True)
    assert got["plain"] == state["plain"] and got["nested"]["e"] == [] and got["nested"]["u"] == ()
    assert got["nested"][5] == {}
    for name in [*DTYPE_SIZES, "empty"]:
        assert got[name].dtype == state[name].dtype and torch.equal(got[name], state[name]), name
    assert torch.equal(got["nested"]["t"][0], state["nested"]["t"][0])
    assert header_record(data) == header
    assert header_record(b"not a zip") is None
    edited = raw.replace(b'"step":1', b'"step":9')  # its seal no longer matches
    with pytest.raises(SnapshotError, match="does not match its seal"):
        header_record(written(edited))


@pytest.mark.parametrize(
    ("backend", "bound", "local_rank", "count", "current", "want"),
    [
        ("gloo", None, "3", 8, 0, "cpu"),
        ("nccl", None, "3", 8, 0, "cuda:3"),  # not current_device()'s GPU 0
        ("cpu:gloo,cuda:nccl", None, "2", 8, 0, "cuda:2"),  # mixed: NCCL for CUDA
        ("cuda:nccl,cpu:gloo", 5, "2", 8, 0, "cuda:5"),  # the group's bound device first
        ("nccl", None, "3", 1, 0, "cuda:0"),  # one visible GPU per process
        ("cpu:gloo,cuda:gloo", None, "1", 8, 0, "cpu"),
        ("NCCL", None, None, 8, 4, "cuda:4"),  # no LOCAL_RANK: the current device
    ],
)
def test_the_transfer_device(
    backend: str, bound: int | None, local_rank: str | None, count: int, current: int, want: str
) -> None:
    got = choose_device(
        backend, bound=bound, local_rank=local_rank, device_count=count, current=current
    )
    assert got == want


def test_a_gloo_group_transfers_on_the_cpu(world_of_one: None) -> None:
    from elastrun.train.transfer_device import transfer_device

    assert str(transfer_device()) == "cpu"


def test_shards_reach_only_their_own_rank(world_of_one: None) -> None:
    from torch.distributed.tensor import DTensor

    from elastrun.train.sharded import LocalShard, disk_state, memory_state

    lay = ShardLayout("cpu", (0,), (1,), None, ("S0",), (3,), (1,))

    def state(rank: int, world: int) -> dict[str, Any]:
        return {"w": LocalShard(torch.ones(3), lay, "state['w']", rank, world), "n": 1}

    got = memory_state(state(0, 1))
    assert isinstance(got["w"], DTensor) and got["w"].shape == (3,) and got["n"] == 1
    with pytest.raises(ConfigError, match=r"rank 0 got rank 1's shards.*shared=False"):
        memory_state(state(1, 1))  # a snapshot sent from another rank
    with pytest.raises(ConfigError, match=r"shards of a world of 2 ranks.*checkpoint-convert"):
        disk_state(state(0, 2), directory="/ckpt")


def test_convert_refuses_what_it_cannot_use_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastrun.train.convert import main

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\0" * 100)
    for path, why in [
        (plain, "not a memory checkpoint written by elastrun's agent"),
        (junk, "not a memory checkpoint written by elastrun's agent"),
        (tmp_path / "missing.pt", "No such file"),
    ]:
        assert main([str(tmp_path / "out"), str(path)]) == 1
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err


def test_a_rank_never_takes_another_ranks_shards_from_its_folder(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import elastrun.train.memory as memory
    from elastrun.train import MemoryCheckpoint

    monkeypatch.setenv("ELASTRUN_MEMORY_CHECKPOINT_DIR", str(tmp_path))
    w = distribute_tensor(torch.arange(4.0), DeviceMesh("cpu", torch.tensor([0])), [Shard(0)])
    with monkeypatch.context() as m:  # the folder was rank 1's before the ranks were renumbered
        m.setattr(memory, "_rank_world", lambda: (1, 1))
        mem = MemoryCheckpoint(None, log=None)
        mem.save({"w": w, "step": 3}, step=3)
        mem.close()
    lines: list[str] = []
    assert MemoryCheckpoint(None, log=lines.append).load() is None
    assert lines == [
        "=> memory checkpoint step 3 not used: rank 0's copy holds rank 1's shards (state['w'], "
        "...); sharded states are not resharded in memory (the disk checkpoints serve, if any)"
    ]
    mem = MemoryCheckpoint(None, log=None)
    mem.save({"w": w, "step": 4}, step=4)  # saved by this rank: its own again
    mem.close()
    got = MemoryCheckpoint(None, log=None).load()
    assert got is not None and got["step"] == 4 and torch.equal(got["w"].to_local(), w.to_local())
