"""The files and folders the agent and the worker helpers write, attacked one by one.

Links planted where a file is created, FIFOs where one is read (each read is
bounded: done in a thread waited on for at most 10 s, then the FIFO is opened
to free it and the test fails), folders of another user (root only: given to
uid 65534 with chown) or writable by others. What must hold: nothing is written
through a link, nothing blocks, a refusal names the path and the problem.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from elastrun.agent.error_files import MAX_ERROR_FILE_BYTES, read_error_file
from elastrun.agent.log_dirs import (
    HOST_PID_FILE,
    claim_host_dir,
    rank_dir,
    release_host_dir,
    run_dir,
    temp_dir,
)
from elastrun.errors import ConfigError, WorkerError
from elastrun.events import JsonLinesSink
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from elastrun.names import RunId
from elastrun.safefs import UnsafePath
from elastrun.worker.checkpoint_files import RecordError, read_record, record_path
from elastrun.worker.record import write_error_file

T = TypeVar("T")
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder away")


def bounded(fn: Callable[[], T], fifo: Path) -> T:
    """``fn()`` in a thread, waited on for at most 10 s (see the docstring)."""
    out: list[T] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if errors:
        raise errors[0]
    return out[0]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text("precious")
    return path


# ------------------------------------------------------------ log folders


def test_host_folders_are_private_and_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder, pidfile = claim_host_dir("logs", RunId("run1"), "node-a")
    assert folder == str(tmp_path / "logs" / "run1" / "node-a")
    assert pidfile == os.path.join(folder, HOST_PID_FILE)
    for p in (tmp_path / "logs" / "run1", Path(folder)):
        assert (p.stat().st_mode & 0o777) == 0o700
    assert Path(pidfile).read_text() == str(os.getpid())
    release_host_dir(pidfile)
    assert not os.path.exists(pidfile)


@pytest.mark.parametrize("planted", ["link", "fifo", "dead holder"])
def test_a_planted_or_stale_pid_file_is_made_anew_never_written_through(
    tmp_path: Path, victim: Path, planted: str
) -> None:
    host = tmp_path / "logs" / "run1" / "node-a"
    host.mkdir(parents=True, mode=0o700)
    pid = host / HOST_PID_FILE
    if planted == "link":
        pid.symlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(pid)
    else:
        pid.write_text("999999999")  # no such process
    folder, pidfile = bounded(
        lambda: claim_host_dir(str(tmp_path / "logs"), RunId("run1"), "node-a"), pid
    )
    assert folder == str(host) and pidfile == str(pid)
    assert not pid.is_symlink() and pid.read_text() == str(os.getpid())
    assert victim.read_text() == "precious"


@as_root
def test_a_run_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "logs" / "run1").mkdir(parents=True)
    os.chown(tmp_path / "logs" / "run1", NOBODY, NOBODY)
    with pytest.raises(ConfigError) as e:
        claim_host_dir(str(tmp_path / "logs"), RunId("run1"), "node-a")
    msg = str(e.value)
    assert msg.startswith(f"--log-dir: refusing {tmp_path / 'logs' / 'run1'}: it is owned by uid")
    assert "remove it or choose another folder" in msg
    assert list((tmp_path / "logs" / "run1").iterdir()) == []


def test_a_group_writable_host_folder_is_refused(tmp_path: Path) -> None:
    host = tmp_path / "logs" / "run1" / "node-a"
    host.mkdir(parents=True)
    os.chmod(host, 0o770)
    with pytest.raises(ConfigError, match=r"refusing .*node-a: it is writable by its group"):
        claim_host_dir(str(tmp_path / "logs"), RunId("run1"), "node-a")
    assert list(host.iterdir()) == []


def test_a_log_dir_others_may_write_needs_the_sticky_bit(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, 0o777)
    with pytest.raises(ConfigError, match=r"without the sticky bit"):
        run_dir(str(logs), RunId("run1"))
    assert list(logs.iterdir()) == []
    os.chmod(logs, 0o1777)
    assert run_dir(str(logs), RunId("run1")) == str(logs / "run1")


def test_an_attempt_folder_planted_as_a_link_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "attempt_0").symlink_to(elsewhere)
    with pytest.raises(WorkerError, match=r"refusing .*attempt_0: it is a symbolic link"):
        rank_dir(str(base / "attempt_0"), 0)
    assert list(elsewhere.iterdir()) == []
    assert rank_dir(str(base / "attempt_1"), 3) == str(base / "attempt_1" / "3")


def test_a_temporary_folder_others_could_rearrange_is_refused(tmp_path: Path, monkeypatch) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    with pytest.raises(WorkerError, match=r"set TMPDIR to a folder only you can write"):
        temp_dir(RunId("run1"))
    assert list(shared.iterdir()) == []
    os.chmod(shared, 0o1777)
    made = Path(temp_dir(RunId("run1")))
    assert made.parent == shared and (made.stat().st_mode & 0o777) == 0o700


def test_a_relative_log_dir_and_events_file_are_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    plan = resolve(LaunchConfig(standalone=True, log_dir="logs", events_file="ev.jsonl"))
    assert plan.workers.logs.dir == str(tmp_path / "logs")
    assert plan.workers.events_file == str(tmp_path / "ev.jsonl")


# ------------------------------------------------------------ event log


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_the_event_log_is_never_a_link_nor_a_fifo(
    tmp_path: Path, victim: Path, planted: str
) -> None:
    path = tmp_path / "events.jsonl"
    if planted == "link":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)
    with pytest.raises(UnsafePath, match="symbolic link" if planted == "link" else "FIFO"):
        bounded(lambda: JsonLinesSink(path), path)
    assert victim.read_text() == "precious"


# ------------------------------------------------------------ error files


def test_an_error_file_that_is_a_fifo_is_unreadable_and_said_so(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    os.mkfifo(path)
    info = bounded(lambda: read_error_file(str(path)), path)
    assert info is not None
    assert info.message == f"the error file {path} was unreadable: is a FIFO, not a regular file"


def test_an_error_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"message": "the content of another file"}))
    path = tmp_path / "error.json"
    path.symlink_to(secret)
    info = read_error_file(str(path))
    assert info is not None and "unreadable: is a symbolic link" in info.message
    assert "another file" not in info.message


@pytest.mark.parametrize("content", ["huge", "deep"])
def test_an_error_file_over_the_bounds_is_unreadable_and_said_so(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "error.json"
    if content == "huge":
        path.write_bytes(b" " * (MAX_ERROR_FILE_BYTES + 1))
        why = f"is larger than {MAX_ERROR_FILE_BYTES} bytes"
    else:
        path.write_bytes(b"[" * 100_000)  # a RecursionError for json.loads
        why = "nested more than"
    info = read_error_file(str(path))
    assert info is not None and "unreadable:" in info.message and why in info.message


def test_the_error_file_writer_replaces_a_planted_link(tmp_path: Path, victim: Path) -> None:
    path = tmp_path / "error.json"
    path.symlink_to(victim)
    assert write_error_file(ValueError("distinctive"), str(path)) == str(path)
    assert victim.read_text() == "precious"
    assert not path.is_symlink()
    info = read_error_file(str(path))
    assert info is not None and info.message == "ValueError: distinctive"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json", "victim"]


# ------------------------------------------------------------ checkpoint records


def test_a_checksum_record_that_is_a_fifo_never_blocks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt-000000000001.pt"
    ckpt.write_bytes(b"data")
    os.mkfifo(record_path(ckpt))
    with pytest.raises(RecordError, match="its checksum record is a FIFO, not a regular file"):
        bounded(lambda: read_record(ckpt), record_path(ckpt))


@pytest.mark.parametrize(
    ("planted", "why"),
    [
        (b"[" * 30_000 + b"]" * 30_000, "is nested more than"),  # was a RecursionError
        (b"x" * (64 * 1024 + 1), r"is 65537 bytes \(at most 65536\)"),
        (b"not json", "is not valid JSON"),
        (b"[1]", "its checksum record is not a JSON object"),
        (b'{"v": 9, "file": "ckpt-000000000001.pt"}', "has version 9"),
    ],
    ids=["deep", "big", "not-json", "not-object", "other-version"],
)
def test_a_planted_checksum_record_is_refused_with_the_reason(
    tmp_path: Path, planted: bytes, why: str
) -> None:
    ckpt = tmp_path / "ckpt-000000000001.pt"
    ckpt.write_bytes(b"data")
    record_path(ckpt).write_bytes(planted)
    with pytest.raises(RecordError, match=why):
        read_record(ckpt)
