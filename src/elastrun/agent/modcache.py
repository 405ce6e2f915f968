"""The modules a script imported when it last ran, kept across runs.

A worker started by elastrun tells the agent, once it trains, which modules
it has imported (``worker/_runner.py``). The agent keeps that list per script
in a cache folder, so the next warm interpreter for the same script imports
them before it counts as ready: a restart, and the first start of a script
that ran on this machine before, skip those imports (``torch.optim`` alone
pulls in some 800 modules and takes seconds).

One file per *key*: the script's real path (or the ``-m`` module and the
working directory), the shape of its arguments (the flags it is given, not
their values) and the worker's interpreter. The Python and torch versions
the list was recorded with are kept in the file; the warm interpreter uses
only ``torch`` from a list recorded with other versions. Modules that proved
unsafe to import ahead of time (they started a thread, initialised CUDA, or
read a per-rank variable such as ``RANK`` when imported) are remembered as
``skip``, with their package's other modules, and never imported again.

Bounds: a file holds at most ``MAX_MODULES`` names (valid dotted names of at
most 200 characters) and is at most ``MAX_FILE_BYTES``; a bigger or damaged
file is ignored (and replaced by the next recording). The folder is created
private (0700); a folder owned by another user is not used. Writes are atomic
(a temporary file, then rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CACHE_ENV",
    "ModuleCache",
    "ModuleList",
    "cache_key",
    "default_cache_dir",
    "merged",
    "skipped",
    "valid_names",
]

CACHE_ENV = "ELASTRUN_CACHE_DIR"
VERSION = 1
MAX_MODULES = 5000
MAX_NAME = 200
MAX_FILE_BYTES = 1 << 20
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def default_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """``$ELASTRUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/elastrun``, else ``~/.cache/elastrun``."""
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return env[CACHE_ENV]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastrun")


def args_shape(args: Sequence[str]) -> list[str]:
    """The flags among ``args`` (``--lr=0.1`` -> ``--lr``); values and
    positional arguments count only as their place."""
    return [a.split("=", 1)[0] if a.startswith("-") else "_" for a in args]


def cache_key(kind: str, target: str, args: Sequence[str], interpreter: str, cwd: str) -> str:
    """The cache key of a worker command (hex, 32 characters)."""
    where = os.path.realpath(os.path.join(cwd, target)) if kind == "script" else target
    parts = [
        kind,
        where,
        os.path.realpath(cwd) if kind == "module" else "",
        args_shape(args),
        os.path.realpath(interpreter),
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def valid_names(names: object, limit: int = MAX_MODULES) -> list[str]:
    """The valid, distinct module names in ``names`` (in order, at most ``limit``)."""
    if not isinstance(names, list):
        return []
    out: list[str] = []
    seen: set[str] = set()
    for name in names:
        if len(out) >= limit:
            break
        ok = isinstance(name, str) and len(name) <= MAX_NAME and NAME_RE.match(name)
        if ok and name not in seen:
            seen.add(name)
            out.append(name)
    return out


@dataclass
class ModuleList:
    """What a cache file holds."""

    modules: list[str] = field(default_factory=list)
    skip: dict[str, str] = field(default_factory=dict)  # name -> why
    python: str | None = None
    torch: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "v": VERSION,
            "modules": self.modules,
            "skip": self.skip,
            "python": self.python,
            "torch": self.torch,
        }

    @classmethod
    def from_json(cls, data: object) -> ModuleList | None:
        if not isinstance(data, dict) or data.get("v") != VERSION:
            return None
        skip = data.get("skip")
        skips = {
            k: str(v)[:200]
            for k, v in (skip.items() if isinstance(skip, dict) else ())
            if isinstance(k, str) and NAME_RE.match(k)
        }
        python, torch = data.get("python"), data.get("torch")
        return cls(
            modules=[m for m in valid_names(data.get("modules")) if not skipped(m, skips)],
            skip=dict(list(skips.items())[:MAX_MODULES]),
            python=python if isinstance(python, str) else None,
            torch=torch if isinstance(torch, str) else None,
        )


class ModuleCache:
    """One script's entry in the cache folder."""

    def __init__(self, folder: str, key: str) -> None:
        self.folder = folder
        self.key = key
        self.path = os.path.join(folder, f"modules-{key}.json")
        self.error: str | None = None

    def load(self) -> ModuleList:
        """The recorded list; empty when there is none or it cannot be used."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return ModuleList()
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
                return ModuleList()
            if info.st_uid != os.getuid():
                return ModuleList()
            data = os.read(fd, MAX_FILE_BYTES + 1)
        except OSError:
            return ModuleList()
        finally:
            os.close(fd)
        try:
            parsed = ModuleList.from_json(json.loads(data))
        except ValueError:
            parsed = None
        return parsed if parsed is not None else ModuleList()

    def save(self, entry: ModuleList) -> bool:
        """Write ``entry`` atomically; False (and ``error``) if it cannot be."""
        if not self._folder_ok():
            return False
        data = json.dumps(entry.to_json()).encode()
        if len(data) > MAX_FILE_BYTES:
            self.error = f"module list of {len(data)} bytes is over the {MAX_FILE_BYTES} limit"
            return False
        try:
            fd, tmp = tempfile.mkstemp(prefix=".modules-", dir=self.folder)
        except OSError as e:
            self.error = f"cannot write in {self.folder}: {e.strerror or e}"
            return False
        try:
            with os.fdopen(fd, "wb") as fp:
                fp.write(data)
            os.replace(tmp, self.path)
        except OSError as e:
            self.error = f"cannot write {self.path}: {e.strerror or e}"
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True

    def _folder_ok(self) -> bool:
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            info = os.lstat(self.folder)
        except OSError as e:
            self.error = f"cannot create {self.folder}: {e.strerror or e}"
            return False
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            self.error = f"{self.folder} is not a folder of this user: not used"
            return False
        return True


def skipped(name: str, skip: Mapping[str, str]) -> bool:
    """Whether ``name`` or a package it belongs to is in ``skip``."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in skip for i in range(1, len(parts) + 1))


def merged(old: Iterable[str], new: Iterable[str], skip: Mapping[str, str]) -> list[str]:
    """``old`` then the names of ``new`` not in it, none of ``skip`` or its
    packages' modules (bounded)."""
    out = [m for m in old if not skipped(m, skip)]
    seen = set(out)
    for name in new:
        if name not in seen and not skipped(name, skip):
            seen.add(name)
            out.append(name)
    return out[:MAX_MODULES]
