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


# ------------------------------------------------------------ a fake /proc tree
def _process(proc, pid: int, session: int, *fds: str, state: str = "S") -> None:
    """``proc/PID`` as the kernel shows it: its stat (state, session) and its
    open files as fd links (the targets need not exist)."""
    folder = proc / str(pid)
    (folder / "fd").mkdir(parents=True)
    (folder / "stat").write_text(f"{pid} (py (x)) {state} 1 {session} {session} 0 -1\n")
    for i, target in enumerate(fds):
        os.symlink(target, folder / "fd" / str(i))


def _tree(proc) -> None:
    _process(proc, 200, 100, "/dev/null", "/dev/nvidiactl", "/dev/nvidia0")  # a worker's child
    _process(proc, 300, 999, "/dev/nvidia0")  # another job's process
    _process(proc, 400, 100, "pipe:[1234]")  # a worker's child without the GPU
    _process(proc, 500, 100, "/dev/nvidia-uvm", state="Z")  # a zombie: gone
    (proc / "self").mkdir()


def test_leftover_processes_are_found_by_their_open_nvidia_files(tmp_path):
    # Without nvidia-smi, or in a pod without hostPID (nvidia-smi lists the host's pids).
    from elastrun.agent.gpu_release import device_holders

    _tree(tmp_path)
    assert device_holders({100}, str(tmp_path)) == {200, 500}
    assert device_holders({999}, str(tmp_path)) == {300}
    assert device_holders(set(), str(tmp_path)) == set()
    assert device_holders({100}, str(tmp_path / "missing")) == set()


class _Core:
    def __init__(self) -> None:
        from elastrun.clock import SYSTEM_CLOCK
        from elastrun.events import ListSink

        self.clock = SYSTEM_CLOCK
        self.events = ListSink()
        self.said: list[str] = []
        self.say = self.said.append


def _feature(proc, kills: list[int], dies: bool):
    import asyncio

    from elastrun.agent.gpu_release import GpuRelease

    def kill(pid: int, sig: int) -> None:
        kills.append(pid)
        if dies:
            stat = proc / str(pid) / "stat"
            stat.write_text(stat.read_text().replace(") S ", ") Z "))

    core = _Core()
    feature = GpuRelease(core, None, 0.3, proc=str(proc), kill=kill, kill_wait=0.5)  # type: ignore[arg-type]
    feature.stopped = {100}
    return asyncio.run(feature.wait_released()), core


def test_a_node_whose_old_workers_cannot_be_killed_is_unhealthy(tmp_path):
    from elastrun.errors import WorkerError

    _tree(tmp_path)
    kills: list[int] = []
    with pytest.raises(WorkerError, match=r"unhealthy.*pid 200.*did not die 0.5s after SIGKILL"):
        _feature(tmp_path, kills, dies=False)
    assert kills == [200]  # the zombie is not killed, nor another job's process


def test_a_leftover_holder_that_dies_when_killed_lets_the_workers_start(tmp_path):
    _tree(tmp_path)
    kills: list[int] = []
    _, core = _feature(tmp_path, kills, dies=True)
    assert kills == [200]
    (wait,) = core.events.events
    assert wait["kind"] == "gpu_memory_wait" and wait["pids"] == [200, 500]
    assert "starting the new workers anyway" in core.said[-1]
