"""The layering rules of docs/ARCHITECTURE.md, checked on the source.

One direction of imports: foundation -> store -> rendezvous -> agent ->
launcher/cli; worker/train helpers depend only on the foundation. The launcher
and the agent never import torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "elastrun"

FOUNDATION = {
    "errors",
    "clock",
    "events",
    "event_kinds",
    "names",
    "endpoint",
    "procs",
    "failure",
    "safefs",
    "untrusted",
    "fields",
    "goodput",
    "frozen",
}
# layer name -> the elastrun layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "foundation": set(),
    "store": {"foundation"},
    # worker: rendezvous/notes checks the modules note's names by worker/_modnames' rule
    "rendezvous": {"foundation", "store", "worker"},
    "agent": {"foundation", "rendezvous", "worker"},
    "launcher": {"foundation", "store", "rendezvous", "agent", "worker"},
    "cli": {"foundation", "store", "rendezvous", "agent", "launcher", "worker", "status", "train"},
    "status": {"foundation", "store", "rendezvous"},
    "worker": {"foundation"},
    "train": {"foundation", "worker"},
    "integrations": {"foundation", "worker", "train"},
    "package": {
        "foundation",
        "store",
        "rendezvous",
        "agent",
        "launcher",
        "worker",
        "train",
        "integrations",
    },
}

# layer name -> single modules of other layers it may import besides
MODULES: dict[str, set[str]] = {
    # elastrun status reads --rdzv-conf as the launcher reads it
    "status": {"elastrun.launcher.rdzv_conf"},
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    head = parts[1]
    if head in FOUNDATION:
        return "foundation"
    if head in {"cli", "__main__", "launch"}:  # launch: ``python -m elastrun.launch``
        return "cli"
    return head


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_imports_follow_the_layers() -> None:
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        mod = module_name(path)
        mine = layer_of(mod)
        allowed = ALLOWED.get(mine, set()) | {mine}
        for imp in imported_modules(path):
            if imp.split(".")[0] != "elastrun":
                continue
            theirs = layer_of(imp)
            if theirs not in allowed and imp not in MODULES.get(mine, set()):
                violations.append(f"{mod} ({mine}) imports {imp} ({theirs})")
    assert not violations, "\n".join(violations)


def test_launcher_and_agent_do_not_import_torch() -> None:
    code = (
        "import sys, elastrun, elastrun.cli, elastrun.store, elastrun.rendezvous.api\n"
        "import importlib\n"
        "for m in ('elastrun.launcher.cli', 'elastrun.agent', 'elastrun.rendezvous.dynamic'):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if not (e.name or '').startswith('elastrun'):\n"
        "            raise\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_training_helpers_do_not_import_the_launcher() -> None:
    """A restarted worker imports what its script imports: ``elastrun.train``
    must not bring the agent, rendezvous, store and launcher along; the
    public ``elastrun.launch`` / ``LaunchConfig`` still work, on first use."""
    code = (
        "import sys, elastrun.train, elastrun.train.memory, elastrun.train.memory_load\n"
        "heavy = ('elastrun.agent', 'elastrun.launcher', 'elastrun.rendezvous', 'elastrun.store')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "assert not bad, bad[:5]\n"
        "import elastrun\n"
        "assert callable(elastrun.launch) and elastrun.LaunchConfig.__name__ == 'LaunchConfig'\n"
        "from elastrun import launch, LaunchConfig\n"
        "try:\n"
        "    elastrun.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
