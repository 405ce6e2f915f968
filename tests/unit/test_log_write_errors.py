"""A worker log file that cannot be written: the pump goes on, the operator is
told once per file (bounded), events record it, lost bytes are counted.

A disk that refuses writes after the file was opened is the file-size limit
(``RLIMIT_FSIZE``, in a child process: every write past it fails, as on a
full disk, with ``EFBIG``). A path under a regular file (the folder cannot be
made), and a link, a FIFO or a device at the log path (refused, never
followed, never waited on) fail at open. A full tmpfs with a real job
(``ENOSPC``): tests/integration/test_full_disk.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.logs import MAX_LOG_WARNINGS, LinePump, LogWriteErrors, StreamRoute
from elastrun.event_kinds import Event
from elastrun.events import EventSink

LIMIT = 100  # bytes the "disk" takes before every write fails

# Runs the pump in a child whose file-size limit is LIMIT bytes; prints what
# the operator saw (warnings, events) and the pump's tail as one JSON object.
CHILD = """
import asyncio, json, resource, signal, sys
from elastrun.agent.logs import LinePump, LogWriteErrors, StreamRoute
from elastrun.events import ListSink

path, console, limit = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
chunks = json.loads(sys.argv[4])
said, sink = [], ListSink()
errors = LogWriteErrors(sink, said.append)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

async def go():
    reader = asyncio.StreamReader()
    pump = LinePump(reader, StreamRoute("stdout", path, console, "", keep_tail=True), errors,
                    rank=3, local_rank=1)
    for chunk in chunks:
        reader.feed_data(chunk.encode())
    reader.feed_eof()
    await asyncio.wait_for(pump.run(), 10.0)
    return pump

pump = asyncio.run(go())
events = [[e["kind"], e] for e in sink.events]
sys.stderr.write(json.dumps({"said": said, "events": events, "tail": list(pump.tail),
                             "lost": errors.lost}) + "\\n")
"""


def pump_on_a_failing_disk(
    path: Path, chunks: list[str], *, console: bool
) -> tuple[str, dict[str, Any]]:
    """(the console, the child's report) of a pump whose file takes LIMIT bytes."""
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(int(console)), str(LIMIT), json.dumps(chunks)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return res.stdout, json.loads(res.stderr.strip().splitlines()[-1])


class Events(EventSink):
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: Event) -> None:
        self.seen.append((event.KIND, event.to_json()))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.seen]


def pump_through(
    path: str, chunks: list[bytes], errors: LogWriteErrors, *, console: bool
) -> LinePump:
    async def go() -> LinePump:
        reader = asyncio.StreamReader()
        route = StreamRoute("stdout", path, console, "", keep_tail=True)
        pump = LinePump(reader, route, errors, rank=3, local_rank=1)
        for chunk in chunks:
            reader.feed_data(chunk)
        reader.feed_eof()
        await asyncio.wait_for(pump.run(), 10.0)
        return pump

    return asyncio.run(go())


def test_a_failing_disk_is_warned_once_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    chunks = ["first line\n", "second line\n" * 100, "no newline at the end"]
    console, report = pump_on_a_failing_disk(path, chunks, console=True)
    # The console and the tail did not depend on the disk.
    assert console.count("second line") == 100 and "no newline at the end" in console
    assert report["tail"][-1] == "no newline at the end"
    # One warning naming the file and the error, one event, the bytes counted.
    said = report["said"]
    assert len(said) == 1
    assert str(path) in said[0] and "File too large" in said[0]
    assert "rank 3 stdout" in said[0] and "the console still shows it" in said[0]
    assert [k for k, _ in report["events"]] == ["log_write_failed", "log_output_lost"]
    failed, lost = (f for _, f in report["events"])
    assert failed["errno"] == errno.EFBIG and failed["path"] == str(path)
    # What reached the file and what was lost add up to what the worker wrote.
    written = path.stat().st_size
    assert written == LIMIT
    assert lost["bytes"] == sum(len(c) for c in chunks) - written == report["lost"][str(path)]


def test_redirected_output_that_is_lost_says_so(tmp_path: Path) -> None:
    console, report = pump_on_a_failing_disk(tmp_path / "out.log", ["x\n" * 200], console=False)
    assert console == ""
    assert "that output is lost (--redirects sends it to the file only)" in report["said"][0]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device", "other_users"])
def test_a_hostile_log_path_is_refused_never_followed_nor_waited_on(
    tmp_path: Path, kind: str
) -> None:
    """A link, a FIFO (no reader: an open() would block), a device or another
    user's file at a log path: refused at open, reported once as a log write
    error; the pump goes on, nothing is written through it."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "stdout.log"
    if kind == "symlink":
        path.symlink_to(victim)
        expect = "symbolic link"
    elif kind == "fifo":
        os.mkfifo(path)
        expect = "FIFO"
    elif kind == "device":
        path = Path(os.devnull)
        expect = "device"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another user")
        path.write_text("theirs")
        os.chown(path, 65534, 65534)
        expect = "owned by uid 65534"
    events, said = Events(), list[str]()
    errors = LogWriteErrors(events, said.append)
    pump = pump_through(str(path), [b"hello\n", b"world\n"], errors, console=True)
    assert list(pump.tail) == ["hello", "world"]
    assert len(said) == 1 and str(path) in said[0] and expect in said[0], said
    assert events.kinds() == ["log_write_failed", "log_output_lost"]
    assert errors.lost[str(path)] == len(b"hello\nworld\n")
    assert victim.read_text() == "precious"
    if kind == "other_users":
        assert path.read_text() == "theirs"


def test_a_folder_that_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = str(blocker / "0" / "stdout.log")  # under a regular file: ENOTDIR
    events, said = Events(), list[str]()
    errors = LogWriteErrors(events, said.append)
    pump_through(path, [b"hello\n"], errors, console=True)
    assert len(said) == 1 and path in said[0]
    assert events.kinds() == ["log_write_failed", "log_output_lost"]
    assert errors.lost[path] == len(b"hello\n")


def test_warnings_are_bounded_per_agent() -> None:
    events, said = Events(), list[str]()
    errors = LogWriteErrors(events, said.append)
    n = MAX_LOG_WARNINGS + 5
    for i in range(n):
        for _ in range(3):  # the same file failing again is not repeated
            errors.report(f"/logs/{i}.log", OSError(errno.ENOSPC, "No space left on device"))
    assert len(said) == MAX_LOG_WARNINGS + 1
    assert "not shown" in said[-1]
    assert events.kinds() == ["log_write_failed"] * n  # every file is in the event log
    assert "first: /logs/0.log: No space left on device" in errors.summary()
