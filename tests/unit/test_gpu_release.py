"""The GPU-memory wait's pure parts (agent/gpu_release.py): what nvidia-smi's
answer says, whose memory it is, and the bound from the environment."""

from __future__ import annotations

import os

import pytest

from elastrun.agent.gpu_release import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    held_by,
    parse_compute_apps,
    query_compute_apps,
)
from elastrun.errors import ConfigError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve


def test_nvidia_smi_lines_are_read_and_the_rest_left_out():
    text = "1234, 5678\n 42 , 100\n[N/A], 3\nNo running processes found\n1234, 2\n77, [N/A]\n"
    assert parse_compute_apps(text) == {1234: 5680, 42: 100, 77: 0}
    assert parse_compute_apps("") == {}


def test_memory_is_the_workers_when_their_pid_or_session_holds_it():
    me = os.getpid()
    session = os.getsid(0)  # this process's session: as a worker's child is in the worker's
    apps = {me: 10, 99999999: 20}
    assert held_by(apps, {me}) == {me: 10}
    assert held_by(apps, {session}) == {me: 10}
    assert held_by(apps, {1}) == ({me: 10} if session == 1 else {})
    assert held_by(apps, set()) == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", DEFAULT_TIMEOUT),
        ("0", 0.0),
        ("12.5", 12.5),
        ("soon", None),
        ("-1", None),
        ("1e9", None),
    ],
    ids=["unset", "off", "seconds", "word", "negative", "huge"],
)
def test_the_bound_comes_from_the_launchers_environment(monkeypatch, text, expected):
    monkeypatch.setenv(TIMEOUT_ENV, text)
    if expected is None:
        with pytest.raises(ConfigError, match=f"^{TIMEOUT_ENV}: "):
            resolve(LaunchConfig(nproc_per_node=1, standalone=True))
        return
    plan = resolve(LaunchConfig(nproc_per_node=1, standalone=True))
    assert plan.workers.gpu_release.timeout == expected


def test_a_query_that_fails_or_hangs_says_nothing(tmp_path):
    assert query_compute_apps(str(tmp_path / "missing")) is None
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho '1, 2'\nexit 3\n")
    failing.chmod(0o755)
    assert query_compute_apps(str(failing)) is None
    hanging = tmp_path / "hanging"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    assert query_compute_apps(str(hanging), timeout=0.2) is None
