"""A script that sets its own environment before it imports what a warm
interpreter imports ahead of time.

``os.environ["OMP_NUM_THREADS"] = "4"`` then ``import torch``: run cold, torch
reads the variable as it is imported; forked from a warm interpreter, torch
was imported before the script ran and never sees it (``TORCH_LOGS``,
``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``... alike). A warm start must
only save time, so such a script's workers start cold, with one line saying
why (agent/warm_pool.py).

:func:`env_set_first` reads the script's source (never runs it): an
assignment to ``os.environ[...]``, a call of ``os.environ.update`` /
``setdefault`` / ``pop``, ``os.putenv`` or ``os.unsetenv`` that comes, in the
file's order, before the first import of a module the warm interpreter
imports. Nesting does not matter (a ``main()`` that sets the variable then
imports torch counts). What it cannot see: a variable set by another module
the script imports first, or by ``exec``; that one is ignored by a warm
start, as the docs say (docs/cli.md, *Warm starts*).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from elastrun.frozen import frozen

__all__ = ["EnvFirst", "env_set_first"]

MAX_SOURCE = 8 << 20  # bytes of a script read
WRITES = frozenset(("update", "setdefault", "pop", "clear", "__setitem__", "__delitem__"))
CALLS = frozenset(("putenv", "unsetenv"))


@frozen
class EnvFirst:
    """``variable`` (``?`` when not a literal) set at ``line`` of ``path``,
    before the import of ``module`` at ``import_line``."""

    path: str
    variable: str
    line: int
    module: str
    import_line: int

    def describe(self) -> str:
        return (
            f"{self.path} sets {self.variable} (line {self.line}) before it imports "
            f"{self.module} (line {self.import_line}), which a warm interpreter imports "
            "ahead of time without it"
        )


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _key(node: ast.expr | None) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"


def _write(node: ast.AST) -> str | None:
    """The variable ``node`` sets in the environment, if it sets one."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.Delete):
        targets = node.targets if isinstance(node, ast.Delete) else [node.target]
    for target in targets:
        if isinstance(target, ast.Subscript) and _is_environ(target.value):
            return _key(target.slice)
    if isinstance(node, ast.Call):
        func = node.func
        first = node.args[0] if node.args else None
        if isinstance(func, ast.Attribute) and func.attr in WRITES and _is_environ(func.value):
            if func.attr == "update" and node.keywords and node.keywords[0].arg:
                return node.keywords[0].arg
            return _key(first)
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in CALLS:
            return _key(first)
    return None


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def env_set_first(path: str | None, modules: Iterable[str]) -> EnvFirst | None:
    """The first environment write of the source at ``path`` that comes before
    its first import of one of ``modules`` (or a submodule); None when there
    is none, or the file cannot be read or parsed (then nothing is known)."""
    roots = {m.split(".", 1)[0] for m in modules}
    if path is None or not roots:
        return None
    try:
        with open(path, "rb") as fp:
            source = fp.read(MAX_SOURCE + 1)
        if len(source) > MAX_SOURCE:
            return None
        tree = ast.parse(source, path)
    except (OSError, SyntaxError, ValueError):
        return None
    nodes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.stmt | ast.expr)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    first: tuple[str, int] | None = None
    for node in nodes:
        variable = _write(node)
        if variable is not None and first is None:
            first = (variable, node.lineno)
        for name in _imported(node):
            if name.split(".", 1)[0] in roots:
                if first is None:
                    return None
                return EnvFirst(path, first[0], first[1], name, node.lineno)
    return None
