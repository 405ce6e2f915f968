"""The GPU-memory wait's pure parts (agent/gpu_release.py): what nvidia-smi's
answer says, whose memory it is, and the bound from the environment."""

from __future__ import annotations

import os

import pytest

from elastrun.agent.gpu_release import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    _timeout,
    held_by,
    parse_compute_apps,
    query_compute_apps,
)


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


class _Core:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize(
    ("text", "expected", "warned"),
    [
        ("", DEFAULT_TIMEOUT, False),
        ("0", 0.0, False),
        ("12.5", 12.5, False),
        ("soon", DEFAULT_TIMEOUT, True),
        ("-1", DEFAULT_TIMEOUT, True),
        ("1e9", DEFAULT_TIMEOUT, True),
    ],
    ids=["unset", "off", "seconds", "word", "negative", "huge"],
)
def test_the_bound_comes_from_the_environment(monkeypatch, text, expected, warned):
    monkeypatch.setenv(TIMEOUT_ENV, text)
    core = _Core()
    assert _timeout(core) == expected  # type: ignore[arg-type]
    assert bool(core.lines) == warned
    if warned:
        assert TIMEOUT_ENV in core.lines[0] and "using 30" in core.lines[0]


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
