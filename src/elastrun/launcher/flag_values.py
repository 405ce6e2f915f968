"""The grammar of each flag's value: its text -> the value a
:class:`~elastrun.launcher.config.LaunchConfig` field holds.

Only the form is checked here (``N`` or ``MIN:MAX``, ASCII digits, a signal's
name, ``0-3`` or ``rank:bits``...); ranges are checked once, on the
LaunchConfig, for the command line and the Python API alike
(:meth:`~elastrun.launcher.config.LaunchConfig.check`). Every error is a
:class:`~elastrun.errors.ConfigError` whose message starts with the flag.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

from elastrun.agent.spec import Std
from elastrun.agent.watchdog import DEFAULT_AUTO_FLOOR
from elastrun.errors import ConfigError
from elastrun.launcher.devices import count_cpus, count_gpus, count_xpus
from elastrun.launcher.limits import parse_ascii_int, parse_decimal, shown_value
from elastrun.untrusted import ascii_int

__all__ = [
    "parse_hang_timeout",
    "parse_integer",
    "parse_nnodes",
    "parse_nproc",
    "parse_ranks_filter",
    "parse_seconds_text",
    "parse_signals",
    "parse_stack_signal",
    "parse_std",
    "signal_tuple",
]

_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^([0-9]{1,9}:[0-3],)*[0-9]{1,9}:[0-3]$")
_RT_SIGNAL = re.compile(r"SIG(RTMIN|RTMAX)(?:([+-])([0-9]{1,3}))?")


def parse_integer(flag: str, text: str | None) -> int | None:
    """ASCII ``[+-]digits`` (None: not given)."""
    return None if text is None else parse_ascii_int(flag, text)


def parse_seconds_text(flag: str, text: str | None) -> float | None:
    """ASCII decimal seconds (None: not given)."""
    return None if text is None else parse_decimal(flag, text)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max)."""
    parts = text.split(":")
    if len(parts) == 1:
        lo = hi = parse_ascii_int("--nnodes", parts[0])
    elif len(parts) == 2:
        lo, hi = parse_ascii_int("--nnodes", parts[0]), parse_ascii_int("--nnodes", parts[1])
    else:
        raise ConfigError(f"--nnodes: expected N or MIN:MAX, got {shown_value(text)}")
    return lo, hi


def parse_nproc(text: str) -> int:
    """``N``, ``cpu``, ``gpu``, ``xpu`` or ``auto`` -> number of workers on this node."""
    value = text.strip().lower()
    if value == "cpu":
        return count_cpus()
    if value == "xpu":
        xpus = count_xpus()
        if xpus == 0:
            raise ConfigError(
                "--nproc-per-node: 'xpu' asks for one worker per Intel XPU, but none is "
                "visible (no Intel i915/xe card in /sys/class/drm, or ZE_AFFINITY_MASK hides "
                "them); give a number instead"
            )
        return xpus
    if value in ("gpu", "cuda"):
        gpus = count_gpus()
        if gpus == 0:
            raise ConfigError(
                "--nproc-per-node: 'gpu' asks for one worker per GPU, but no NVIDIA GPU is "
                "visible (no /proc/driver/nvidia/gpus, no 'nvidia-smi -L', or "
                "CUDA_VISIBLE_DEVICES hides them); give a number instead"
            )
        return gpus
    if value == "auto":
        return count_gpus() or count_xpus() or count_cpus()
    number = ascii_int(value)
    if number is None:
        raise ConfigError(
            f"--nproc-per-node: expected a number (ASCII digits), 'auto', 'cpu', 'gpu' or "
            f"'xpu', got {shown_value(text)}"
        )
    return number


def parse_std(text: str, flag: str) -> dict[int, Std]:
    """torchrun's ``3`` or ``0:1,1:2`` -> {local_rank: Std}; ``-1`` means all."""
    value = text.strip()
    if _STD_VALUE.match(value):
        bits = Std(int(value))
        return {-1: bits} if bits else {}
    if _STD_MAPPING.match(value):
        out: dict[int, Std] = {}
        for item in value.split(","):
            rank, bits_text = item.split(":")
            out[int(rank)] = Std(int(bits_text))
        return out
    raise ConfigError(
        f"{flag}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or a per-local-rank "
        f"mapping like 0:1,1:2, got {shown_value(text)}"
    )


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    """``0,2`` -> the local ranks shown on the console (None: every rank)."""
    value = text.strip()
    if not value:
        return None
    ranks = [ascii_int(x) for x in value.split(",")]
    if any(r is None for r in ranks):
        raise ConfigError(
            f"--local-ranks-filter: expected comma-separated local ranks like 0,1,2, got "
            f"{shown_value(text)}"
        )
    return frozenset(r for r in ranks if r is not None)


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``SIGTERM,USR1`` -> the signals, in order, each once (``SIG`` optional)."""
    out: list[signal.Signals] = []
    for item in text.split(","):
        name = item.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise ConfigError(
                f"--signals-to-handle: unknown signal {item.strip()!r} "
                "(expected names like SIGTERM,SIGUSR1)"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ConfigError(f"--signals-to-handle: {name} cannot be handled or forwarded")
        if sig not in out:
            out.append(sig)
    return tuple(out)


def parse_stack_signal(text: str) -> int | None:
    """``--stack-signal``: ``SIGRTMIN+N``, ``SIGRTMAX-N``, ``SIGUSR1``,
    ``SIGUSR2`` (``SIG`` optional, any case) or ``none`` -> its number (None: off)."""
    raw = text.strip().upper()
    if raw in ("NONE", "OFF"):
        return None
    name = raw if raw.startswith("SIG") else "SIG" + raw
    if name in ("SIGUSR1", "SIGUSR2"):
        return int(signal.Signals[name])
    lo, hi = int(signal.SIGRTMIN), int(signal.SIGRTMAX)
    rt = _RT_SIGNAL.fullmatch(name)
    if rt is not None:
        offset = int(rt[3] or 0) * (-1 if rt[2] == "-" else 1)
        signum = (lo if rt[1] == "RTMIN" else hi) + offset
        if lo <= signum <= hi:
            return signum
    raise ConfigError(
        f"--stack-signal: expected SIGRTMIN+N or SIGRTMAX-N (N in 0..{hi - lo}), SIGUSR1, "
        f"SIGUSR2 or none, got {text.strip()!r}"
    )


def parse_hang_timeout(text: str | None) -> tuple[float | None, bool]:
    """``--hang-timeout``: ``S`` (fixed), ``auto`` or ``auto:FLOOR`` ->
    (seconds or floor, auto)."""
    if text is None:
        return None, False
    raw = str(text).strip()
    if raw == "auto" or raw.startswith("auto:"):
        floor = raw.partition(":")[2]
        if not floor:
            if raw != "auto":
                raise ConfigError("--hang-timeout: 'auto:' needs a floor in seconds, e.g. auto:60")
            return DEFAULT_AUTO_FLOOR, True
        return parse_decimal("--hang-timeout", floor), True
    return parse_decimal("--hang-timeout", raw), False


def signal_tuple(value: object) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGUSR1"`` (torch's type), or a sequence of signals, their
    numbers or names."""
    if isinstance(value, str):
        return parse_signals(value)
    if not isinstance(value, Sequence):
        raise ConfigError(
            f"--signals-to-handle: expected a string like 'SIGTERM,SIGUSR1' or a sequence of "
            f"signals, got {value!r}"
        )
    names = []
    for item in value:
        if isinstance(item, signal.Signals):
            names.append(item.name)
        elif isinstance(item, int) and not isinstance(item, bool):
            try:
                names.append(signal.Signals(item).name)
            except ValueError:
                raise ConfigError(f"--signals-to-handle: {item} is not a signal") from None
        elif isinstance(item, str):
            names.append(item)
        else:
            raise ConfigError(f"--signals-to-handle: {item!r} is not a signal")
    return parse_signals(",".join(names))
