"""Memory checkpoints without an agent process: the snapshot format, what
cannot be copied (named by its key), hostile headers, the slot rotation, and
the one warning when shared memory has no room (real files, real torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastrun.errors import ConfigError
from elastrun.worker.snapshot import (
    ENV,
    MAGIC,
    CommitNote,
    SnapshotError,
    header_of,
    open_slot,
    parse_header,
    write_persisted,
)

torch = pytest.importorskip("torch")
from elastrun.train.memory import MemoryCheckpoint  # noqa: E402


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "local-0"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(ENV, str(d))
    monkeypatch.delenv("RANK", raising=False)
    return d


def _state(step: int) -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "extra": {"nan": float("nan"), "inf": float("-inf"), "t": (1, "a", None), "b": True},
        "half": torch.arange(5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }


def test_a_state_round_trips_exactly(folder: Path) -> None:
    mem = MemoryCheckpoint(log=None)
    state = _state(7)
    mem.save(state, step=7)
    mem.close()
    got = MemoryCheckpoint(log=None).load()
    assert got is not None and got["step"] == 7
    for k, v in state["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(got["model"][k], v)
    mom = got["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(mom, state["optimizer"]["state"][0]["momentum_buffer"])  # type: ignore[index]
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # type: ignore[index]
    assert got["extra"]["t"] == (1, "a", None) and got["extra"]["inf"] == float("-inf")
    assert got["extra"]["nan"] != got["extra"]["nan"] and got["extra"]["b"] is True
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], state["half"])
    assert got["empty"].shape == (0, 3) and torch.equal(got["strided"], state["strided"])


@pytest.mark.parametrize(
    ("bad", "key", "why"),
    [
        ({"a": {1: {"b": {1, 2}}}}, "state['a'][1]['b']", "builtins.set"),
        ({"m": [0, object()]}, "state['m'][1]", "builtins.object"),
        ({"s": torch.eye(3).to_sparse()}, "state['s']", "sparse"),
        ({"q": torch.empty(2, device="meta")}, "state['q']", "device meta"),
        ({(1, 2): 3}, "state[(1, 2)]", "key of type tuple"),
    ],
)
def test_state_that_cannot_be_copied_is_named_and_nothing_is_written(
    folder: Path, bad: dict[object, object], key: str, why: str
) -> None:
    mem = MemoryCheckpoint(log=None)
    mem.save({"w": torch.ones(3)}, step=1)
    mem.wait()
    before = sorted(os.listdir(folder))
    with pytest.raises(ConfigError) as e:
        mem.save(bad, step=2)
    assert key in str(e.value) and why in str(e.value)
    assert sorted(os.listdir(folder)) == before
    mem.close()
    got = MemoryCheckpoint(log=None).load()
    assert got is not None and got["w"].tolist() == [1.0, 1.0, 1.0]


def test_saves_rotate_over_the_slots_and_keep_the_newest_and_the_marked(folder: Path) -> None:
    mem = MemoryCheckpoint(str(folder.parent / "disk"), persist_every=4, log=None)
    for step in range(1, 8):
        mem.save({"w": torch.full((4,), float(step))}, step=step)
    mem.wait()
    note = CommitNote.read(str(folder))
    assert note is not None and note.step == 7
    assert note.marked is not None and note.marked.step == 4  # no agent wrote it yet
    steps = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("slot-"):
            view = open_slot(str(folder / name))
            assert view is not None
            steps[name] = view.header.step
            view.close()
    assert len(steps) == 3 and 4 in steps.values() and 7 in steps.values()
    # Once the agent has written step 4, its slot is written again.
    write_persisted(str(folder), note.marked.generation)
    mem.save({"w": torch.ones(4)}, step=8)
    mem.save({"w": torch.ones(4)}, step=9)
    mem.close()
    held = set()
    for name in sorted(os.listdir(folder)):
        if name.startswith("slot-"):
            view = open_slot(str(folder / name))
            assert view is not None
            held.add(view.header.step)
            view.close()
    assert held == {7, 8, 9}


def test_the_commit_note_carries_the_process_saves_so_far(folder: Path) -> None:
    before = CommitNote.read(str(folder))
    assert before is None
    mem = MemoryCheckpoint(log=None)
    for step in range(1, 4):
        mem.save({"w": torch.zeros(256)}, step=step)  # 1 KiB of state each
    mem.wait()
    note = CommitNote.read(str(folder))
    assert note is not None and note.saves is not None
    mem.close()
    got = note.saves
    assert got.pid == os.getpid() and got.saves >= 3 and got.nbytes >= 3 * 1024
    assert got.blocked_s > 0
    # What a stranger may have written there is refused naming the field.
    raw = json.loads((folder / "committed").read_text())
    raw["saves"]["bytes"] = -1
    (folder / "committed").write_text(json.dumps(raw))
    with pytest.raises(SnapshotError, match="saves: bytes is not an integer"):
        CommitNote.read(str(folder))
    raw["saves"] = None  # a note written without them
    (folder / "committed").write_text(json.dumps(raw))
    assert (note2 := CommitNote.read(str(folder))) is not None and note2.saves is None


def test_a_torn_or_damaged_slot_is_never_loaded(folder: Path) -> None:
    mem = MemoryCheckpoint(log=None)
    mem.save({"w": torch.full((1024,), 1.0)}, step=1)
    mem.save({"w": torch.full((1024,), 2.0)}, step=2)
    mem.close()
    note = CommitNote.read(str(folder))
    assert note is not None
    newest = folder / f"slot-{note.slot}"
    with open(newest, "r+b") as f:  # a bit flipped in the data
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    lines: list[str] = []
    got = MemoryCheckpoint(log=lines.append).load()
    assert got is not None and got["step" if "step" in got else "w"] is not None
    assert float(got["w"][0]) == 1.0
    assert any("is damaged" in ln and "its data's digest" in ln for ln in lines), lines
    with open(newest, "r+b") as f:  # no magic: being written, or torn by a kill
        f.write(bytes(len(MAGIC)))
    got = MemoryCheckpoint(log=None).load()
    assert got is not None and float(got["w"][0]) == 1.0


@pytest.mark.parametrize(
    ("patch", "why"),
    [
        (lambda h: h.replace(b'"v":1', b'"v":9'), "has version 9; this elastrun reads version 1"),
        (lambda h: h.replace(b'"dtype":"float32"', b'"dtype":"object"'), "dtype"),
        (lambda h: h.replace(b'"nbytes":4096', b'"nbytes":4092'), "do not fit"),
        (lambda h: h.replace(b'"offset":0', b'"offset":8'), "outside the data"),
        (lambda h: b"[" * 200 + b"]" * 200 + h[400:], "nested"),
    ],
)
def test_hostile_headers_are_refused_with_the_reason(folder: Path, patch, why: str) -> None:
    mem = MemoryCheckpoint(log=None)
    mem.save({"w": torch.ones(1024)}, step=1)
    mem.close()
    note = CommitNote.read(str(folder))
    assert note is not None
    data = bytearray((folder / f"slot-{note.slot}").read_bytes())
    assert header_of(data) is not None
    hlen = int.from_bytes(data[8:16], "little")
    header = patch(bytes(data[16 : 16 + hlen]))
    header = header[:hlen].ljust(hlen, b" ")
    data[16 : 16 + hlen] = header
    with pytest.raises(SnapshotError) as e:
        parse_header(data, len(data))
    assert why in str(e.value)
    data[8:16] = (1 << 40).to_bytes(8, "little")
    with pytest.raises(SnapshotError, match="over a bound"):
        parse_header(data, len(data))


def test_no_room_in_shared_memory_falls_back_to_disk_with_one_warning(
    folder: Path, tmp_path: Path
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {small} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        os.environ[ENV] = str(small)
        lines: list[str] = []
        disk = tmp_path / "disk"
        mem = MemoryCheckpoint(disk, persist_every=2, log=lines.append)
        mem.save({"w": torch.ones(16)}, step=1)  # fits
        mem.wait()
        for step in range(2, 6):
            mem.save({"w": torch.ones(1 << 20), "step": step}, step=step)  # 4 MiB: no room
        mem.close()
        warnings = [ln for ln in lines if "warning" in ln]
        assert len(warnings) == 1 and "no room for 4.0 MiB" in warnings[0], lines
        assert not mem.in_memory
        assert not [n for n in os.listdir(small) if n.startswith("slot-")]  # no stale copy
        assert sorted(p.name for p in disk.glob("ckpt-*.pt")) == [
            "ckpt-000000000002.pt",
            "ckpt-000000000004.pt",
        ]
        got = MemoryCheckpoint(disk, log=None).load()
        assert got is not None and got["step"] == 4
    finally:
        os.system(f"umount {small}")


def test_without_an_agent_saves_go_to_disk_after_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    lines: list[str] = []
    mem = MemoryCheckpoint(tmp_path / "disk", persist_every=3, log=lines.append)
    for step in range(1, 7):
        mem.save({"step": step, "w": torch.ones(2)}, step=step)
    assert len(lines) == 1 and "no elastrun agent" in lines[0]
    # under torchrun: no shared-memory advice, which only an agent's folder could use
    assert "/dev/shm" not in lines[0] and "Launch with elastrun" in lines[0]
    assert [p.name for p in sorted((tmp_path / "disk").glob("ckpt-*.pt"))] == [
        "ckpt-000000000003.pt",
        "ckpt-000000000006.pt",
    ]
    got = MemoryCheckpoint(tmp_path / "disk", log=None).load()
    assert got is not None and got["step"] == 6


def test_without_an_agent_only_local_rank_0_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun every rank has no agent: the node hears it once, from local rank 0."""
    monkeypatch.delenv(ENV, raising=False)
    said: dict[str, list[str]] = {}
    for local_rank in ("0", "1", "2"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        lines = said.setdefault(local_rank, [])
        mem = MemoryCheckpoint(tmp_path / f"disk{local_rank}", log=lines.append)
        mem.save({"w": torch.ones(1)}, step=1)
    assert [len(said[r]) for r in ("0", "1", "2")] == [1, 0, 0], said


def test_a_state_whose_header_is_over_the_bound_is_refused_before_a_byte_is_written(
    folder: Path,
) -> None:
    mem = MemoryCheckpoint(log=None)
    mem.save({"w": torch.ones(3)}, step=1)
    mem.wait()
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ConfigError) as e:
        mem.save({"w": torch.ones(3), "vocab": "x" * (17 << 20)}, step=2)
    assert "too large to describe" in str(e.value) and "at most 16777216" in str(e.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    mem.close()
    got = MemoryCheckpoint(log=None).load()
    assert got is not None and got["w"].tolist() == [1.0, 1.0, 1.0]
