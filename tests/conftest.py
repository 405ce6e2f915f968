"""Shared test fixtures: repository paths and the Python that runs workers."""

from __future__ import annotations

import atexit
import compileall
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tests.store.etcd_fixture import etcd_with_auth  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# Workers started by tests run with the same interpreter and see the package.
os.environ.setdefault("PYTHONUNBUFFERED", "1")
# Every agent, worker and store a test starts imports elastrun from src/. Where
# PYTHONDONTWRITEBYTECODE is set, each would compile its ~200 modules from source
# (about 0.3 s of CPU per trivial job, a third of it); compiled here, once (only
# what changed since), they load from __pycache__ whatever the variable says.
compileall.compile_dir(REPO / "src", quiet=1)
# The warm interpreter's module lists (agent/modcache.py): one private folder
# for this test session, so a test never starts warmer because of an earlier
# session, and nothing is written to the user's cache.
if "ELASTRUN_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="elastrun-test-cache-")
    os.environ["ELASTRUN_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, True)


def pytest_configure(config: Any) -> None:
    """Compile the tests once, in the main process, before pytest-xdist starts
    its workers. Where PYTHONDONTWRITEBYTECODE is set (and on a fresh clone in
    any case) each worker would otherwise rewrite and compile every test module
    itself at collection, all at the same time: about 7 s of CPU each. The
    helper modules get ordinary pycs, the test modules pytest's own
    assertion-rewritten ones, which it reads whatever the variable says."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    tests = REPO / "tests"
    compileall.compile_dir(tests, quiet=1, rx=_REWRITTEN)
    todo = [str(p) for p in tests.rglob("*.py") if _REWRITTEN.search(str(p))]
    try:
        from _pytest.assertion import rewrite

        todo = [p for p in todo if rewrite._read_pyc(Path(p), _rewritten_pyc(p, rewrite)) is None]
    except (ImportError, AttributeError, TypeError):
        return  # another pytest: the workers rewrite the tests themselves
    if not todo:
        return
    global _CONFIG
    _CONFIG = config
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_rewrite, todo, chunksize=8))


# What pytest rewrites: the test modules and conftest files (pytest's default
# python_files, which this project keeps).
_REWRITTEN = re.compile(r"(/test_[^/]*|_test|/conftest)\.py$")
_CONFIG: Any = None


def _rewritten_pyc(path: str, rewrite: Any) -> Path:
    source = Path(path)
    return Path(rewrite.get_cache_dir(source)) / (source.name[:-3] + str(rewrite.PYC_TAIL))


def _rewrite(path: str) -> None:
    from _pytest.assertion import rewrite

    try:
        source_hash, code = rewrite._rewrite_test(Path(path), _CONFIG)
        rewrite.get_cache_dir(Path(path)).mkdir(exist_ok=True)
        state = _CONFIG.stash[rewrite.assertstate_key]
        rewrite._write_pyc(state, code, source_hash, _rewritten_pyc(path, rewrite))
    except (OSError, SyntaxError, AttributeError, TypeError, KeyError):
        pass  # left to the worker that imports it


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """The static checks first: one long test (mypy), run beside the others
    from the start rather than last, when nothing is left to overlap it."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/unit/test_static_checks.py"))
