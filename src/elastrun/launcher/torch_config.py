"""torch's ``LaunchConfig`` fields and value types, read as torch reads them.

Code written for ``torch.distributed.launcher.api.LaunchConfig`` passes
torch's types: ``signals_to_handle`` as one string (``"SIGTERM,SIGUSR1"``),
``shutdown_timeout=None`` (then ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30),
``rdzv_timeout`` (the join timeout, unless -1), ``logs_specs`` (torch's
``DefaultLogsSpecs``: a log folder, redirects, tee and the console's ranks),
``numa_options`` (torch's ``NumaOptions``: its ``affinity_mode``), and the
lists of ``duplicate_stdout_filters`` / ``duplicate_stderr_filters``.
:func:`torch_fields` maps each onto elastrun's own field, once, before the
config is checked (:func:`elastrun.launcher.plan.resolve`); the rest of
elastrun sees only its own types. ``metrics_cfg`` and ``event_log_handler``
are accepted and not used: elastrun's events go to ``events_file`` (JSON
lines, docs/events.md). torch is never imported: its objects are read by
their attributes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from elastrun.errors import ConfigError
from elastrun.launcher.flag_grammar import signal_tuple
from elastrun.launcher.limits import FLAG_SECONDS, parse_seconds

if TYPE_CHECKING:
    from elastrun.launcher.config import LaunchConfig

__all__ = ["torch_fields"]

# torch's DefaultLogsSpecs keeps these (a public property and private fields).
_LOGS_SPECS_NAMES = ("DefaultLogsSpecs",)


def torch_fields(config: LaunchConfig) -> LaunchConfig:
    """``config`` with torch's types and fields turned into elastrun's."""
    changes: dict[str, Any] = {
        "signals_to_handle": signal_tuple(config.signals_to_handle),
        "shutdown_timeout": _shutdown_timeout(config.shutdown_timeout),
        "duplicate_stdout_filters": _filters(
            "duplicate_stdout_filters", config.duplicate_stdout_filters
        ),
        "duplicate_stderr_filters": _filters(
            "duplicate_stderr_filters", config.duplicate_stderr_filters
        ),
    }
    if config.rdzv_timeout not in (None, -1):
        changes["rdzv_configs"] = {**config.rdzv_configs, "join_timeout": config.rdzv_timeout}
    if config.numa_options is not None:
        changes["numa_binding"] = _numa_mode(config.numa_options)
    if config.logs_specs is not None:
        changes.update(_logs_specs(config.logs_specs))
    return dataclasses.replace(config, **changes)


def _shutdown_timeout(value: object) -> float:
    """torch's ``None``: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s."""
    if value is not None:
        return value  # type: ignore[return-value]  # checked with the other numbers
    env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if env is None:
        return 30.0
    return parse_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env, FLAG_SECONDS["--shutdown-timeout"])


def _filters(name: str, value: object) -> tuple[str, ...]:
    """A list of substrings (torch's ``list[str] | None``)."""
    if value is None:
        return ()
    flag = "--" + name.replace("_", "-")
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"{flag}: expected a list of strings, got {value!r}")
    out = []
    for item in value:
        if not isinstance(item, str):
            raise ConfigError(f"{flag}: expected a list of strings, got {item!r} in it")
        out.append(item)
    return tuple(out)


def _numa_mode(options: object) -> str:
    """torch's ``NumaOptions``: its ``affinity_mode`` (an enum or its value)."""
    mode = getattr(options, "affinity_mode", options)
    value = getattr(mode, "value", mode)
    if not isinstance(value, str):
        raise ConfigError(f"--numa-binding: cannot read an affinity mode from {options!r}")
    return value


def _logs_specs(specs: object) -> dict[str, Any]:
    """torch's ``DefaultLogsSpecs``: what the log flags hold. Another
    ``LogsSpecs`` class (a plugin) is refused: its code decides where logs go."""
    if type(specs).__name__ not in _LOGS_SPECS_NAMES:
        raise ConfigError(
            f"--logs-specs: {type(specs).__name__} is not torch's DefaultLogsSpecs; elastrun "
            "runs no LogsSpecs plugins (use log_dir, redirects, tee and local_ranks_filter)"
        )
    out: dict[str, Any] = {}
    # torch made a temporary folder when given none; os.devnull: no log files.
    root = getattr(specs, "root_log_dir", None)
    if isinstance(root, str) and root:
        out["log_dir"] = None if root == os.devnull else root
    for field, attr in (("redirects", "_redirects"), ("tee", "_tee")):
        std = getattr(specs, attr, None)
        if std is not None:
            out[field] = _std(field, std)
    ranks = getattr(specs, "_local_ranks_filter", None)
    if ranks is not None:
        out["local_ranks_filter"] = frozenset(int(r) for r in ranks)
    return out


def _std(field: str, std: object) -> dict[int, int]:
    """torch's ``Std`` (every rank) or ``{local_rank: Std}`` as elastrun's map."""
    if isinstance(std, Mapping):
        return {int(k): _std_bits(field, v) for k, v in std.items()}
    return {-1: _std_bits(field, std)}


def _std_bits(field: str, std: object) -> int:
    value = getattr(std, "value", std)
    if not isinstance(value, int):
        raise ConfigError(f"--{field}: cannot read {std!r}")
    return value
