"""A fresh clone is clean and its first two commands do what README.md says.

* no run output is tracked (checkpoints, ``latest``), and run outputs land in ignored folders;
* ``make demo`` installs only elastrun and torch (pinned to the CPU wheel CI uses, the same pin
  as the ``dev`` extra) and runs ``examples/demo.py``; ``make test`` installs the dev tools;
* README.md opens with exactly ``make demo`` and ``make test``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import REPO


def makefile_rules() -> dict[str, tuple[str, list[str]]]:
    """target -> (prerequisites, recipe lines), for the Makefile's simple rules."""
    rules: dict[str, tuple[str, list[str]]] = {}
    current: str | None = None
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        if line.startswith("\t") and current is not None:
            rules[current][1].append(line.strip())
            continue
        m = re.match(r"^([^\s:=#][^:=]*):(?!=)\s*(.*)$", line)
        current = None
        if m:
            current = m[1].strip()
            rules[current] = (m[2], [])
    return rules


def makefile_vars() -> dict[str, str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return dict(re.findall(r"^(\w+)\s*[:?]?=\s*(.*?)\s*$", text, re.M))


def test_no_run_output_is_tracked() -> None:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files, "git ls-files listed nothing"
    tracked_outputs = [
        f
        for f in files
        if f.endswith((".pt", ".pth", ".ckpt", ".jsonl"))
        or f.split("/")[0] in ("checkpoints", "runs")
        or f.rsplit("/", 1)[-1] == "latest"
    ]
    assert not tracked_outputs


def test_run_outputs_go_to_ignored_folders() -> None:
    ignored = (REPO / ".gitignore").read_text(encoding="utf-8").split()
    assert "runs/" in ignored
    assert "/checkpoints/" in ignored
    train = (REPO / "examples" / "train.py").read_text(encoding="utf-8")
    default = re.search(r'^DEFAULT_CHECKPOINT_DIR = "([^"]+)"$', train, re.M)
    assert default and default[1].startswith("runs/"), "the example's checkpoints go to runs/"
    demo = (REPO / "examples" / "demo.py").read_text(encoding="utf-8")
    assert re.search(r'"--run-dir", default="runs/demo"', demo)
    if shutil.which("git") is not None and (REPO / ".git").exists():
        for path in ("runs/train/checkpoints/ckpt-000000000001.pt", "runs/demo/events.jsonl"):
            check = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False)
            assert check.returncode == 0, f"{path} is not ignored"


def test_make_demo_installs_only_what_the_demo_needs() -> None:
    rules, variables = makefile_rules(), makefile_vars()
    prereqs, recipe = rules["demo"]
    assert prereqs.split() == ["setup-demo"]
    assert recipe == ["$(PY) examples/demo.py $(DEMO_ARGS)"]
    assert rules["setup-demo"][0].split() == ["$(DEMO_STAMP)"]
    install = " ".join(rules["$(DEMO_STAMP)"][1])
    assert "'.[torch]'" in install and "'$(TORCH_PIN)'" in install
    assert "dev" not in install

    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    dev_pins = [d for d in extras["dev"] if d.startswith("torch==")]
    assert dev_pins == [variables["TORCH_PIN"]], "the demo's torch is CI's torch"
    # `make test` (and check) installs the dev extra
    assert rules["setup"][0].split() == ["$(DEV_STAMP)"]
    assert "'.[dev]'" in " ".join(rules["$(DEV_STAMP)"][1])
    assert "setup" in rules["test"][0].split()
    # ... and runs the checks: as a test of the suite (tests/unit/test_static_checks.py)
    assert (REPO / "tests" / "unit" / "test_static_checks.py").is_file()
    assert '-m "not bench"' in " ".join(rules["test"][1]), "make test runs the slow tests too"
    for tool in ("pytest", "mypy", "ruff", "hypothesis"):
        assert any(d.startswith(tool) for d in extras["dev"])
        assert not any(d.startswith(tool) for d in extras["torch"])


def test_readme_opens_with_make_demo_and_make_test() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first_block
    commands = [line.split("#")[0].strip() for line in first_block[1].splitlines()]
    assert commands == ["make demo", "make test"]
    assert (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().endswith("make test")


# Names of documents that live outside the repository (the project's own notes),
# and issue numbers: a comment that cites them cannot be followed by a reader.
OUTSIDE_REFERENCE = re.compile(
    "|".join(
        (
            r"USER" + r"-PAIN",
            r"\bSPEC" + r"(?: section| §)? ?\d",
            r"\bissue" + r" #?\d+",
        )
    )
)


def test_code_cites_no_document_outside_the_repository() -> None:
    found = []
    for top in ("src", "tests", "bench", "examples"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if OUTSIDE_REFERENCE.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
