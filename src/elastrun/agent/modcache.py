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
``skip``, with their package's other modules, and never imported again;
those that only read a rank variable (``RANK``, ``LOCAL_RANK``, ...) are
remembered as ``ranked`` instead: the node's shared warm interpreter leaves
them out, and the per-rank ones (agent/warm_ranks.py), started with a rank's
variables, import them.

Where the names come from, and what is trusted: see ``worker/_modnames.py``
for the rule every name passes (a dotted name, never a ``__main__``, the
script itself or a module that acts when imported), whether it was reported
by a local worker, read from the cache, or read from the job's note
(:class:`~elastrun.rendezvous.notes.ModuleReport`, written by another node).
A name from another node is also kept only if it resolves to the standard library or an installed
package here (:func:`installed_only`; unless ``--warm-modules all``), and
only when the store authenticates its clients (the agent decides).

Bounds: a file holds at most ``MAX_MODULES`` names (of at most ``MAX_NAME``
characters) and is at most ``MAX_FILE_BYTES``, read without following a link
and never blocked by a FIFO (``read_regular``), decoded within a depth
bound (``untrusted.loads``). A file that is a link, a special file, another
user's, too big, too deep or not a module list is ignored (``error`` says
why; the next recording replaces it); it never fails a launch. The folder is
created private (0700, ``safefs.private_dir``); one that is a link, another
user's or writable by others is not used. Writes are atomic
(``write_atomic``: a new file, then rename; mode 0600).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from elastrun.agent.command import PythonCommand, PythonModule
from elastrun.fields import Fields
from elastrun.rendezvous.notes import checked_version
from elastrun.safefs import (
    UnsafePath,
    nearest_existing,
    private_dir,
    read_regular,
    write_atomic,
)
from elastrun.untrusted import UntrustedData, loads
from elastrun.worker import _modnames

__all__ = [
    "CACHE_ENV",
    "ModuleCache",
    "ModuleList",
    "cache_key",
    "default_cache_dir",
    "installed_only",
    "merged",
    "skipped",
    "valid_names",
]

CACHE_ENV = "ELASTRUN_CACHE_DIR"
VERSION = 1
MAX_MODULES = _modnames.MAX_MODULES
MAX_NAME = _modnames.MAX_NAME
MAX_FILE_BYTES = 1 << 20
NAME_RE = _modnames.NAME_RE


def default_cache_dir(env: Mapping[str, str]) -> str:
    """``$ELASTRUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/elastrun``, else
    ``~/.cache/elastrun``, in ``env`` (the launcher's environment)."""
    if env.get(CACHE_ENV):
        return env[CACHE_ENV]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastrun")


def args_shape(args: Sequence[str]) -> list[str]:
    """The flags among ``args`` (``--lr=0.1`` -> ``--lr``); values and
    positional arguments count only as their place."""
    return [a.split("=", 1)[0] if a.startswith("-") else "_" for a in args]


def cache_key(command: PythonCommand, cwd: str) -> str:
    """The cache key of a worker command (hex, 32 characters)."""
    module = isinstance(command, PythonModule)
    where = command.target if module else os.path.realpath(os.path.join(cwd, command.target))
    parts = [
        command.kind,
        where,
        os.path.realpath(cwd) if module else "",
        args_shape(command.args),
        os.path.realpath(command.python),
    ]
    if isinstance(command, PythonModule) and command.source is not None:  # launch(fn)
        parts.append(os.path.realpath(command.source))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def valid_names(names: object, limit: int = MAX_MODULES, script: str | None = None) -> list[str]:
    """The distinct names of the list ``names`` a warm interpreter may import
    (``_modnames.refusal``; ``script``: the module name that would run the
    script), in order, at most ``limit``."""
    return _modnames.checked(names, script, limit)


def installed_only(names: Iterable[str]) -> list[str]:
    """The names whose top-level package resolves, in this interpreter, to
    the standard library or an installed package (looked up, not imported)."""
    roots = _modnames.installed_roots()
    tops: dict[str, bool] = {}
    out = []
    for name in names:
        top = name.split(".", 1)[0]
        if top not in tops:
            tops[top] = _modnames.top_installed(top, roots)
        if tops[top]:
            out.append(name)
    return out


@dataclass
class ModuleList:
    """What a cache file holds."""

    modules: list[str] = field(default_factory=list)
    skip: dict[str, str] = field(default_factory=dict)  # name -> why
    python: str | None = None
    torch: str | None = None
    # Packages that read a rank variable when imported: name -> why. Kept in
    # ``modules`` (a per-rank warm interpreter imports them), never imported
    # by the shared one.
    ranked: dict[str, str] = field(default_factory=dict)

    def shared(self) -> list[str]:
        """The modules the node's shared warm interpreter may import."""
        return [m for m in self.modules if not skipped(m, self.ranked)]

    def to_json(self) -> dict[str, object]:
        return {
            "v": VERSION,
            "modules": self.modules,
            "skip": self.skip,
            "ranked": self.ranked,
            "python": self.python,
            "torch": self.torch,
        }

    @classmethod
    def from_json(cls, data: object, script: str | None = None) -> ModuleList | None:
        try:
            raw = Fields.versioned(data, VERSION, "the module list").raw
        except ValueError:
            return None
        skips = _reasons(raw.get("skip"))
        names = valid_names(raw.get("modules"), script=script)
        return cls(
            modules=[m for m in names if not skipped(m, skips)],
            skip=skips,
            python=checked_version(raw.get("python")),
            torch=checked_version(raw.get("torch")),
            ranked={k: v for k, v in _reasons(raw.get("ranked")).items() if k not in skips},
        )


def _reasons(value: object) -> dict[str, str]:
    """A cache file's ``name -> why`` table, checked and bounded."""
    table = {
        k: str(v)[:200]
        for k, v in (value.items() if isinstance(value, dict) else ())
        if isinstance(k, str) and len(k) <= MAX_NAME and NAME_RE.match(k)
    }
    return dict(list(table.items())[:MAX_MODULES])


class ModuleCache:
    """One script's entry in the cache folder.

    ``error`` says why the last :meth:`load` or :meth:`save` could not use the
    file (None: it could, or there was none yet); ``refused`` whether that was
    a refusal (a link, a special file, a damaged file, a folder another user
    controls: worth a line on the console) rather than a plain I/O failure."""

    def __init__(self, folder: str, key: str) -> None:
        self.folder = os.path.abspath(folder)
        self.key = key
        self.path = os.path.join(self.folder, f"modules-{key}.json")
        self.error: str | None = None
        self.refused = False

    def _fail(self, error: str, *, refused: bool) -> None:
        self.error, self.refused = error, refused

    def _ignored(self, problem: str) -> None:
        self._fail(
            f"{problem}; ignored (replaced once the script reports what it imports)",
            refused=True,
        )

    def load(self, script: str | None = None) -> ModuleList:
        """The recorded list (names checked as :func:`valid_names` does, with
        ``script``); empty when there is none or it cannot be used."""
        self.error, self.refused = None, False
        if not self._folder_ok():
            return ModuleList()
        try:
            owner = os.lstat(self.path).st_uid
            if owner != os.geteuid():
                raise UnsafePath(self.path, f"is owned by uid {owner}, not by this process")
            data = read_regular(self.path, MAX_FILE_BYTES)
            value = loads(data, max_bytes=MAX_FILE_BYTES, what=self.path)
        except FileNotFoundError:
            return ModuleList()
        except (UnsafePath, UntrustedData) as e:
            self._ignored(str(e))
            return ModuleList()
        except OSError as e:
            self._ignored(f"{self.path}: cannot be read: {e.strerror or e}")
            return ModuleList()
        parsed = ModuleList.from_json(value, script)
        if parsed is None:
            # Another version's list is replaced quietly; anything else is damaged.
            version = value.get("v") if isinstance(value, dict) else None
            if not isinstance(version, int) or version == VERSION:
                self._ignored(f"{self.path}: is not a module list")
            return ModuleList()
        return parsed

    def save(self, entry: ModuleList) -> bool:
        """Write ``entry`` atomically (mode 0600); False (and ``error``) if it cannot be."""
        self.error, self.refused = None, False
        if not self._folder_ok():
            return False
        data = json.dumps(entry.to_json()).encode()
        if len(data) > MAX_FILE_BYTES:
            self._fail(
                f"module list of {len(data)} bytes is over the {MAX_FILE_BYTES} limit",
                refused=False,
            )
            return False
        try:
            write_atomic(self.path, data, 0o600)
        except UnsafePath as e:
            self._fail(str(e), refused=True)
            return False
        except OSError as e:
            self._fail(f"cannot write {self.path}: {e.strerror or e}", refused=False)
            return False
        return True

    def _folder_ok(self) -> bool:
        """The folder, created private where missing (below its nearest
        existing ancestor, which must not be open to others), refused when it
        is a link, another user's or writable by others."""
        try:
            private_dir(self.folder, below=nearest_existing(os.path.dirname(self.folder)))
        except UnsafePath as e:
            # A folder that cannot be created (a read-only or full disk) costs
            # only warmth; one another user controls is worth saying.
            refused = not e.problem.startswith("cannot ")
            self._fail(f"{e}; the module cache is not used", refused=refused)
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
