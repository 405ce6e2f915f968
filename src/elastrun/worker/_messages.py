"""Every message between the agent and the processes it starts (stdlib only).

The worker runner (``_runner.py``), the warm interpreter (``_zygote.py``) and
the progress recorder (``_progress.py``) run by path in the worker's
interpreter and load this file beside them (as ``_elastrun_messages``); the
agent imports it as ``elastrun.worker._messages``. One schema, both sides.

Each message is a JSON object ``{"v": PROTOCOL, "kind": KIND, ...fields}``,
one class per kind, written by ``to_json`` and read by :func:`from_json`,
which checks the version, the kind and every field's type and raises
:class:`BadMessage` otherwise. The agent decodes what a worker sends within
bounds of size and depth first (``elastrun.untrusted``, agent/channel.py): a
worker runs the user's code.

**The runner's channel** (a stream socket per worker, ``ELASTRUN_CHANNEL_FD``;
JSON lines, :func:`encode_line`)::

    runner -> agent   Modules         the modules it imported, once it trains
                      ProgressFailed  its progress file cannot be written (once)
                      Progress        then each new progress record, relayed
                      Failing         the script ended by an uncaught exception
                                      or a non-zero exit (sent as it ends: the
                                      agent takes the time it arrives as the
                                      failure's, before the process' teardown)
                      Restartable     the script entered an in-process restartable
                                      function (train/in_process.py) in ``round``
                      Left            it left round ``round``'s function (its
                                      collectives aborted or broken) and waits
                      Entered         it entered the function again in ``round``
                      InProcess       the script wrapped a function in
                                      ``in_process`` (standbys may start)
                      StandbyReady    (a standby) the script reached its in-process
                                      function: it waits for an ``Enter``
    agent -> runner   Go              (a forked worker) registered: run the script
                      Abort           leave round ``round``'s function now
                      Enter           enter it again for ``round``, with these
                                      per-round variables (RANK, MASTER_PORT, ...)

**The warm interpreter's control socket** (``SOCK_SEQPACKET``, fd 0 of the
zygote; one message per packet, :func:`encode`)::

    agent -> zygote   Preload         import these too
                      Fork            fork one worker of a batch; with its fds:
                                      stdout, stderr, channel socket and stdin
                                      (3 fds: stdin is /dev/null)
    zygote -> agent   Ready           its imports are done (or stopped: why)
                      Forked          the batch's pids, once all are forked
                      Unsafe          a module is not safe to import ahead of
                                      time; the zygote then exits

What the zygote imports first comes in its environment (``ELASTRUN_PRELOAD``):
:class:`PreloadPlan`, the same JSON without ``v`` and ``kind``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

PROTOCOL = 3

__all__ = [
    "MAX_ENTER_VARS",
    "MAX_WHY",
    "PROTOCOL",
    "Abort",
    "BadMessage",
    "Enter",
    "Entered",
    "Failing",
    "Fork",
    "Forked",
    "Go",
    "InProcess",
    "Left",
    "Message",
    "Modules",
    "Preload",
    "PreloadPlan",
    "Progress",
    "ProgressFailed",
    "Ready",
    "Restartable",
    "StandbyReady",
    "Unsafe",
    "encode",
    "encode_line",
    "from_json",
]


class BadMessage(ValueError):
    """Not a message of this protocol: wrong version, kind or field."""


# ------------------------------------------------------------------ fields
# Every field is read through elastrun/fields.py: imported in the package;
# loaded by its path when this file runs beside the worker's programs.
if TYPE_CHECKING or __name__.startswith("elastrun."):
    from elastrun.fields import MAX_COUNT, Fields
else:
    _FIELDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fields.py")
    _spec = importlib.util.spec_from_file_location("_elastrun_fields", _FIELDS)
    assert _spec is not None and _spec.loader is not None
    _fields_module = sys.modules.get("_elastrun_fields") or importlib.util.module_from_spec(_spec)
    if "_elastrun_fields" not in sys.modules:
        sys.modules["_elastrun_fields"] = _fields_module
        _spec.loader.exec_module(_fields_module)
    Fields, MAX_COUNT = _fields_module.Fields, _fields_module.MAX_COUNT


def _int(f: Fields, key: str) -> int:
    return f.integer(key, low=-MAX_COUNT)


# ------------------------------------------------------------------ messages


class _Message:
    KIND: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {"v": PROTOCOL, "kind": self.KIND, **self.fields()}


@dataclass(frozen=True)
class Modules(_Message):
    """The modules a worker imported by the time it trains (``why``:
    ``optimizer_step``, or ``timer`` when it had not stepped an optimizer
    after ``ELASTRUN_MODULES_AFTER`` seconds), with its Python and torch."""

    KIND: ClassVar[str] = "modules"
    why: str
    modules: tuple[str, ...]
    python: str | None = None
    torch: str | None = None

    def fields(self) -> dict[str, Any]:
        return {"why": self.why, "modules": list(self.modules)} | {
            "python": self.python,
            "torch": self.torch,
        }

    @classmethod
    def parse(cls, data: Fields) -> Modules:
        return cls(
            data.text("why"),
            data.strings("modules", required=True),
            data.optional_text("python"),
            data.optional_text("torch"),
        )


@dataclass(frozen=True)
class ProgressFailed(_Message):
    """The runner cannot write its progress file ``path`` (``error``)."""

    KIND: ClassVar[str] = "progress_failed"
    path: str
    error: str

    def fields(self) -> dict[str, Any]:
        return {"path": self.path, "error": self.error}

    @classmethod
    def parse(cls, data: Fields) -> ProgressFailed:
        return cls(data.text("path"), data.text("error"))


@dataclass(frozen=True)
class Progress(_Message):
    """A progress record relayed while the file cannot be written (``beat``:
    the file's record, ``_progress.py``'s schema, read by the agent's
    ``watchdog.parse_beat``), and the file's last write error."""

    KIND: ClassVar[str] = "progress"
    beat: Mapping[str, Any] | None
    error: str

    def fields(self) -> dict[str, Any]:
        return {"beat": None if self.beat is None else dict(self.beat), "error": self.error}

    @classmethod
    def parse(cls, data: Fields) -> Progress:
        beat = data.raw.get("beat")
        if beat is not None and not isinstance(beat, dict):
            raise data.bad("beat", "not an object")
        return cls(beat, data.text("error"))


@dataclass(frozen=True)
class Failing(_Message):
    """The script failed (an uncaught exception, or a non-zero exit): the
    process ends once its interpreter has torn down, which may take a while
    (a live process group's threads); its peers' collectives break sooner."""

    KIND: ClassVar[str] = "failing"

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, data: Fields) -> Failing:
        del data
        return cls()


@dataclass(frozen=True)
class Go(_Message):
    """To a forked worker: the agent registered it, it may run the script."""

    KIND: ClassVar[str] = "go"

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, data: Fields) -> Go:
        del data
        return cls()


@dataclass(frozen=True)
class Preload(_Message):
    """To the zygote: import these modules too (they are checked again there)."""

    KIND: ClassVar[str] = "preload"
    modules: tuple[str, ...]

    def fields(self) -> dict[str, Any]:
        return {"modules": list(self.modules)}

    @classmethod
    def parse(cls, data: Fields) -> Preload:
        return cls(data.strings("modules", required=True))


@dataclass(frozen=True)
class Fork(_Message):
    """To the zygote: fork worker ``index`` of a batch of ``count`` (forked
    together once all orders came), with its environment and arguments."""

    KIND: ClassVar[str] = "fork"
    env: Mapping[str, str]
    args: tuple[str, ...]
    index: int = 0
    count: int = 1

    def fields(self) -> dict[str, Any]:
        return {"env": dict(self.env), "args": list(self.args)} | {
            "index": self.index,
            "count": self.count,
        }

    @classmethod
    def parse(cls, data: Fields) -> Fork:
        env = data.raw.get("env")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise data.bad("env", "not an object of strings")
        return cls(
            env, data.strings("args", required=True), _int(data, "index"), _int(data, "count")
        )


@dataclass(frozen=True)
class Ready(_Message):
    """From the zygote: its imports are done (``stopped``: why it stopped
    early, at a budget); ``failed``: (module, why) of those it skipped."""

    KIND: ClassVar[str] = "ready"
    loaded: int
    failed: tuple[tuple[str, str], ...] = ()
    rss_kb: int = 0
    preload_s: float = 0.0
    stopped: str | None = None
    python: str | None = None
    torch: str | None = None

    def fields(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "failed": [list(f) for f in self.failed],
            "rss_kb": self.rss_kb,
            "preload_s": self.preload_s,
            "stopped": self.stopped,
            "python": self.python,
            "torch": self.torch,
        }

    @classmethod
    def parse(cls, data: Fields) -> Ready:
        failed = data.items("failed", required=True)
        pairs = [f for f in failed if isinstance(f, list) and len(f) == 2]
        if len(pairs) != len(failed) or not all(isinstance(x, str) for f in pairs for x in f):
            raise data.bad("failed", "not a list of [module, why]")
        return cls(
            _int(data, "loaded"),
            tuple((f[0], f[1]) for f in pairs),
            _int(data, "rss_kb"),
            data.number("preload_s", low=None, high=None),
            data.optional_text("stopped"),
            data.optional_text("python"),
            data.optional_text("torch"),
        )


@dataclass(frozen=True)
class Forked(_Message):
    """From the zygote: the pid of each fork of the batch, in order (None:
    that one could not be forked)."""

    KIND: ClassVar[str] = "forked"
    pids: tuple[int | None, ...]

    def fields(self) -> dict[str, Any]:
        return {"pids": list(self.pids)}

    @classmethod
    def parse(cls, data: Fields) -> Forked:
        pids = data.items("pids", required=True)
        ok = all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in pids)
        if not ok:
            raise data.bad("pids", "not a list of pids")
        return cls(tuple(p if p is None or p > 0 else None for p in pids))


@dataclass(frozen=True)
class Unsafe(_Message):
    """From the zygote: ``modules`` are not safe to import ahead of time
    (they started a thread, initialised CUDA, or read a per-rank variable
    when imported): it exits. ``variable``: the per-rank variable read, if
    that was the reason."""

    KIND: ClassVar[str] = "unsafe"
    modules: tuple[str, ...]
    why: str
    variable: str | None = None

    def fields(self) -> dict[str, Any]:
        return {"modules": list(self.modules), "why": self.why, "variable": self.variable}

    @classmethod
    def parse(cls, data: Fields) -> Unsafe:
        return cls(
            data.strings("modules", required=True), data.text("why"), data.optional_text("variable")
        )


# ------------------------------------------------------------ in-process restarts
# Bounds of what the messages of in-process restarts carry (worker/_restart.py).
MAX_WHY = 512  # a Left's reason, in characters
MAX_ENTER_VARS = 32  # an Enter's variables


@dataclass(frozen=True)
class Restartable(_Message):
    """The script entered its in-process restartable function in ``round``:
    on a group failure, this process may leave it and enter it again."""

    KIND: ClassVar[str] = "restartable"
    round: int

    def fields(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def parse(cls, data: Fields) -> Restartable:
        return cls(_int(data, "round"))


@dataclass(frozen=True)
class Left(_Message):
    """The process left round ``round``'s function (``why``: its collective
    broke, or the agent's ``Abort``), its process group aborted; it waits
    for ``Enter``."""

    KIND: ClassVar[str] = "left"
    round: int
    why: str

    def fields(self) -> dict[str, Any]:
        return {"round": self.round, "why": self.why[:MAX_WHY]}

    @classmethod
    def parse(cls, data: Fields) -> Left:
        return cls(_int(data, "round"), data.text("why")[:MAX_WHY])


@dataclass(frozen=True)
class Entered(_Message):
    """The process entered its function again, in ``round`` (its variables set)."""

    KIND: ClassVar[str] = "entered"
    round: int

    def fields(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def parse(cls, data: Fields) -> Entered:
        return cls(_int(data, "round"))


@dataclass(frozen=True)
class InProcess(_Message):
    """The script wrapped a function in ``elastrun.train.in_process`` (sent
    once, when it wraps it, before its setup typically): the agent may start
    its standby processes (agent/standby.py) now."""

    KIND: ClassVar[str] = "in_process"

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, data: Fields) -> InProcess:
        del data
        return cls()


@dataclass(frozen=True)
class StandbyReady(_Message):
    """A standby process (started without a rank, agent/standby.py) reached
    its in-process function: its setup is done; it waits for an ``Enter``
    that gives it a rank."""

    KIND: ClassVar[str] = "standby_ready"

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, data: Fields) -> StandbyReady:
        del data
        return cls()


@dataclass(frozen=True)
class Abort(_Message):
    """To a restartable worker: leave round ``round``'s function now (abort
    its process group). A worker in another round ignores it."""

    KIND: ClassVar[str] = "abort"
    round: int

    def fields(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def parse(cls, data: Fields) -> Abort:
        return cls(_int(data, "round"))


@dataclass(frozen=True)
class Enter(_Message):
    """To a worker that left: enter the function again for ``round`` (newer
    than any it was in), with ``env``, the round's variables a fresh worker
    would start with (agent/env.py ``ROUND_ENV_VARS``)."""

    KIND: ClassVar[str] = "enter"
    round: int
    env: Mapping[str, str]

    def fields(self) -> dict[str, Any]:
        return {"round": self.round, "env": dict(self.env)}

    @classmethod
    def parse(cls, data: Fields) -> Enter:
        env = data.raw.get("env")
        if (
            not isinstance(env, dict)
            or len(env) > MAX_ENTER_VARS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise data.bad("env", "not an object of strings")
        return cls(_int(data, "round"), env)


Message = (
    Modules
    | ProgressFailed
    | Progress
    | Failing
    | Go
    | Preload
    | Fork
    | Ready
    | Forked
    | Unsafe
    | Restartable
    | Left
    | Entered
    | InProcess
    | StandbyReady
    | Abort
    | Enter
)
KINDS: dict[str, Any] = {
    cls.KIND: cls
    for cls in (
        Modules,
        ProgressFailed,
        Progress,
        Failing,
        Go,
        Preload,
        Fork,
        Ready,
        Forked,
        Unsafe,
        Restartable,
        Left,
        Entered,
        InProcess,
        StandbyReady,
        Abort,
        Enter,
    )
}


def from_json(data: object) -> Message:
    """The message ``data`` holds (decoded JSON); BadMessage if it is none."""
    f = Fields.versioned(data, PROTOCOL, "a message", BadMessage, what="protocol version")
    cls = KINDS.get(f.raw.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise BadMessage("unknown kind")
    message: Message = cls.parse(f)
    return message


def encode(message: Message) -> bytes:
    """One packet (the zygote's socket)."""
    return json.dumps(message.to_json()).encode()


def encode_line(message: Message) -> bytes:
    """One line (the runner's channel)."""
    return encode(message) + b"\n"


# ------------------------------------------------------------------ the zygote's start


@dataclass(frozen=True)
class PreloadPlan:
    """What a zygote imports before it reads any order (``ELASTRUN_PRELOAD``):
    ``modules`` in order, the first ``base`` of them (torch) before any fork;
    the Python and torch the list was recorded with (another Python: torch
    only; another torch: nothing after torch); ``watch``: the per-round and
    per-rank variables a module must not read while it is imported."""

    modules: tuple[str, ...] = ()
    python: str | None = None
    torch: str | None = None
    watch: tuple[str, ...] = ()
    base: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "python": self.python,
            "torch": self.torch,
            "watch": list(self.watch),
            "base": self.base,
        }

    @classmethod
    def from_json(cls, raw: object) -> PreloadPlan:
        data = Fields(raw, "the preload plan", BadMessage)
        return cls(
            data.strings("modules", required=True),
            data.optional_text("python"),
            data.optional_text("torch"),
            data.strings("watch", required=True),
            max(0, _int(data, "base")),
        )

    @classmethod
    def from_text(cls, text: str) -> PreloadPlan:
        """From the variable's text; an empty plan when it holds none."""
        try:
            return cls.from_json(json.loads(text))
        except ValueError:  # BadMessage too
            return cls()
