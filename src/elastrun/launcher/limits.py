"""The documented limits of launcher values, and ASCII-only number parsing.

Every number a user gives (flags, ``PET_*`` variables, ``--rdzv-conf``
values, :class:`~elastrun.launcher.config.LaunchConfig` fields) is checked
against a range stated in the error, once, before anything starts
(:meth:`LaunchConfig.check <elastrun.launcher.config.LaunchConfig.check>`,
:mod:`elastrun.launcher.rdzv_conf`): ``--rdzv-conf: lease_ttl: must be >= 0.5
and <= 3600 seconds, got '1e9'``. Numbers are ASCII only: Python's ``int()``
and ``float()`` accept any Unicode digit (fullwidth, Arabic-Indic, ...),
``'1_000'``, ``'nan'`` and ``'inf'``; these parsers accept ``[+-]digits`` and
decimal/exponent forms of ASCII digits, nothing else (the one grammar of
:func:`elastrun.untrusted.ascii_int` and :func:`~elastrun.untrusted.ascii_decimal`,
which the agent, the worker helpers, ``elastrun status`` and ``elastrun store
serve`` use too). A number from the environment is read by the same parsers,
its errors naming the variable.

The number of workers per node is bounded twice: by a fixed limit
(:data:`MAX_NPROC_PER_NODE`) and by what this machine lets one agent hold
(:func:`machine_nproc_limit`: open files, processes, pids).
"""

from __future__ import annotations

import math
import os

from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.untrusted import MAX_NUMBER_TEXT, ascii_decimal, ascii_int, printable

__all__ = [
    "CONF_SECONDS",
    "FLAG_SECONDS",
    "MAX_NODES",
    "MAX_NPROC_PER_NODE",
    "MAX_RESTARTS",
    "MIN_TIMEOUT",
    "Range",
    "check_int",
    "check_seconds",
    "machine_nproc_limit",
    "parse_ascii_int",
    "parse_decimal",
    "parse_seconds",
    "shown_value",
    "worker_cost",
]

MAX_NODES = 100_000
MAX_NPROC_PER_NODE = 1024
MAX_RESTARTS = 1_000_000
MAX_REPLACE_STRAGGLERS = 1000  # --replace-stragglers: intervals in a row
HOUR = 3600.0
DAY = 86_400.0
WEEK = 604_800.0

# What the agent holds per worker: two pipes (stdout, stderr), a pidfd and the
# runner's channel socket, plus its two log files when files are kept. The
# warm interpreter is one process per agent (in the reserve), whatever the
# number of workers it forks.
FDS_PER_WORKER = 4
FDS_PER_WORKER_FILES = 2
FD_RESERVE = 64  # the agent's own: store connection, event loop, logs, the warm interpreter's slack
PROC_RESERVE = 16


@frozen
class Range:
    """Allowed values ``lo <= x <= hi`` (``lo < x`` when ``lo_open``)."""

    lo: float
    hi: float
    lo_open: bool = False

    def __contains__(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        return above and x <= self.hi

    def text(self, unit: str = "") -> str:
        low = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        return f"{low} and <= {self.hi:g}" + (f" {unit}" if unit else "")


# The shortest timeout that can tell a healthy peer from a lost one: a store
# request, the rendezvous' first round or a worker's progress can take a good
# part of a second on a loaded machine. Below it a healthy job fails, blaming
# a healthy store or rank; so shorter values are refused. Timeouts where 0
# means "do not wait" (last_call_timeout, close_timeout, the exit barrier,
# --shutdown-timeout, --warm-join-timeout) stay free.
MIN_TIMEOUT = 1.0

# --rdzv-conf keys that are durations (seconds) and their ranges.
CONF_SECONDS: dict[str, Range] = {
    "health_check_timeout": Range(MIN_TIMEOUT, DAY),
    "health_check_interval": Range(0.0, WEEK),
    "join_timeout": Range(MIN_TIMEOUT, WEEK),
    "timeout": Range(MIN_TIMEOUT, WEEK),  # torch's spelling of join_timeout
    "last_call_timeout": Range(0.0, DAY),
    "close_timeout": Range(0.0, HOUR),
    "read_timeout": Range(MIN_TIMEOUT, DAY),
    # The embedded store grants 0.05..3600 s, etcd whole seconds; below 0.5 s
    # a keepalive every TTL/3 is busy work, not faster detection.
    "lease_ttl": Range(0.5, HOUR),
    "exit_barrier_timeout": Range(0.0, WEEK),
    "failover_timeout": Range(MIN_TIMEOUT, DAY),
}

# Duration flags and their ranges.
FLAG_SECONDS: dict[str, Range] = {
    "--monitor-interval": Range(0.0, HOUR, lo_open=True),
    "--shutdown-timeout": Range(0.0, HOUR),
    "--hang-timeout": Range(MIN_TIMEOUT, WEEK),
    "--exit-barrier-timeout": Range(0.0, WEEK),
    "--warm-join-timeout": Range(0.0, HOUR),
    "--quarantine-time": Range(0.0, WEEK),
    "--straggler-interval": Range(0.1, HOUR),
    "--health-check-timeout": Range(MIN_TIMEOUT, DAY),
    "--health-check-interval": Range(0.0, WEEK),
}


def shown_value(text: str) -> str:
    """``text`` as an error shows it: quoted, escaped, cut after 64 characters."""
    raw = str(text).strip()
    cut = raw if len(raw) <= MAX_NUMBER_TEXT else raw[:MAX_NUMBER_TEXT] + "..."
    return printable(repr(cut))


def parse_ascii_int(name: str, text: str) -> int:
    """ASCII ``[+-]digits`` (spaces around allowed), at most 64 characters."""
    value = ascii_int(text)
    if value is None:
        raise ConfigError(f"{name}: expected an integer (ASCII digits), got {shown_value(text)}")
    return value


def check_int(name: str, value: object, lo: int, hi: int, why_hi: str = "") -> int:
    """An int (not a bool) in ``lo..hi``; else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < lo:
        raise ConfigError(f"{name}: must be >= {lo}, got {value}")
    if value > hi:
        why = f" ({why_hi})" if why_hi else ""
        raise ConfigError(f"{name}: must be in {lo}..{hi}{why}, got {value}")
    return value


def parse_decimal(name: str, text: str) -> float:
    """ASCII decimal seconds (``30``, ``2.5``, ``1e3``): the number's form
    only (no ``nan``/``inf``, no Unicode digits); its range is checked apart."""
    value = ascii_decimal(text)
    if value is None:
        raise ConfigError(
            f"{name}: expected a finite number of seconds in ASCII digits (e.g. 30 or 2.5), "
            f"got {shown_value(text)}"
        )
    return value


def parse_seconds(name: str, text: str, rng: Range) -> float:
    """ASCII decimal seconds (:func:`parse_decimal`) in ``rng``."""
    return check_seconds(name, parse_decimal(name, text), rng, shown=str(text).strip())


def check_seconds(name: str, value: object, rng: Range, shown: str | None = None) -> float:
    """A finite int or float (not a bool) in ``rng``; else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number of seconds, got {value!r}")
    number = float(value)
    what = repr(shown) if shown is not None else f"{number:g}"
    if not math.isfinite(number) or number not in rng:
        why = ""
        if math.isfinite(number) and 0 < number < rng.lo == MIN_TIMEOUT:
            why = (
                f" (a timeout under {MIN_TIMEOUT:g} s cannot tell a healthy store or worker "
                "from a lost one on a loaded machine)"
            )
        raise ConfigError(f"{name}: must be {rng.text('seconds')}, got {what}{why}")
    return number


def worker_cost(files: bool, warm: bool) -> tuple[int, int]:
    """(processes, open files) the agent needs per worker (``warm``: one
    warm interpreter per agent, counted in the reserve, not per worker)."""
    del warm
    return 1, FDS_PER_WORKER + (FDS_PER_WORKER_FILES if files else 0)


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def machine_nproc_limit(procs_per_worker: int, fds_per_worker: int) -> tuple[int, str] | None:
    """The most workers this machine lets one agent start, and what limits it
    (None: nothing known limits it): the open-file soft limit (``ulimit -n``),
    the per-user process limit (``ulimit -u``; not for root, whom the kernel
    exempts), and the kernel's pid space (half of ``pid_max``)."""
    import resource

    found: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        n = max(0, (soft - FD_RESERVE) // fds_per_worker)
        found.append(
            (
                n,
                f"the open-file limit is {soft} (ulimit -n) and the agent holds "
                f"{fds_per_worker} per worker; raise it with 'ulimit -n'",
            )
        )
    nproc_soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if nproc_soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        n = max(0, (nproc_soft - PROC_RESERVE) // procs_per_worker)
        found.append(
            (
                n,
                f"the process limit is {nproc_soft} (ulimit -u) and each worker takes "
                f"{procs_per_worker}",
            )
        )
    pid_max = _read_int("/proc/sys/kernel/pid_max")
    if pid_max is not None:
        n = max(0, (pid_max // 2) // procs_per_worker)
        found.append((n, f"half of the kernel's pid_max ({pid_max}) is left for the rest"))
    return min(found, key=lambda f: f[0]) if found else None
