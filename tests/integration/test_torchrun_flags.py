"""Conformance with torchrun 2.13's remaining flags and API fields, with real
agents and real workers, compared with torchrun itself (in the venv) where
the machine lets torchrun run them: --virtual-local-rank, the duplicated
stdout/stderr lines, --numa-binding (refused here without GPUs, saying why),
their PET_* variables, torch's LaunchConfig fields and string types through
``elastrun.launch()``, TORCHELASTIC_SIGNALS_TO_HANDLE in the launching
process, and error files kept (and named) without --log-dir."""

from __future__ import annotations

import http.client
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from elastrun.launcher.devices import count_gpus
from tests.conftest import REPO
from tests.helpers import free_port, stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN
from tests.integration.scripts.conformance.batch import EXIT, split
from tests.integration.test_torchrun_conformance import BIN, env, launch_cases, torchrun
from tests.unit.test_health_check import listening

SHOW = str(BIN / "show_env.py")
RUN_TIMEOUT = 240


Args = tuple[list[str], dict[str, str]]


def real_torchruns(cases: dict[str, Args]) -> dict[str, subprocess.CompletedProcess[str]]:
    """torch's own ``torchrun ARGS`` with ENV for each case, one after the
    other in one process (torchrun_driver: one ``import torch`` for all),
    each as if run on its own: its exit code, stdout and stderr."""
    spec = json.dumps(list(cases.values()))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.scripts.conformance.torchrun_driver", spec],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT * len(cases),
        env=env(),
        check=False,
        cwd=REPO,
    )
    parts = split(proc.stdout, proc.stderr)
    assert proc.returncode == 0 and len(parts) == len(cases), proc.stderr[-3000:]
    got = {}
    for name, (args, _), (out, err) in zip(cases, cases.values(), parts, strict=True):
        code = re.findall(rf"^{EXIT} (\d+)$", out, re.MULTILINE)
        assert code, f"{name}: {out[-2000:]}{err[-2000:]}"
        got[name] = subprocess.CompletedProcess(args, int(code[-1]), out, err)
    return got


def virtual_case(how: str, visible: str | None) -> Args:
    extra = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    flags = ["--standalone", "--nproc-per-node=2"]
    if how == "flag":
        flags.append("--virtual-local-rank")
    else:
        extra[how] = "1"
    return [*flags, SHOW, "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"], extra


def duplicate_case(how: str, logs: Path) -> Args:
    out_filters, err_filters = "apple,kiwi,,lime", "pear"
    flags = ["--standalone", "--nproc-per-node=2", "--tee=3"]
    extra: dict[str, str] = {}
    if how == "flags":
        flags += [
            f"--duplicate-stdout-filters={out_filters}",
            f"--duplicate-stderr-filters={err_filters}",
        ]
    else:
        extra = {
            "PET_DUPLICATE_STDOUT_FILTERS": out_filters,
            "PET_DUPLICATE_STDERR_FILTERS": err_filters,
        }
    says = ["--say", "apple pie", "--say", "banana", "--say", "kiwi,lime tart"]
    says += ["--say", "kiwi alone", "--warn", "pear drop", "--warn", "plum"]
    return [*flags, f"--log-dir={logs}", SHOW, *says], extra


VIRTUAL = [("flag", None), ("flag", "5,7"), ("PET_VIRTUAL_LOCAL_RANK", None)]


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What torchrun itself did in this module's comparisons, keyed by case
    (``virtual:HOW:VISIBLE``, ``duplicate:HOW``, ``error_kept``,
    ``error_copied``), all in one torchrun_driver; the duplicate cases' log
    folders and the error_copied case's file under ``folder``."""
    folder = tmp_path_factory.mktemp("theirs")
    script = folder / "recorded.py"
    script.write_text(RECORDED)
    cases = {f"virtual:{how}:{visible}": virtual_case(how, visible) for how, visible in VIRTUAL}
    for how in ("flags", "pet"):
        cases[f"duplicate:{how}"] = duplicate_case(how, folder / how)
    recorded = ["--standalone", "--nproc-per-node=1", str(script)]
    cases["error_kept"] = (recorded, {})
    cases["error_copied"] = (recorded, {"TORCHELASTIC_ERROR_FILE": str(folder / "theirs.json")})
    return {**real_torchruns(cases), "folder": folder}


def envs(stdout: str) -> list[dict[str, Any]]:
    """Every ``ENV {...}`` line show_env.py printed (a prefix may come first)."""
    return [json.loads(m) for m in re.findall(r"ENV (\{[^}]*\})", stdout)]


def pairs(stdout: str) -> list[tuple[str | None, str | None]]:
    return sorted((e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs(stdout))


@pytest.mark.parametrize(("how", "visible"), VIRTUAL, ids=["flag", "visible_devices", "pet"])
def test_virtual_local_rank_as_torchrun(
    theirs: dict[str, Any], how: str, visible: str | None
) -> None:
    args, extra = virtual_case(how, visible)
    ours = torchrun(*args, extra_env=extra)
    assert ours.returncode == 0, ours.stderr[-3000:]
    devices = visible.split(",") if visible else ["0", "1"]
    assert pairs(ours.stdout) == [("0", devices[0]), ("0", devices[1])], ours.stdout
    real = theirs[f"virtual:{how}:{visible}"]
    assert real.returncode == 0, real.stderr[-3000:]
    assert pairs(real.stdout) == pairs(ours.stdout)


def filtered(log_dir: Path, stream: str) -> list[str]:
    """The lines of every filtered_STREAM.log under ``log_dir``, without their prefix."""
    lines = []
    for path in sorted(log_dir.rglob(f"filtered_{stream}.log")):
        for line in path.read_text().splitlines():
            lines.append(re.sub(r"^\[[^\]]*\]:\s?", "", line))
    return sorted(lines)


@pytest.mark.parametrize("how", ["flags", "pet"])
def test_duplicate_filters_as_torchrun(theirs: dict[str, Any], tmp_path: Path, how: str) -> None:
    args, extra = duplicate_case(how, tmp_path / "ours")
    proc = torchrun(*args, extra_env=extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = theirs[f"duplicate:{how}"]
    assert real.returncode == 0, real.stderr[-3000:]
    results = {
        name: (filtered(logs, "stdout"), filtered(logs, "stderr"))
        for name, logs in (("ours", tmp_path / "ours"), ("theirs", theirs["folder"] / how))
    }
    # "kiwi,,lime" is one text, "kiwi,lime": a comma in a filter
    assert results["ours"] == (
        ["apple pie", "apple pie", "kiwi,lime tart", "kiwi,lime tart"],
        ["pear drop", "pear drop"],
    ), results
    assert results["ours"] == results["theirs"]


@pytest.mark.skipif(count_gpus() > 0, reason="this machine has a GPU")
def test_numa_binding_without_a_gpu_is_refused_saying_why(tmp_path: Path) -> None:
    proc = torchrun("--standalone", "--numa-binding=node", SHOW)
    assert proc.returncode == 2, proc.stderr
    assert "--numa-binding" in proc.stderr and "no visible NVIDIA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
    bad = torchrun("--standalone", "--numa-binding=nodes", SHOW)
    assert bad.returncode == 2 and "--numa-binding" in bad.stderr


@pytest.fixture(scope="module")
def torch_typed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``elastrun.launch()`` given torch's LaunchConfig fields and types, and
    (without a GPU) numa_options: both in one driver process (one ``import
    torch``). What came back, keyed ``fields`` and ``numa``, and the fields
    case's log folder."""
    logs = tmp_path_factory.mktemp("typed") / "logs"
    fields = {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 2,
        "run_id": "",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "127.0.0.1:0",
        "max_restarts": 0,
        "logs_specs": {"log_dir": str(logs), "redirects": 0, "tee": 3},
        "signals_to_handle": "SIGTERM,SIGUSR1",
        "shutdown_timeout": None,
        "rdzv_timeout": 120,
        "metrics_cfg": {"a": "b"},
        "event_log_handler": "null",
        "virtual_local_rank": True,
        "duplicate_stdout_filters": ["apple"],
        "duplicate_stderr_filters": None,
    }
    cases = {"fields": ("env", fields, Path("LOCAL_RANK,TORCHELASTIC_SIGNALS_TO_HANDLE"))}
    if count_gpus() == 0:
        numa = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, "rdzv_backend": "c10d"}
        numa |= {"rdzv_endpoint": "127.0.0.1:0", "numa_options": "node"}
        cases["numa"] = ("env", numa, Path("LOCAL_RANK"))
    got = launch_cases(list(cases.values()))
    return {**dict(zip(cases, got, strict=True)), "logs": logs}


def test_launch_config_takes_torchs_fields_and_types(torch_typed: dict[str, Any]) -> None:
    """upstream's LaunchConfig fields through ``elastrun.launch()``: torch's
    DefaultLogsSpecs (logs in its folder, tee'd), signals_to_handle as a
    string, shutdown_timeout=None, rdzv_timeout, metrics_cfg,
    event_log_handler, virtual_local_rank and the duplicate filters."""
    logs = torch_typed["logs"]
    got = torch_typed["fields"]
    assert got.get("result") == 0, got
    # the launching process' environment, as torch's launcher sets it
    assert got["signals_to_handle"] == "SIGTERM,SIGUSR1"
    assert filtered(logs, "stdout") == ["apple pie", "apple pie"], list(logs.rglob("*"))
    assert len(list(logs.rglob("stdout.log"))) == 2


@pytest.mark.skipif(count_gpus() > 0, reason="this machine has a GPU")
def test_launch_config_numa_options_without_a_gpu_is_refused(torch_typed: dict[str, Any]) -> None:
    got = torch_typed["numa"]
    assert got.get("error") == "ConfigError", got
    assert "numa_options" in got["message"] and "GPU" in got["message"], got


RECORDED = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise ValueError("recorded failure")

main()
"""


def test_error_files_are_kept_and_named_without_log_dir(
    theirs: dict[str, Any], tmp_path: Path
) -> None:
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    proc = torchrun("--standalone", "--nproc-per-node=1", str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    named = re.findall(r"error file: (\S+error\.json)", proc.stderr)
    assert named, proc.stderr[-3000:]
    path = Path(named[0])
    assert path.is_file()
    assert "recorded failure" in path.read_text()
    assert f"error files are kept: {path}" in proc.stderr
    # torchrun keeps its error file too (and names it in its report)
    real = theirs["error_kept"]
    assert real.returncode == 1
    kept = re.findall(r"error_file: (\S+error\.json)", real.stderr)
    assert kept and os.path.isfile(kept[0]), real.stderr[-3000:]


def test_launchers_error_file_gets_the_root_causes_error_as_torchrun(
    theirs: dict[str, Any], tmp_path: Path
) -> None:
    """A scheduler sets TORCHELASTIC_ERROR_FILE in the launcher's environment:
    torchrun copies the root cause's error.json there, errorCode its exit code."""
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    written = {}
    real = theirs["error_copied"]
    assert real.returncode == 1, real.stderr[-3000:]
    dest = theirs["folder"] / "theirs.json"
    assert dest.is_file(), f"theirs: {real.stderr[-3000:]}"
    written["theirs"] = json.loads(dest.read_text())["message"]
    dest = tmp_path / "ours.json"
    proc = torchrun(
        "--standalone",
        "--nproc-per-node=1",
        str(script),
        extra_env={"TORCHELASTIC_ERROR_FILE": str(dest)},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert dest.is_file(), f"ours: {proc.stderr[-3000:]}"
    written["ours"] = json.loads(dest.read_text())["message"]
    for message in written.values():
        assert "recorded failure" in message["message"], written
        assert message["errorCode"] == 1, written
        assert "recorded failure" in message["extraInfo"]["py_callstack"], written


def test_launch_config_defaults_are_torchs() -> None:
    """elastrun.LaunchConfig's defaults are torch's LaunchConfig's where both
    have the field (torchrun's CLI defaults differ: --max-restarts 0, --role default)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig as TorchConfig

    import elastrun

    ours = {f.name: f for f in dataclasses.fields(elastrun.LaunchConfig)}
    theirs = {f.name: f for f in dataclasses.fields(TorchConfig)}
    cfg = elastrun.LaunchConfig()
    for name in ("role", "max_restarts", "monitor_interval", "start_method", "rdzv_timeout"):
        assert name in ours and theirs[name].default == getattr(cfg, name), name
    assert (cfg.role, cfg.max_restarts) == ("default_role", 3)


TIMED = """
import os, sys, time
import torch.distributed as dist
from torch.distributed.elastic import timer

dist.init_process_group("gloo")
rank = dist.get_rank()
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with timer.expires(after=0.5, scope="quick step"):
    pass  # released in time
dist.barrier()
if rank == 1:
    with timer.expires(after=1, scope="stuck step"):
        time.sleep(600)
dist.barrier()  # rank 0 waits here for rank 1
"""


def rank_1_times_out(
    script: Path, folder: Path, extra: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Two ranks of ``script FOLDER``, no restart: rank 1 is the root cause."""
    proc = torchrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        str(script),
        str(folder),
        extra_env=extra,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[ROOT CAUSE] rank 1" in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("how", ["enable", "timer_file"])
def test_file_timer_stops_the_overrunning_worker_and_names_it(tmp_path: Path, how: str) -> None:
    script = tmp_path / "timed.py"
    script.write_text(TIMED)
    extra = (
        {"TORCHELASTIC_ENABLE_FILE_TIMER": "1"}
        if how == "enable"
        else {"TORCHELASTIC_TIMER_FILE": str(tmp_path / "timers.fifo")}
    )
    proc = rank_1_times_out(script, tmp_path, extra)
    assert "timer 'stuck step' expired" in proc.stderr
    assert "quick step" not in proc.stderr
    # no orphans: both workers are gone when the launcher returns
    for rank in (0, 1):
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert (
            not Path(f"/proc/{pid}").exists()
            or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        ), rank
    # One pipe per local rank, at TORCHELASTIC_TIMER_FILE.{local_rank}; removed at exit.
    assert not list(tmp_path.glob("timers.fifo*"))


SIBLING = """
import json, os, sys, time
folder, rank = sys.argv[1], int(os.environ["LOCAL_RANK"])
with open(os.path.join(folder, f"pid{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(folder, f"pid{rank}.tmp"), os.path.join(folder, f"pid{rank}"))

def send(pid, scope, when):  # as torch's FileTimerClient writes a request
    fd = os.open(os.environ["TORCHELASTIC_TIMER_FILE"], os.O_WRONLY | os.O_NONBLOCK)
    line = {"version": 1, "pid": pid, "scope_id": scope, "expiration_time": when, "signal": 9}
    os.write(fd, (json.dumps(line) + "\\n").encode())
    os.close(fd)

if rank == 1:
    victim = os.path.join(folder, "pid0")
    for _ in range(2400):
        if os.path.exists(victim):
            break
        time.sleep(0.05)
    send(int(open(victim).read()), "sibling", time.time() - 10)  # rank 0's pid, expired
    send(os.getpid(), "own", time.time() - 1)  # its own, expired
time.sleep(600)
"""


def test_a_rank_cannot_set_a_timer_on_a_sibling(tmp_path: Path) -> None:
    # Rank 1 asks for an expired timer on rank 0's pid, then on its own: only
    # its own is held (the sibling's was: rank 0 was killed, the root cause).
    script = tmp_path / "sibling.py"
    script.write_text(SIBLING)
    proc = rank_1_times_out(script, tmp_path, {"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    assert "timer 'own' expired" in proc.stderr
    assert "sibling" not in proc.stderr, proc.stderr[-3000:]


class Flood:
    """``count`` silent connections to a port, held open: each one the
    server closes is opened again at once (a flood that never lets up)."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count = port, count
        self.opened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, sel: selectors.DefaultSelector) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))
        sel.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for _ in range(self.count):
                self._open(sel)
            while not self.stop.is_set():
                for key, _ in sel.select(0.1):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    sel.unregister(s)
                    s.close()  # closed (or refused) by the server: again
                    self._open(sel)
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def test_the_features_environment_is_read_by_the_launcher_before_anything_starts(
    tmp_path: Path,
) -> None:
    """A bad ELASTRUN_* number refuses the launch (exit 2, the variable named,
    no worker run); torch's bad health check port is ignored with one warning."""
    script = tmp_path / "mark.py"
    script.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n")
    mark = tmp_path / "ran"

    def launch(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*ELASTRUN, "--standalone", "--no-warm", str(script), str(mark)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            env=env(**extra),
            cwd=REPO,
            check=False,
        )

    refused = launch(ELASTRUN_REPLICA_MAX_BYTES="\u00b2")
    assert refused.returncode == 2, refused.stderr
    assert "elastrun: error: ELASTRUN_REPLICA_MAX_BYTES: expected a positive" in refused.stderr
    assert not mark.exists()
    ran = launch(TORCHELASTIC_HEALTH_CHECK_PORT="http")
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.count("TORCHELASTIC_HEALTH_CHECK_PORT='http' is not a port") == 1
    assert mark.read_text() == "ran"


def test_health_check_port_answers_while_the_agent_runs(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, sys, time\n"
        "for _ in range(2400):\n"
        "    if os.path.exists(sys.argv[1]):\n"
        "        break\n"
        "    time.sleep(0.05)\n"
    )
    done = tmp_path / "done"
    agent = subprocess.Popen(
        [*ELASTRUN, "--standalone", str(script), str(done)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(TORCHELASTIC_HEALTH_CHECK_PORT=str(port)),
        cwd=REPO,
        start_new_session=True,
    )
    try:

        def probe(method: str = "GET", path: str = "/") -> dict[str, Any] | None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request(method, path)
                reply = conn.getresponse()
                body = reply.read()
                return {"status": reply.status, **(json.loads(body) if reply.status == 200 else {})}
            except OSError:
                return None
            finally:
                conn.close()

        got = wait_for(probe, 120, "the health check's answer")
        assert got["status"] == 200 and got["alive"] is True and got["timeout"] == 60
        # Loopback only by default (it was 0.0.0.0 and ::).
        assert listening(port) and listening(port) <= {"127.0.0.1", "::1"}, listening(port)
        # Only GET / is served (POST /shutdown and garbage were 200 OK).
        assert probe("POST", "/shutdown") == {"status": 404}
        assert probe("POST", "/") == {"status": 405}
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            raw.sendall(b"\x16\x03\x01garbage\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.0 400 ")
        # Probes are answered under a flood of 200 silent connections that
        # never lets up (0 of 30 were: 16 silent ones filled every place).
        with Flood(port, 200) as flood:
            answered = [probe() for _ in range(30)]
        assert [a and a["status"] for a in answered] == [200] * 30, flood.opened
        done.touch()
        _, err = agent.communicate(timeout=RUN_TIMEOUT)
        assert agent.returncode == 0, err[-3000:]
        assert probe() is None  # closed with the agent
    finally:
        stop_groups(agent)
