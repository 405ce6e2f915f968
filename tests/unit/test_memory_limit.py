"""/dev/shm headroom against the container's memory limit
(worker/memory_limit.py, and the memory checkpoint's disk fallback it leads
to): fake cgroup trees, as a container's /sys/fs/cgroup shows them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elastrun.train.memory import MemoryCheckpoint
from elastrun.worker import memory_limit
from elastrun.worker.snapshot import ENV

MiB = 1 << 20


def _v2(root: Path, path: str, levels: dict[str, tuple[str, int]]) -> Path:
    """A cgroup v2 tree: ``levels[folder] = (memory.max, memory.current)``;
    this process in ``path``. Returns its /proc/self/cgroup file."""
    for folder, (limit, usage) in levels.items():
        d = root / folder.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{usage}\n")
    self_cgroup = root / "self-cgroup"
    self_cgroup.write_text(f"0::{path}\n")
    return self_cgroup


def test_the_tightest_level_of_a_v2_hierarchy_bounds_the_headroom(tmp_path):
    cg = tmp_path / "cg"
    me = _v2(cg, "/pod/ctr", {"": ("max", 0), "pod": (str(1024 * MiB), 900 * MiB)})
    _v2(cg, "/pod/ctr", {"pod/ctr": ("max", 100 * MiB)})
    room, limit_file = memory_limit.headroom(str(cg), str(me)) or (0, "")
    assert room == 124 * MiB and limit_file == str(cg / "pod" / "memory.max")
    why = memory_limit.refusal(64 * MiB, str(cg), str(me))
    assert why is not None and "memory limit" in why and "OOM" in why and "124 MiB" in why


def test_inactive_page_cache_is_not_counted_as_used(tmp_path):
    # Reading a data set fills the page cache, which the kernel reclaims first.
    cg = tmp_path / "cg"
    me = _v2(cg, "/", {"": (str(4096 * MiB), 4000 * MiB)})
    (cg / "memory.stat").write_text(f"anon 100\nfile {3500 * MiB}\ninactive_file {3000 * MiB}\n")
    room, _ = memory_limit.headroom(str(cg), str(me)) or (0, "")
    assert room == 3096 * MiB
    assert memory_limit.refusal(1024 * MiB, str(cg), str(me)) is None


def test_v1_and_no_limit(tmp_path):
    cg = tmp_path / "cg"
    mem = cg / "memory" / "job"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(str(8192 * MiB))
    (mem / "memory.usage_in_bytes").write_text(str(1024 * MiB))
    me = tmp_path / "self-cgroup"
    me.write_text("12:cpu:/\n4:memory:/job\n0::/\n")
    assert memory_limit.refusal(1024 * MiB, str(cg), str(me)) is None
    assert memory_limit.refusal(7000 * MiB, str(cg), str(me)) is not None
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert memory_limit.headroom(str(cg), str(me)) is None
    assert memory_limit.headroom(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_a_save_past_the_memory_limit_falls_back_to_disk_instead_of_an_oom_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /dev/shm (here a plain folder) has room; the container's limit does not.
    cg = tmp_path / "cg"
    me = _v2(cg, "/", {"": (str(512 * MiB), 500 * MiB)})
    monkeypatch.setattr(memory_limit, "CGROUP", str(cg))
    monkeypatch.setattr(memory_limit, "SELF_CGROUP", str(me))
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(ENV, str(shm))
    lines: list[str] = []
    mem = MemoryCheckpoint(tmp_path / "disk", persist_every=1, log=lines.append)
    mem.save({"w": torch.ones(1 << 20)}, step=1)  # 4 MiB: 12 MiB of room less the margin
    mem.close()
    assert not mem.in_memory
    warnings = [ln for ln in lines if "warning" in ln]
    assert len(warnings) == 1 and "memory limit" in warnings[0], lines
    assert str(cg / "memory.max") in warnings[0]
    assert not [n for n in os.listdir(shm) if n.startswith("slot-")]
    assert [p.name for p in (tmp_path / "disk").glob("ckpt-*.pt")] == ["ckpt-000000000001.pt"]
