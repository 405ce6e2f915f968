"""How the launcher's command line is read, whatever the flag: both
spellings of a flag (:func:`both`), torchrun's ``PET_<FLAG>`` environment
defaults (:class:`EnvDefault`, :class:`EnvFlag`; a value's error names the
variable it came from: :func:`env_sources`, :func:`name_env`), torchrun's
``--logs-specs`` accepted as the no-op it is (:class:`LogsSpecs`), and the
message for arguments that are no flag (:func:`unknown_flags_message`: flags
are never abbreviated). The flags themselves are declared in
:mod:`elastrun.launcher.flags` and :mod:`elastrun.launcher.flags_torchrun`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from elastrun.errors import ConfigError
from elastrun.untrusted import ascii_int, printable

__all__ = [
    "EnvDefault",
    "EnvFlag",
    "EnvSwitch",
    "LogsSpecs",
    "Parser",
    "both",
    "env_sources",
    "name_env",
    "unknown_flags_message",
    "version",
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


def version() -> str:
    try:
        from importlib.metadata import version

        return version("elastrun")
    except Exception:  # pragma: no cover - not installed
        return "unknown"
