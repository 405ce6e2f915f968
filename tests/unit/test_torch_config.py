"""torchrun's remaining flags and torch's LaunchConfig types, as pure logic:
torch's field types mapped onto elastrun's (``launcher/torch_config``), the
filter lists, the NUMA binding read from a machine's sysfs (a fake one), the
virtual local rank's environment, the error files kept at exit, torch's
file-timer requests."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
from pathlib import Path

import pytest

from elastrun.agent.env import virtual_local_rank
from elastrun.agent.file_timers import TimerRequest, TimerTable, parse_request
from elastrun.agent.log_dirs import error_files
from elastrun.errors import ConfigError, WorkerError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.flag_grammar import signal_tuple
from elastrun.launcher.flags import parse_flags, split_filters
from elastrun.launcher.numa import format_cpu_list, numa_cpus, parse_cpu_list
from elastrun.launcher.plan import resolve
from elastrun.launcher.torch_config import torch_fields


def test_signals_to_handle_as_torchs_string() -> None:
    assert signal_tuple("SIGTERM,SIGUSR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert signal_tuple(["SIGTERM", 10]) == (signal.SIGTERM, signal.SIGUSR1)
    with pytest.raises(ConfigError, match="--signals-to-handle"):
        signal_tuple(3.5)
    plan = resolve(LaunchConfig(signals_to_handle="SIGTERM,SIGUSR1"))
    assert plan.workers.signals_to_handle == (signal.SIGTERM,)
    assert plan.workers.signals_to_forward == (signal.SIGUSR1,)


def test_shutdown_timeout_none_reads_torchs_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert resolve(LaunchConfig(shutdown_timeout=None)).workers.shutdown_timeout == 30.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert resolve(LaunchConfig(shutdown_timeout=None)).workers.shutdown_timeout == 7.0


def test_rdzv_timeout_is_the_join_timeout() -> None:
    cfg = LaunchConfig(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_timeout=77)
    assert resolve(cfg).rendezvous.join_timeout == 77.0
    assert torch_fields(LaunchConfig()).rdzv_configs == {}


class DefaultLogsSpecs:  # torch's class, by name and attributes
    def __init__(self, log_dir: str, redirects: int, tee: int) -> None:
        self.root_log_dir = log_dir
        self._redirects, self._tee, self._local_ranks_filter = redirects, tee, {1}


class CustomSpecs(DefaultLogsSpecs):
    pass


def test_logs_specs_sets_the_log_flags(tmp_path: Path) -> None:
    cfg = torch_fields(LaunchConfig(logs_specs=DefaultLogsSpecs(str(tmp_path), 1, 3)))
    assert cfg.log_dir == str(tmp_path)
    assert cfg.redirects == {-1: 1} and cfg.tee == {-1: 3}
    assert cfg.local_ranks_filter == frozenset({1})
    assert torch_fields(LaunchConfig(logs_specs=DefaultLogsSpecs(os.devnull, 0, 0))).log_dir is None
    with pytest.raises(ConfigError, match="CustomSpecs is not torch's DefaultLogsSpecs"):
        torch_fields(LaunchConfig(logs_specs=CustomSpecs("x", 0, 0)))


def test_filters_and_numa_options() -> None:
    @dataclasses.dataclass
    class NumaOptions:
        affinity_mode: str

    cfg = torch_fields(
        LaunchConfig(duplicate_stdout_filters=["a"], numa_options=NumaOptions("socket"))
    )
    assert cfg.duplicate_stdout_filters == ("a",) and cfg.duplicate_stderr_filters == ()
    assert cfg.numa_binding == "socket"
    with pytest.raises(ConfigError, match="--duplicate-stderr-filters"):
        torch_fields(LaunchConfig(duplicate_stderr_filters="abc"))


def test_split_filters_as_torchrun() -> None:
    assert split_filters("apple,orange") == ("apple", "orange")
    assert split_filters("a,,b,c") == ("a,b", "c")
    assert split_filters("") == ()


def test_flags_reach_the_worker_spec(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    flags = parse_flags(
        [
            "--virtual-local-rank",
            "--duplicate-stdout-filters=x,y",
            "--duplicate_stderr_filters=z",
            str(script),
        ]
    )
    spec = resolve(flags.config).workers
    assert spec.virtual_local_rank
    assert spec.logs.duplicate_stdout_filters == ("x", "y")
    assert spec.logs.duplicate_stderr_filters == ("z",)


def test_virtual_local_rank_environment() -> None:
    main = "ELASTRUN_LOCAL_MAIN"  # the node's real local rank 0, flagged
    assert virtual_local_rank(1, None) == {
        "LOCAL_RANK": "0",
        "CUDA_VISIBLE_DEVICES": "1",
        main: "0",
    }
    assert virtual_local_rank(1, "4, 6") == {
        "LOCAL_RANK": "0",
        "CUDA_VISIBLE_DEVICES": "6",
        main: "0",
    }
    assert virtual_local_rank(0, "4, 6") == {
        "LOCAL_RANK": "0",
        "CUDA_VISIBLE_DEVICES": "4",
        main: "1",
    }
    with pytest.raises(WorkerError, match="no device"):
        virtual_local_rank(2, "4,6")


def test_cpu_lists() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def machine(root: Path, gpus: dict[str, int], nodes: dict[int, str]) -> tuple[str, str]:
    """A fake /sys and /proc: GPUs (PCI address -> NUMA node), nodes' CPUs;
    two threads per core (CPU c and c+1), one socket per node."""
    sysfs, proc = root / "sys", root / "proc"
    for pci, node in gpus.items():
        (proc / "driver/nvidia/gpus" / pci).mkdir(parents=True)
        dev = sysfs / "bus/pci/devices" / pci
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{node}\n")
    node_dir = sysfs / "devices/system/node"
    node_dir.mkdir(parents=True)
    (node_dir / "possible").write_text(f"0-{max(nodes)}\n")
    for node, cpus in nodes.items():
        (node_dir / f"node{node}").mkdir()
        (node_dir / f"node{node}/cpulist").write_text(cpus + "\n")
        for c in parse_cpu_list(cpus):
            topo = sysfs / f"devices/system/cpu/cpu{c}/topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text(f"{node}\n")
            first = c - c % 2
            (topo / "thread_siblings_list").write_text(f"{first}-{first + 1}\n")
    return str(sysfs), str(proc)


def test_numa_binding_from_the_machines_topology(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "numactl").write_text("#!/bin/sh\n")
    (bin_dir / "numactl").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", str(bin_dir))
    gpus = {"0000:3b:00.0": 0, "0000:1a:00.0": 0, "0000:af:00.0": 1, "0000:d8:00.0": 1}
    sysfs, proc = machine(tmp_path, gpus, {0: "0-7", 1: "8-15"})
    # GPUs in PCI order: 1a, 3b (node 0), af, d8 (node 1)
    assert numa_cpus("node", 4, sysfs=sysfs, proc=proc) == {
        0: "0-7",
        1: "0-7",
        2: "8-15",
        3: "8-15",
    }
    assert numa_cpus("exclusive", 4, sysfs=sysfs, proc=proc) == {
        0: "0-3",
        1: "4-7",
        2: "8-11",
        3: "12-15",
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert numa_cpus("socket", 1, sysfs=sysfs, proc=proc) == {0: "8-15"}
    with pytest.raises(ConfigError, match="2 workers but 1 visible GPUs"):
        numa_cpus("node", 2, sysfs=sysfs, proc=proc)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="numactl is not installed"):
        numa_cpus("node", 1, sysfs=sysfs, proc=proc)
    with pytest.raises(ConfigError, match="no visible NVIDIA GPU"):
        numa_cpus("node", 1, sysfs=sysfs, proc=str(tmp_path / "no-proc"))


def test_error_files_found_under_the_attempts(tmp_path: Path) -> None:
    for attempt, rank in (("attempt_2", "0"), ("attempt_1", "1"), ("attempt_1", "0")):
        (tmp_path / attempt / rank).mkdir(parents=True, exist_ok=True)
    (tmp_path / "attempt_1/1/error.json").write_text("{}")
    (tmp_path / "attempt_2/0/error.json").write_text("{}")
    os.symlink("/etc", tmp_path / "attempt_3")
    assert error_files(str(tmp_path)) == [
        str(tmp_path / "attempt_1/1/error.json"),
        str(tmp_path / "attempt_2/0/error.json"),
    ]


def test_timer_requests_are_read_within_bounds() -> None:
    line = b'{"version": 1, "pid": 42, "scope_id": "s", "expiration_time": 5.5, "signal": 9}'
    assert parse_request(line) == TimerRequest(42, "s", 5.5, 9)
    for bad in (
        b"not json",
        b'{"version": 2, "pid": 42, "scope_id": "s", "expiration_time": 5, "signal": 9}',
        b'{"version": 1, "pid": -1, "scope_id": "s", "expiration_time": 5, "signal": 9}',
        b'{"version": 1, "pid": 42, "scope_id": 7, "expiration_time": 5, "signal": 9}',
        b'{"version": 1, "pid": 42, "scope_id": "s", "expiration_time": "x", "signal": 9}',
        b'{"version": 1, "pid": 42, "scope_id": "s", "expiration_time": 5, "signal": 99}',
        b'{"version": 1, "pid": true, "scope_id": "s", "expiration_time": 5, "signal": 9}',
        b"[" * 5000,
    ):
        assert parse_request(bad) is None, bad


def test_timer_table_as_torchs_server() -> None:
    table = TimerTable(limit=3)
    table.register(TimerRequest(1, "a", 10.0, 9))
    table.register(TimerRequest(1, "b", 5.0, 0))  # no signal: expires unreaped
    table.register(TimerRequest(2, "c", 20.0, 15))
    table.register(TimerRequest(3, "d", 1.0, 9))  # past the limit
    assert table.refused == 1
    assert table.next_expiry() == 5.0
    assert table.expired(12.0) == {1: TimerRequest(1, "a", 10.0, 9)}
    table.register(TimerRequest(1, "a", -1, 0))  # released
    assert table.expired(12.0) == {}
    table.clear({1})
    assert list(table.timers) == [(2, "c")]
