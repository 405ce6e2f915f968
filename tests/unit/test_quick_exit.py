"""A worker forked from the warm interpreter, failed or not, flushes its files
before it ends without finalization (worker/_quick_exit.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from elastrun.worker._quick_exit import BOOKKEEPING_FINALIZERS, open_files

SRC = Path(__file__).resolve().parents[2] / "src"


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


SCRIPT = """
import sys, weakref
from elastrun.worker._quick_exit import QuickExit
how, ending, path = sys.argv[1:]
quick = QuickExit(forked=how == "forked")
class Library: pass
def _del_library(): print("torch.library's finalizer ran", flush=True)
_del_library.__module__ = "torch.library"  # as torch.library's own
def remove_folder(): print("the script's finalizer ran", flush=True)
libraries, folder = [Library() for _ in range(3)], Library()
for lib in libraries:
    weakref.finalize(lib, _del_library)
weakref.finalize(folder, remove_folder)
class Held:
    def __del__(self): print("finalized", flush=True)
held = Held()  # alive until the interpreter's finalization
log = open(path, "w")  # never closed
log.write("written before the end")
if ending == "failed":
    quick.failed(1)
    sys.exit(1)
quick.succeeded()
"""


@pytest.mark.parametrize("ending", ["failed", "succeeded"])
@pytest.mark.parametrize("forked", [True, False])
def test_a_forked_worker_ends_without_finalization_but_with_its_exit_work(
    forked: bool, ending: str, tmp_path: Path
) -> None:
    """A forked worker, whether its script failed or succeeded, skips the
    interpreter's finalization (its teardown of the modules it shares with
    the warm interpreter copies every page they are on) and undoing torch's
    operator registrations (48 ms of a raising rank's 90 ms exit); every
    other finalizer (the script's exit work) runs, a file left open keeps
    what was written to it, and the exit status is the script's. A worker
    started cold exits as usual."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *sys.path])}
    how = "forked" if forked else "cold"
    log = tmp_path / "log.txt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, how, ending, str(log)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (1 if ending == "failed" else 0), done.stderr
    assert done.stdout.count("the script's finalizer ran") == 1
    assert done.stdout.count("torch.library's finalizer ran") == (0 if forked else 3)
    assert done.stdout.count("finalized") == (0 if forked else 1)
    assert log.read_text() == "written before the end"


def test_torch_s_library_finalizers_are_the_ones_skipped() -> None:
    """torch (as installed) still registers its libraries' finalizers under the
    name skipped (a rename would make the skip a silent no-op)."""
    pytest.importorskip("torch")
    registry = getattr(weakref.finalize, "_registry", {})
    names = {(info.func.__module__, info.func.__qualname__) for info in registry.values()}
    assert names >= BOOKKEEPING_FINALIZERS
