"""Shared test fixtures: repository paths and the Python that runs workers."""

from __future__ import annotations

import atexit
import compileall
import os
import shutil
import sys
import tempfile
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


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """The static checks first: one long test (mypy), run beside the others
    from the start rather than last, when nothing is left to overlap it."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/unit/test_static_checks.py"))
