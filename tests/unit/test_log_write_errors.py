"""A worker log file that cannot be written: the pump goes on, the operator is
told once per file (bounded), events record it, lost bytes are counted.

Uses /dev/full (every write fails with ENOSPC, as on a full disk) and a
path under a regular file (the folder cannot be made). A full tmpfs with a
real job: tests/integration/test_full_disk.py.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.logs import MAX_LOG_WARNINGS, LinePump, LogWriteErrors, StreamRoute
from elastrun.events import EventSink

FULL = "/dev/full"
needs_dev_full = pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")


class Events(EventSink):
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.seen.append((kind, fields))

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


@needs_dev_full
def test_a_full_disk_is_warned_once_and_counted(capsys: pytest.CaptureFixture[str]) -> None:
    events, said = Events(), list[str]()
    errors = LogWriteErrors(events, said.append)
    chunks = [b"first line\n", b"second line\n" * 100, b"no newline at the end"]
    pump = pump_through(FULL, chunks, errors, console=True)
    # The console and the tail did not depend on the disk.
    out = capsys.readouterr().out
    assert out.count("second line") == 100 and "no newline at the end" in out
    assert list(pump.tail)[-1] == "no newline at the end"
    # One warning naming the file and the error, one event, the bytes counted.
    assert len(said) == 1
    assert FULL in said[0] and "No space left on device" in said[0]
    assert "rank 3 stdout" in said[0] and "the console still shows it" in said[0]
    assert events.kinds() == ["log_write_failed", "log_output_lost"]
    failed, lost = (f for _, f in events.seen)
    assert failed["errno"] == errno.ENOSPC and failed["path"] == FULL
    assert lost["bytes"] == sum(len(c) for c in chunks)
    assert errors.any and errors.lost[FULL] == lost["bytes"]


@needs_dev_full
def test_redirected_output_that_is_lost_says_so() -> None:
    said: list[str] = []
    errors = LogWriteErrors(None, said.append)
    pump_through(FULL, [b"x\n"], errors, console=False)
    assert "that output is lost (--redirects sends it to the file only)" in said[0]


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
