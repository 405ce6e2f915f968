"""torchrun's own flags, beyond the launch itself: NUMA binding, virtual
local ranks, duplicated log lines, torch's event handler and logs specs.

:func:`add_torchrun_flags` declares them on the one parser
(:func:`elastrun.launcher.flags.build_parser`); :func:`torchrun_settings`
reads them into the :class:`~elastrun.launcher.config.LaunchConfig` fields
they set. Each has torchrun's spellings and ``PET_<FLAG>`` default.
"""

from __future__ import annotations

import argparse
from typing import Any

from elastrun.launcher.flag_parser import EnvDefault, EnvFlag, LogsSpecs, both
from elastrun.launcher.numa import NUMA_MODES

__all__ = ["add_torchrun_flags", "split_filters", "torchrun_settings"]


def add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("torchrun compatibility")
    c.add_argument(
        *both("--numa-binding"),
        action=EnvDefault,
        default=None,
        choices=NUMA_MODES,
        metavar="MODE",
        help="as torchrun: run each worker under numactl, bound to the CPUs near the GPU of "
        "its local rank: node (the GPU's NUMA node), socket (its socket), exclusive (an equal "
        "share of the node's cores for each of its GPUs' workers), core-complex (a group of "
        "CPUs sharing the last-level cache). Needs NVIDIA GPUs and numactl: refused, saying "
        "which is missing, without them (default: off)",
    )
    c.add_argument(
        *both("--virtual-local-rank"),
        action=EnvFlag,
        help="every worker gets LOCAL_RANK=0 and, as CUDA_VISIBLE_DEVICES, only its own GPU "
        "(the local rank's entry of CUDA_VISIBLE_DEVICES, else the local rank), as torchrun "
        "(default: off)",
    )
    for stream in ("stdout", "stderr"):
        c.add_argument(
            *both(f"--duplicate-{stream}-filters"),
            action=EnvDefault,
            default="",
            metavar="TEXT,...",
            help=f"copy the {stream} lines of --tee'd ranks that contain one of these texts "
            f"to filtered_{stream}.log in the attempt's log folder (a double comma is a "
            "comma in a text), as torchrun (default: none)",
        )
    c.add_argument(
        *both("--event-log-handler"),
        action=EnvDefault,
        default="null",
        metavar="NAME",
        help="accepted and not used: elastrun's events go to --events-file (JSON lines)",
    )
    c.add_argument(
        *both("--logs-specs"),
        action=LogsSpecs,
        default=None,
        metavar="NAME",
        help="accepted: 'default' (torch's default logs, which these flags are); plugins are "
        "not loaded",
    )


def split_filters(text: str) -> tuple[str, ...]:
    """torchrun's list: ``a,b`` -> (a, b); ``,,`` is a comma in a text;
    empty texts dropped (they would match every line)."""
    placeholder = "\x00"
    items = text.replace(",,", placeholder).split(",")
    return tuple(i.replace(placeholder, ",") for i in items if i)


def torchrun_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The LaunchConfig fields these flags set."""
    return {
        "numa_binding": ns.numa_binding or None,
        "virtual_local_rank": ns.virtual_local_rank,
        "duplicate_stdout_filters": split_filters(ns.duplicate_stdout_filters),
        "duplicate_stderr_filters": split_filters(ns.duplicate_stderr_filters),
        "event_log_handler": ns.event_log_handler,
    }
