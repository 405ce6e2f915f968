"""Which modules a warm interpreter may import ahead of time (stdlib only).

Importing a module runs its top-level code. The warm interpreter imports, in
advance, the modules a worker reported it imported (``_runner.py``), read
back from the per-script cache (``agent/modcache.py``) or from the job's
note written by another node; every such name passes :func:`refusal`, in the
agent and again in the warm interpreter (``_zygote.py``) before each import.
A name is refused when:

* it is not a dotted Python name (ASCII identifiers), or is longer than
  ``MAX_NAME`` characters; a list keeps at most ``MAX_MODULES`` names;
* any part of it is ``__main__`` or ``__mp_main__``: a program's entry point
  (``python -m pkg`` runs ``pkg.__main__``). Importing one runs that program:
  ``unittest.__main__`` runs the tests named on the command line, which in a
  warm interpreter is the training script itself;
* its top-level name is a dunder name (``__hello__``, ``__phello__``:
  CPython's frozen test modules, which print when imported), ``__future__``
  aside;
* it belongs to a package in ``DENY``: modules whose import is an action
  rather than definitions (``this`` prints, ``antigravity`` opens a browser,
  ``test`` holds CPython's test suite, ``test.autotest`` runs it), or that
  exist to open windows (``idlelib``, ``tkinter``, ``turtle``, ``turtledemo``);
* it is elastrun's own runner code (``_elastrun*``, loaded by path);
* it is the script itself or under it (the script's file name without
  ``.py``, or the ``-m`` module): importing it would run the script.

The second rule is where a module comes from: with the ``installed`` scope
(the default), only modules of the standard library or of installed packages
(:func:`installed_roots`) are named by a worker (``_runner.select_modules``)
or imported (``_zygote.py``; the agent checks a peer's names the same way,
:func:`top_installed`), never one from the script's folder or the working
directory. Looking a top-level name up imports nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import site
import sysconfig
import types
from collections.abc import Iterable, Sequence

MAX_MODULES = 5000
MAX_NAME = 200
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
ENTRY_POINTS = frozenset(("__main__", "__mp_main__"))
DENY = frozenset(
    ("this", "antigravity", "test", "idlelib", "tkinter", "turtle", "turtledemo", "_tkinter")
)


def refusal(name: object, script: str | None = None) -> str | None:
    """Why ``name`` may not be imported ahead of time (None: it may).
    ``script``: the module name that would run the script (see
    :func:`script_module`)."""
    if not isinstance(name, str) or not name:
        return "not a module name"
    if len(name) > MAX_NAME:
        return f"a name longer than {MAX_NAME} characters"
    if not NAME_RE.match(name):
        return "not a dotted Python name"
    return _refused_module(name, script)


def _refused_module(name: str, script: str | None) -> str | None:
    """The rules on a well-formed name (first that applies)."""
    parts = name.split(".")
    top = parts[0]
    dunder = len(top) > 4 and top.startswith("__") and top.endswith("__")
    rules = (
        (
            not ENTRY_POINTS.isdisjoint(parts),
            "a program's entry point (__main__): importing it runs the program",
        ),
        (dunder and top != "__future__", "a special module (a dunder name)"),
        (top in DENY, "a module that acts when imported"),
        (top.startswith("_elastrun"), "elastrun's own runner code"),
        (bool(script) and (name == script or name.startswith(f"{script}.")), "the script itself"),
    )
    return next((why for hit, why in rules if hit), None)


def checked(names: object, script: str | None = None, limit: int = MAX_MODULES) -> list[str]:
    """The names of the list ``names`` that pass :func:`refusal`: distinct,
    in order, at most ``limit``. Anything but a list has none."""
    if not isinstance(names, list):
        return []
    out: list[str] = []
    seen: set[str] = set()
    for name in names:
        if len(out) >= limit:
            break
        if refusal(name, script) is None and name not in seen:
            seen.add(name)
            out.append(name)
    return out


def script_module(kind: str, target: str) -> str | None:
    """The module name under which the worker's target could be imported:
    a script's file name without ``.py`` (its folder is ``sys.path[0]``), or
    the ``-m`` module."""
    if kind == "module":
        return target if NAME_RE.match(target) else None
    base = os.path.basename(target)
    stem = base[:-3] if base.endswith(".py") else base
    return stem if NAME_RE.match(stem) and "." not in stem else None


def installed_roots() -> tuple[str, ...]:
    """Folders whose modules count as the standard library or installed packages."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    with contextlib.suppress(AttributeError):
        roots.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        roots.add(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(r) for r in roots if r}))


def origin_installed(origin: str | None, locations: Iterable[str], roots: Sequence[str]) -> bool:
    """Whether a module found at ``origin`` (or, for a namespace package, in
    ``locations``) lives under one of ``roots``. Built-in and frozen modules
    (no file) count as the standard library."""
    files = [origin] if origin else list(locations)
    if not files:
        return True
    for f in files:
        if f in ("built-in", "frozen"):
            continue
        real = os.path.realpath(f)
        if not any(real == r or real.startswith(r + os.sep) for r in roots):
            return False
    return True


def module_installed(mod: types.ModuleType, roots: Sequence[str]) -> bool:
    """Whether the imported module ``mod`` comes from one of ``roots``."""
    spec = getattr(mod, "__spec__", None)
    origin = getattr(mod, "__file__", None) or getattr(spec, "origin", None)
    path = getattr(mod, "__path__", None)
    locations = [p for p in path if isinstance(p, str)] if isinstance(path, list) else []
    if not isinstance(origin, str) and not locations:
        return False  # neither a file nor a package folder: not something to import
    return origin_installed(origin if isinstance(origin, str) else None, locations, roots)


def top_installed(top: str, roots: Sequence[str], loaded: types.ModuleType | None = None) -> bool:
    """Whether the top-level package ``top`` (imported as ``loaded``, or
    looked up on ``sys.path``, which imports nothing) comes from ``roots``."""
    try:
        if loaded is not None:
            return module_installed(loaded, roots)
        spec = importlib.util.find_spec(top)
        locations = list(spec.submodule_search_locations or ()) if spec else []
        return spec is not None and origin_installed(spec.origin, locations, roots)
    except (Exception, SystemExit):
        return False
