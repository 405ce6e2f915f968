"""The module cache (agent/modcache.py) and the runner's choice of modules
(worker/_runner.py): keys, validation, bounds, atomic files."""

from __future__ import annotations

import json
import os
import sys
import types

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


def test_the_key_follows_the_script_its_flags_and_the_interpreter(tmp_path):
    k = cache_key("script", "train.py", ("--lr=0.1", "data"), "/usr/bin/python3", str(tmp_path))
    # Values of arguments do not change the key; flags do.
    assert k == cache_key(
        "script", "train.py", ("--lr=3", "other"), "/usr/bin/python3", str(tmp_path)
    )
    assert k != cache_key(
        "script", "train.py", ("--epochs=3", "data"), "/usr/bin/python3", str(tmp_path)
    )
    assert k != cache_key(
        "script", "eval.py", ("--lr=0.1", "data"), "/usr/bin/python3", str(tmp_path)
    )
    assert k != cache_key(
        "module", "train", ("--lr=0.1", "data"), "/usr/bin/python3", str(tmp_path)
    )
    assert args_shape(["--lr", "0.1", "-v", "--x=y"]) == ["--lr", "_", "-v", "--x"]
    assert len(k) == 32 and all(c in "0123456789abcdef" for c in k)


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


def test_damaged_or_hostile_files_are_ignored(tmp_path):
    cache = ModuleCache(str(tmp_path), "k")
    path = tmp_path / "modules-k.json"
    for content in (b"not json", b"[1,2]", b'{"v": 99, "modules": ["os"]}', b"\x00\xff"):
        path.write_bytes(content)
        assert cache.load().modules == []
    path.write_text(json.dumps({"v": 1, "modules": ["os", "../../etc", {"x": 1}]}))
    assert cache.load().modules == ["os"]
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    assert cache.load().modules == []
    path.unlink()
    os.symlink("/etc/passwd", path)
    assert cache.load().modules == []  # never follows a link


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
    assert not _runner.origin_installed(str(tmp_path / "x.py"), (), roots)
    assert _runner.origin_installed("built-in", (), roots)
