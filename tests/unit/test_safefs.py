"""elastrun.safefs: links, FIFOs and other users' folders are refused, never followed."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from elastrun.safefs import (
    UnsafePath,
    append_fd,
    check_parent,
    create_new,
    private_dir,
    read_regular,
    write_atomic,
)


def test_private_dir_creates_every_level_0700(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert private_dir(str(target), below=str(tmp_path)) == str(target)
    for p in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    private_dir(str(target), below=str(tmp_path))  # twice is fine


def test_private_dir_refuses_a_planted_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="symbolic link"):
        private_dir(str(tmp_path / "run" / "host"), below=str(tmp_path))
    assert list(elsewhere.iterdir()) == []


def test_private_dir_refuses_a_group_or_world_writable_folder(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o777)
    with pytest.raises(UnsafePath, match="writable by others"):
        private_dir(str(tmp_path / "run" / "host"), below=str(tmp_path))


def test_private_dir_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("x")
    with pytest.raises(UnsafePath, match="not a folder"):
        private_dir(str(tmp_path / "run" / "host"), below=str(tmp_path))


def test_check_parent_allows_sticky_shared_folders(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    check_parent(str(shared))
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePath, match="sticky"):
        check_parent(str(shared))


def test_create_new_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_new(str(tmp_path / "out.tmp"))
    assert victim.read_text() == "precious"


def test_append_refuses_a_link_and_a_fifo_without_blocking(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "log").symlink_to(victim)
    with pytest.raises(UnsafePath, match="symbolic link"):
        append_fd(str(tmp_path / "log"))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePath, match="FIFO"):
        append_fd(str(tmp_path / "fifo"))
    assert victim.read_text() == "precious"


def test_read_regular_refuses_fifo_link_and_oversize(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    done = threading.Event()

    def read_fifo() -> None:
        with pytest.raises(UnsafePath, match="FIFO"):
            read_regular(str(tmp_path / "fifo"), 100)
        done.set()

    t = threading.Thread(target=read_fifo, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "read_regular blocked on a FIFO"
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(UnsafePath, match="larger than 100"):
        read_regular(str(tmp_path / "big"), 100)
    assert read_regular(str(tmp_path / "big"), 101) == b"x" * 101
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(UnsafePath, match="symbolic link"):
        read_regular(str(tmp_path / "link"), 1000)
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "missing"), 10)


def test_read_regular_from_an_offset_and_the_head_of_a_larger_file(tmp_path: Path) -> None:
    f = tmp_path / "grows"
    f.write_bytes(b"head\n" + b"y" * 50)
    assert read_regular(str(f), 100, offset=5) == b"y" * 50
    with pytest.raises(UnsafePath, match="larger than 10"):
        read_regular(str(f), 10, offset=5)
    assert read_regular(str(f), 10, offset=5, partial=True) == b"y" * 10
    assert read_regular(str(f), 4, partial=True) == b"head"
    assert read_regular(str(f), 100, offset=1000) == b""


def test_write_atomic_replaces_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "state.json").symlink_to(victim)
    write_atomic(str(tmp_path / "state.json"), b"{}")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "state.json").is_symlink()
    assert (tmp_path / "state.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "victim"]
