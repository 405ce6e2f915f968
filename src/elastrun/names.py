"""Names that become store keys and file paths: job ids and host names.

A job id (``--rdzv-id``, ``run_id``) is one component of every store key of
its job (``/elastrun/{run_id}/...``) and of its log folders
(``{log_dir}/{run_id}/...``). It is parsed once, where it enters (the
launcher's plan, ``elastrun status``), into a :class:`RunId`, and passed on
typed: the rendezvous keys, the agent's folders and the event log take a
``RunId``, never a bare string, so none of them checks it again. The grammar::

    [A-Za-z0-9][A-Za-z0-9._-]{0,127}

ASCII letters and digits, then up to 127 more of those or ``.``, ``_``,
``-``. No ``/`` (an id could otherwise name a part of another job's key space,
``A/waiting``, or climb out of ``--log-dir``, ``../../x``); ``.`` and ``..``
are impossible (the first character is a letter or digit); nothing a shell,
a terminal or a URL treats specially. torch's default ``none``, UUIDs
(``uuid4()`` and ``uuid4().int``), SLURM job ids and Kubernetes names all
fit.

Host names come from the machine (``socket.gethostname()``) and are not ours
to refuse: :func:`path_component` turns any of them into a safe file name.
"""

from __future__ import annotations

import re
import uuid

from elastrun.errors import ConfigError

__all__ = [
    "RUN_ID_GRAMMAR",
    "RUN_ID_MAX_LEN",
    "RunId",
    "path_component",
    "run_id_problem",
]

RUN_ID_MAX_LEN = 128
RUN_ID_GRAMMAR = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_RUN_ID = re.compile(RUN_ID_GRAMMAR)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
PATH_COMPONENT_MAX_LEN = 100


def _shown(text: object) -> str:
    """A bad id as a message shows it: quoted, cut after 140 characters."""
    if isinstance(text, str) and len(text) > RUN_ID_MAX_LEN + 12:
        return repr(text[: RUN_ID_MAX_LEN + 12]) + "..."
    return repr(text)


def run_id_problem(value: object) -> str | None:
    """Why ``value`` is not a valid job id (None: it is)."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "is empty"
    if len(value) > RUN_ID_MAX_LEN:
        return f"is {len(value)} characters long (at most {RUN_ID_MAX_LEN})"
    if _RUN_ID.fullmatch(value) is None:
        bad = _UNSAFE.search(value)
        if bad is not None:
            return f"contains {bad.group()!r}"
        return "must start with an ASCII letter or digit"
    return None


class RunId(str):
    """A job id that matches the grammar above: ``RunId.parse(text)`` (or
    ``RunId(text)``, the same check) is the only way to make one, so a
    ``RunId`` is always valid, and ``str()`` writes it. It is a ``str``: it
    goes into keys, paths, messages and JSON as the text it is."""

    __slots__ = ()

    def __new__(cls, text: str) -> RunId:
        return cls.parse(text, "run id")

    @classmethod
    def parse(cls, text: object, what: str = "--rdzv-id") -> RunId:
        """``text`` as a job id; else ConfigError naming ``what`` (the flag,
        or the Python parameter), the problem and the grammar."""
        if isinstance(text, RunId):
            return text
        problem = run_id_problem(text)
        if problem is not None or not isinstance(text, str):
            raise ConfigError(
                f"{what}: {_shown(text)} is not a valid job id: it {problem}; a job id is 1 to "
                f"{RUN_ID_MAX_LEN} ASCII letters, digits, '.', '_' or '-', starting with a "
                "letter or digit"
            )
        return str.__new__(cls, text)

    @classmethod
    def generate(cls) -> RunId:
        """A fresh random id (a UUID, as torch's launcher makes)."""
        return str.__new__(cls, str(uuid.uuid4()))


def path_component(text: str, fallback: str = "unknown") -> str:
    """``text`` (a host name, any string) as one safe file-name component:
    every character but ASCII letters, digits, ``.``, ``_`` and ``-`` becomes
    ``_``, leading dots are dropped (no ``.``, ``..`` or hidden names), at most
    100 characters; ``fallback`` when nothing is left."""
    safe = _UNSAFE.sub("_", text).lstrip(".")[:PATH_COMPONENT_MAX_LEN]
    return safe or fallback
