"""`make check` (ruff, the format check, strict mypy) as part of the suite.

`make test` runs the checks as this test rather than before the suite, so that
they run beside the other tests (on 2 cores mypy alone takes about 25 s of one
core) instead of ahead of all of them. The commands are read from the
Makefile's ``check`` recipe, so the two cannot drift apart.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.unit.test_repo_hygiene import makefile_rules

pytestmark = pytest.mark.slow  # make test-fast runs `make check` itself


def check_commands() -> list[list[str]]:
    """The ``check`` recipe's command lines, with ``$(PY)`` this interpreter."""
    lines = makefile_rules()["check"][1]
    assert lines, "the Makefile's check rule has no commands"
    out = []
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "$(PY)", f"a check that is not run with the venv's Python: {line}"
        out.append([sys.executable, *argv[1:]])
    return out


def test_the_check_recipe_is_ruff_the_format_check_and_strict_mypy() -> None:
    tools = [argv[2:4] for argv in check_commands()]
    assert tools == [["ruff", "check"], ["ruff", "format"], ["mypy"]], tools


def test_make_check_passes() -> None:
    for argv in check_commands():
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
        said = done.stdout[-6000:] + done.stderr[-3000:]
        assert done.returncode == 0, f"{shlex.join(argv[1:])} failed (make check):\n{said}"
