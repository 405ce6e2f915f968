"""Fault attribution's settings as the launcher resolves them: the flags into
``WorkerSpec.attribution`` (and ``WorkerSpec.stragglers``: a straggler
replaced by a spare), their bounds, and ``ELASTRUN_HOST_NAME``."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrun.agent.command import WorkerCommand
from elastrun.errors import ConfigError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.flags import parse_flags, resolve_flags
from elastrun.launcher.plan import host_name_from, resolve

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train.py")


def default_command() -> WorkerCommand:
    return resolve(LaunchConfig()).workers.command


def test_the_flags_reach_the_agent_as_one_settings_group() -> None:
    flags = parse_flags(
        [
            "--fault-limit=3",
            "--no-stop-on-script-fault",
            "--quarantine-time=900",
            SCRIPT,
        ]
    )
    spec = resolve_flags(flags, resolve(LaunchConfig()).workers.command).workers.attribution
    assert (spec.limit, spec.stop_script_faults, spec.quarantine) == (3, False, 900.0)
    default = resolve(LaunchConfig()).workers.attribution
    assert (default.limit, default.stop_script_faults, default.quarantine) == (2, True, 600.0)
    # The flags' default is the API's, and 0 turns exclusion off.
    no_flag = parse_flags([SCRIPT])
    assert resolve_flags(no_flag, default_command()).workers.attribution.quarantine == 600.0
    off = parse_flags(["--quarantine-time=0", SCRIPT])
    assert resolve_flags(off, default_command()).workers.attribution.quarantine == 0.0


def test_the_straggler_flags_reach_the_agent_with_the_quarantine_time_as_the_hold() -> None:
    flags = parse_flags(["--replace-stragglers=3", "--straggler-interval=0.5", SCRIPT])
    spec = resolve_flags(flags, resolve(LaunchConfig()).workers.command).workers.stragglers
    assert (spec.replace_after, spec.interval, spec.hold) == (3, 0.5, 600.0)
    held = resolve(LaunchConfig(replace_stragglers=2, quarantine_time=60)).workers.stragglers
    assert held.hold == 60.0
    default = resolve(LaunchConfig()).workers.stragglers
    assert (default.replace_after, default.interval) == (0, 5.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LaunchConfig(replace_stragglers=-1), "--replace-stragglers"),
        (LaunchConfig(replace_stragglers=1001), "--replace-stragglers"),
        (LaunchConfig(straggler_interval=0.0), "--straggler-interval"),
        (LaunchConfig(straggler_interval=float("nan")), "--straggler-interval"),
        (LaunchConfig(fault_limit=33), "--fault-limit"),
        (LaunchConfig(fault_limit=-1), "--fault-limit"),
        (LaunchConfig(quarantine_time=-5), "--quarantine-time"),
        (LaunchConfig(quarantine_time=10 * 7 * 24 * 3600), "--quarantine-time"),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_flag(
    config: LaunchConfig, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(config)


def test_a_node_name_is_checked_where_it_enters() -> None:
    assert host_name_from({}) is None
    assert host_name_from({"ELASTRUN_HOST_NAME": ""}) is None
    assert host_name_from({"ELASTRUN_HOST_NAME": "gpu-07.rack3"}) == "gpu-07.rack3"
    for bad in ("a/b", "x" * 254, "new\nline", "sp ace"):
        with pytest.raises(ConfigError, match="ELASTRUN_HOST_NAME="):
            host_name_from({"ELASTRUN_HOST_NAME": bad})
