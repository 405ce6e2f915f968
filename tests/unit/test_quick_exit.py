"""A failed worker forked from the warm interpreter flushes its files before
it ends without finalization (worker/_quick_exit.py)."""

from __future__ import annotations

import io
from pathlib import Path

from elastrun.worker._quick_exit import open_files


class Sink(io.RawIOBase):
    """A file class of a script's own."""

    def writable(self) -> bool:
        return True


def test_open_files_finds_every_file_object_of_whatever_class(tmp_path: Path) -> None:
    with open(tmp_path / "log.txt", "w") as text, open(tmp_path / "raw.bin", "wb") as raw:
        sink = Sink()
        found = open_files()
        for f in (text, text.buffer, raw, sink):
            assert any(g is f for g in found), f
        assert not any(g is tmp_path for g in found)  # not a file: not picked
