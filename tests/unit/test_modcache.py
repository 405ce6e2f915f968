"""The module cache (agent/modcache.py) and the runner's choice of modules
(worker/_runner.py): keys, validation, bounds, atomic files."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import sys
import threading
import types

import pytest

from elastrun.agent.command import PythonModule, PythonScript
from elastrun.agent.modcache import (
    MAX_FILE_BYTES,
    MAX_MODULES,
    ModuleCache,
    ModuleList,
    args_shape,
    cache_key,
    default_cache_dir,
    merged,
    valid_names,
)
from elastrun.worker import _runner
from elastrun.worker._messages import Modules, from_json


def test_the_key_follows_the_script_its_flags_and_the_interpreter(tmp_path):
    py = "/usr/bin/python3"
    cwd = str(tmp_path)
    k = cache_key(PythonScript("train.py", ("--lr=0.1", "data"), python=py), cwd)
    # Values of arguments do not change the key; flags do.
    assert k == cache_key(PythonScript("train.py", ("--lr=3", "other"), python=py), cwd)
    assert k != cache_key(PythonScript("train.py", ("--epochs=3", "data"), python=py), cwd)
    assert k != cache_key(PythonScript("eval.py", ("--lr=0.1", "data"), python=py), cwd)
    assert k != cache_key(PythonModule("train", ("--lr=0.1", "data"), python=py), cwd)
    assert k != cache_key(PythonScript("train.py", ("--lr=0.1", "data"), python="/bin/py"), cwd)
    assert args_shape(["--lr", "0.1", "-v", "--x=y"]) == ["--lr", "_", "-v", "--x"]
    assert len(k) == 32 and all(c in "0123456789abcdef" for c in k)
    # The same file names as before the command was typed: caches written
    # by earlier versions are found.
    parts = ["script", str(tmp_path / "train.py"), "", ["--lr", "_"], os.path.realpath(py)]
    assert k == hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def test_the_default_folder():
    assert default_cache_dir({"ELASTRUN_CACHE_DIR": "/c"}) == "/c"
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/elastrun"
    assert default_cache_dir({}).endswith(os.path.join(".cache", "elastrun"))


def test_names_are_validated_and_bounded():
    assert valid_names(["a.b", "a.b", "../x", "x y", "", 3, "os", "a" * 201]) == ["a.b", "os"]
    assert valid_names("torch") == []
    assert len(valid_names([f"m{i}" for i in range(MAX_MODULES + 10)])) == MAX_MODULES
    assert merged(["a", "b"], ["b", "c", "d"], {"d": "unsafe"}) == ["a", "b", "c"]


def test_save_and_load_round_trip_atomically(tmp_path):
    cache = ModuleCache(str(tmp_path / "c"), "k")
    entry = ModuleList(modules=["os", "json"], skip={"bad": "it started a thread"}, torch="2.13.0")
    assert cache.save(entry)
    loaded = cache.load()
    assert loaded.modules == ["os", "json"] and loaded.skip == {"bad": "it started a thread"}
    assert loaded.torch == "2.13.0"
    assert os.stat(tmp_path / "c").st_mode & 0o777 == 0o700
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["modules-k.json"]  # no temporaries


def test_packages_that_read_a_rank_are_kept_for_the_per_rank_interpreters(tmp_path):
    cache = ModuleCache(str(tmp_path / "c"), "k")
    why = "lightning reads RANK when it is imported"
    entry = ModuleList(modules=["os", "lightning", "lightning.pytorch"], ranked={"lightning": why})
    assert cache.save(entry)
    loaded = cache.load()
    assert loaded.modules == ["os", "lightning", "lightning.pytorch"]
    assert loaded.ranked == {"lightning": why}
    assert loaded.shared() == ["os"]  # the shared warm interpreter never imports them
    # A package skipped altogether is not per-rank; a bad name is dropped.
    raw = {"v": 1, "modules": ["os", "a.b"], "skip": {"a": "x"}, "ranked": {"a": "y", "-": "z"}}
    parsed = ModuleList.from_json(raw)
    assert parsed is not None and parsed.ranked == {} and parsed.modules == ["os"]


def test_damaged_or_hostile_files_are_ignored(tmp_path):
    cache = ModuleCache(str(tmp_path), "k")
    path = tmp_path / "modules-k.json"
    for content in (b"not json", b"[1,2]", b"\x00\xff", b"[" * 100_000, b"{" * 40 + b"}" * 40):
        path.write_bytes(content)
        assert cache.load().modules == []
        assert cache.refused and cache.error and "ignored" in cache.error, content[:10]
    path.write_text(json.dumps({"v": 1, "modules": ["os", "../../etc", {"x": 1}, "this"]}))
    assert cache.load().modules == ["os"] and cache.error is None
    path.write_bytes(b'{"v": 99, "modules": ["os"]}')  # another version's: replaced quietly
    assert cache.load().modules == [] and cache.error is None
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    assert cache.load().modules == [] and "larger than" in (cache.error or "")
    path.unlink()
    os.symlink("/etc/passwd", path)
    assert cache.load().modules == [] and "symbolic link" in (cache.error or "")
    path.unlink()
    os.mkfifo(path)  # opened without O_NONBLOCK, this would wait for a writer forever
    assert cache.load().modules == [] and "FIFO" in (cache.error or "")
    path.unlink()
    path.write_text(json.dumps({"v": 1, "modules": ["os"]}))
    os.chown(path, 65534, 65534)  # (the tests run as root)
    assert cache.load().modules == [] and "owned by uid 65534" in (cache.error or "")


def test_the_script_is_never_read_back_from_its_cache(tmp_path):
    cache = ModuleCache(str(tmp_path), "k")
    (tmp_path / "modules-k.json").write_text(json.dumps({"v": 1, "modules": ["train", "os"]}))
    assert cache.load(script="train").modules == ["os"]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder-link"])
def test_a_save_replaces_what_was_planted_and_never_writes_through_it(tmp_path, kind):
    target = tmp_path / "target"
    target.mkdir()
    folder = tmp_path / "c"
    if kind == "folder-link":
        os.symlink(target, folder)  # the folder itself a link: not used
    else:
        folder.mkdir(mode=0o700)
    cache = ModuleCache(str(folder), "k")
    if kind == "fifo":
        os.mkfifo(cache.path)
    elif kind == "symlink":
        os.symlink(target / "victim", cache.path)
    saved = cache.save(ModuleList(modules=["os"]))
    assert list(target.iterdir()) == []
    if kind == "folder-link":
        assert not saved and cache.refused and "symbolic link" in (cache.error or "")
        return
    assert saved
    info = os.lstat(cache.path)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert cache.load().modules == ["os"]


@pytest.mark.parametrize("problem", ["another-user", "writable-by-others"])
def test_a_folder_another_user_controls_is_not_used(tmp_path, problem):
    folder = tmp_path / "c"
    folder.mkdir(mode=0o700)
    planted = json.dumps({"v": 1, "modules": ["os"]})
    (folder / "modules-k.json").write_text(planted)
    if problem == "another-user":
        os.chown(folder, 65534, 65534)  # (the tests run as root)
    else:
        os.chmod(folder, 0o777)
    cache = ModuleCache(str(folder), "k")
    assert cache.load().modules == []
    assert cache.refused and cache.error and str(folder) in cache.error
    assert "not used" in cache.error
    assert not cache.save(ModuleList(modules=["json"]))
    assert (folder / "modules-k.json").read_text() == planted


def test_the_folder_is_created_private_with_its_missing_parents(tmp_path):
    cache = ModuleCache(str(tmp_path / "home" / ".cache" / "elastrun"), "k")
    assert cache.save(ModuleList(modules=["os"]))
    for part in ("home", "home/.cache", "home/.cache/elastrun"):
        assert stat.S_IMODE(os.stat(tmp_path / part).st_mode) == 0o700


def test_a_folder_that_is_a_file_is_reported_not_raised(tmp_path):
    (tmp_path / "f").write_text("")
    cache = ModuleCache(str(tmp_path / "f"), "k")
    assert not cache.save(ModuleList(modules=["os"]))
    assert cache.error and "f" in cache.error


def test_the_runner_names_installed_modules_but_never_the_script(tmp_path):
    roots = _runner.installed_roots()
    mine = types.ModuleType("mine")
    mine.__file__ = str(tmp_path / "mine.py")
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train.py")
    alias = sys.modules["os"]  # os.path is posixpath under another name
    modules = {
        "__main__": script,
        "json": sys.modules["json"],
        "sys": sys,
        "mine": mine,
        "os.path": alias.path,
        "gone": None,
        "weird name": mine,
    }
    assert _runner.select_modules(modules, "installed", roots) == ["json", "sys"]
    assert _runner.select_modules(modules, "all", roots) == ["json", "sys", "mine"]
    assert _runner.select_modules(modules, "all", roots, limit=1) == ["json"]
    # Nor the script imported under its own name, an entry point, or a module
    # that acts when imported, even with every module in scope.
    acting = {n: types.ModuleType(n) for n in ("train", "pkg.__main__", "this", "__hello__")}
    assert _runner.select_modules({**modules, **acting}, "all", roots, script="train") == [
        "json",
        "sys",
        "mine",
    ]
    assert not _runner.origin_installed(str(tmp_path / "x.py"), (), roots)
    assert _runner.origin_installed("built-in", (), roots)


class _ThreadNoting(_runner.Channel):
    """The runner's channel over a real socket pair, noting which thread sent."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.threads: list[str] = []

    def send(self, message):
        self.threads.append(threading.current_thread().name)
        super().send(message)


def test_the_module_list_is_made_outside_the_script_s_first_optimizer_step():
    """Finding where each module lives takes a few tenths of a second: made
    inside the first optimizer step, it lengthened every start and restart's
    first step (and the goodput accounting counted it as training). It is
    made from a copy of the modules, in a thread, and goes out before the
    script's end."""
    ours, theirs = socket.socketpair()
    channel = _ThreadNoting(ours.detach())
    try:
        recorder = _runner.ModuleRecorder(channel, "installed", 0.0)
        recorder._on_step()  # as torch.optim calls it, in the script's thread
        theirs.settimeout(60)
        line = theirs.recv(1 << 20).split(b"\n")[0]
        assert channel.threads == ["elastrun-modules"]
        sent = from_json(json.loads(line))
        assert isinstance(sent, Modules) and sent.why == "optimizer_step"
        assert "json" in sent.modules
        recorder.finish()  # the script's end: nothing left to wait for
    finally:
        theirs.close()
        if channel.fd is not None:
            os.close(channel.fd)
