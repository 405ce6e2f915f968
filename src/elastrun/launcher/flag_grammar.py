"""The grammar of the launcher's command line: how any flag is read, and each
flag value's text.

**Flags.** Both spellings of a flag (:func:`both`), torchrun's ``PET_<FLAG>``
environment defaults (:class:`EnvDefault`, :class:`EnvFlag`; a value's error
names the variable it came from: :func:`env_sources`, :func:`name_env`),
torchrun's ``--logs-specs`` accepted as the no-op it is (:class:`LogsSpecs`),
``--version``, looked up only when given (:class:`Version`),
and the message for arguments that are no flag (:func:`unknown_flags_message`:
flags are never abbreviated). The flags themselves are declared in
:mod:`elastrun.launcher.flags`.

**Values.** Each flag's text -> the value a
:class:`~elastrun.launcher.config.LaunchConfig` field holds. Only the form is
checked here (``N`` or ``MIN:MAX``, ASCII digits, a signal's name, ``0-3`` or
``rank:bits``...); ranges are checked once, on the LaunchConfig, for the
command line and the Python API alike
(:meth:`~elastrun.launcher.config.LaunchConfig.check`). Every error is a
:class:`~elastrun.errors.ConfigError` whose message starts with the flag.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from elastrun.agent.spec import Std
from elastrun.agent.watchdog import DEFAULT_AUTO_FLOOR
from elastrun.errors import ConfigError
from elastrun.launcher.devices import count_cpus, count_gpus, count_xpus
from elastrun.launcher.limits import parse_ascii_int, parse_decimal, shown_value
from elastrun.untrusted import ascii_int, printable

__all__ = [
    "EnvDefault",
    "EnvFlag",
    "EnvSwitch",
    "LogsSpecs",
    "Parser",
    "Version",
    "both",
    "env_sources",
    "name_env",
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
    "unknown_flags_message",
]


class Parser(argparse.ArgumentParser):
    """argparse, with errors raised as ConfigError (a missing script said plainly)."""

    def error(self, message: str) -> NoReturn:
        if "required: script" in message:
            message = "script: missing: name the training script (or -m module) to run"
        raise ConfigError(message)


# Flags of torch.distributed.launch that name a worker argument, not a
# launcher setting: never guessed as an abbreviation of one of ours.
_LEGACY_FLAGS = {
    "--local-rank": (
        "not an elastrun flag: each worker finds its local rank in LOCAL_RANK. A script "
        "that wants it as an argument runs under 'python -m elastrun.launch' (as under "
        "torch.distributed.launch); an argument for the script goes after the script "
        "(see docs/migration.md)"
    ),
    "--use-env": (
        "not an elastrun flag: elastrun always sets LOCAL_RANK, which is what --use-env "
        "asked torch.distributed.launch for; drop the flag (or use 'python -m "
        "elastrun.launch --use-env', see docs/migration.md)"
    ),
}


def unknown_flags_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments before the script that are no flag of ours.
    Flags are never abbreviated (a prefix could silently mean another flag,
    e.g. --local-rank for --local-ranks-filter): suggest the full name."""
    first = extras[0]
    name = first.split("=", 1)[0]
    legacy = _LEGACY_FLAGS.get(name.replace("_", "-"))
    if legacy is not None:
        return f"{name}: {legacy}"
    known = sorted(parser._option_string_actions)  # argparse keeps them here
    hint = ""
    if name.startswith("--"):
        # One spelling per flag: the one in the style the user typed.
        style = "_" if "_" in name else "-"
        names: dict[str, str] = {}
        for o in known:
            if o.startswith("--"):
                key = "--" + o[2:].replace("_", "-")
                if key not in names or (style in o[2:] and style not in names[key][2:]):
                    names[key] = o
        spelled = sorted(names.values())
        longer = [o for o in spelled if o.startswith(name) and o != name]
        close = difflib.get_close_matches(name, spelled, n=1, cutoff=0.75)
        if longer:
            hint = f"; did you mean {' or '.join(longer[:3])}? (flags are not abbreviated)"
        elif close:
            hint = f"; did you mean {close[0]}?"
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def _env_name(dest: str) -> str:
    return f"PET_{dest.upper()}"


class EnvDefault(argparse.Action):
    """A value flag whose default comes from ``PET_<DEST>`` (torchrun's ``env``)."""

    def __init__(
        self, option_strings: list[str], dest: str, legacy_env: str | None = None, **kwargs: Any
    ) -> None:
        # ``legacy_env``: the variable of the flag's old spelling, read when
        # ``PET_<DEST>`` is unset.
        self.env_name: str | None = None  # the variable the default came from
        for name in (_env_name(dest), legacy_env):
            env = os.environ.get(name) if name else None
            if env is not None and env != "":
                kwargs["default"] = env
                self.env_name = name
                break
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given: set[str] = getattr(namespace, _GIVEN, set())
        setattr(namespace, _GIVEN, given | {self.dest})


_GIVEN = "_elastrun_given"  # the namespace's dests given on the command line


def env_sources(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, str]:
    """``{flag: variable}`` for each flag whose value came from the
    environment (``PET_<FLAG>``), not from the command line."""
    given: set[str] = getattr(ns, _GIVEN, set())
    out: dict[str, str] = {}
    for action in parser._actions:  # argparse keeps them here
        if isinstance(action, EnvDefault) and action.env_name and action.dest not in given:
            flag = next(o for o in action.option_strings if o.startswith("--"))
            out[flag] = action.env_name
    return out


def name_env(exc: ConfigError, sources: Mapping[str, str]) -> ConfigError:
    """``exc`` naming the variable that gave the flag it is about:
    ``--nnodes (from PET_NNODES): expected an integer (ASCII digits), got '²'``."""
    message = named = str(exc)
    for flag, name in sources.items():
        found = re.search(rf"{re.escape(flag)}(?:=[^\s)]*)?(?![-\w])", named)
        if found is not None:
            named = f"{named[: found.end()]} (from {name}){named[found.end() :]}"
    return exc if named == message else ConfigError(named)


def _env_bool(dest: str, default: bool) -> bool:
    """``PET_<DEST>`` as 0 or 1 (unset or empty: ``default``)."""
    env = os.environ.get(_env_name(dest), "").strip()
    if not env:
        return default
    number = ascii_int(env)
    if number is None:
        shown = printable(repr(env if len(env) <= 64 else env[:64] + "..."))
        raise ConfigError(f"{_env_name(dest)}: expected 0 or 1, got {shown}")
    return bool(number)


class EnvFlag(argparse.Action):
    """A boolean flag that ``PET_<DEST>=1`` turns on (torchrun's ``check_env``)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        default = _env_bool(dest, False)
        kwargs.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


class EnvSwitch(argparse.BooleanOptionalAction):
    """A ``--flag`` / ``--no-flag`` pair whose default ``PET_<DEST>`` (0 or 1)
    sets; the command line wins."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs["default"] = _env_bool(dest, bool(kwargs.get("default")))
        super().__init__(option_strings, dest, **kwargs)


class LogsSpecs(argparse.Action):
    """torchrun's --logs-specs: ``default`` (torch's own DefaultLogsSpecs: the
    log folders, --redirects, --tee and --local-ranks-filter, which elastrun
    implements) is accepted as the no-op it is; plugins are not loaded."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if str(values).strip() != "default":
            raise ConfigError(
                f"{option_string}: {values!r}: elastrun loads no torchrun.logs_specs plugins; "
                "only 'default' (what --log-dir, --redirects, --tee and --local-ranks-filter "
                "do) is accepted"
            )
        setattr(namespace, self.dest, "default")


def both(name: str) -> list[str]:
    """``--nproc-per-node`` -> [``--nproc-per-node``, ``--nproc_per_node``]."""
    under = name.replace("-", "_").replace("__", "--", 1)
    return [name] if under == name else [name, under]


class Version(argparse.Action):
    """``--version``: ``elastrun <version>`` on stdout, then exit. The version is
    looked up only when asked: importlib.metadata is about 45 ms of CPU, which
    every agent start would pay for a flag it is almost never given."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "show program's version number and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"elastrun {_installed_version()}")
        parser.exit()


def _installed_version() -> str:
    try:
        from importlib.metadata import version

        return version("elastrun")
    except Exception:  # pragma: no cover - not installed
        return "unknown"


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
