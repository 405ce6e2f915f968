"""Names that become store keys and file paths: job ids and host names.

A job id (``--rdzv-id``, ``run_id``) is one component of every store key of
its job (``/elastrun/{run_id}/...``) and of its log folders
(``{log_dir}/{run_id}/...``), so it is checked against one grammar, the same
everywhere (launcher, rendezvous keys, agent paths, ``elastrun status``)::

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

from elastrun.errors import ConfigError

__all__ = [
    "RUN_ID_GRAMMAR",
    "RUN_ID_MAX_LEN",
    "check_run_id",
    "path_component",
    "run_id_problem",
]

RUN_ID_MAX_LEN = 128
RUN_ID_GRAMMAR = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_RUN_ID = re.compile(RUN_ID_GRAMMAR)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
PATH_COMPONENT_MAX_LEN = 100


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


def check_run_id(value: object, name: str = "--rdzv-id") -> str:
    """``value`` if it is a valid job id; else ConfigError naming ``name``
    (the flag, or the Python parameter), the problem and the grammar."""
    problem = run_id_problem(value)
    if problem is not None:
        raise ConfigError(
            f"{name}: {value!r} is not a valid job id: it {problem}; a job id is 1 to "
            f"{RUN_ID_MAX_LEN} ASCII letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    assert isinstance(value, str)
    return value


def path_component(text: str, fallback: str = "unknown") -> str:
    """``text`` (a host name, any string) as one safe file-name component:
    every character but ASCII letters, digits, ``.``, ``_`` and ``-`` becomes
    ``_``, leading dots are dropped (no ``.``, ``..`` or hidden names), at most
    100 characters; ``fallback`` when nothing is left."""
    safe = _UNSAFE.sub("_", text).lstrip(".")[:PATH_COMPONENT_MAX_LEN]
    return safe or fallback
