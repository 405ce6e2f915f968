"""Conformance with PyTorch's own launcher tests, run against elastrun.

PyTorch tests torchrun in ``test/distributed/launcher/test_run.py`` (the CLI,
``torch.distributed.run.main([...])``), ``launch_test.py``
(``torch.distributed.launch``) and ``api_test.py`` (``elastic_launch``). Each
case here takes the facts of one of theirs (the arguments, exactly as they
spell them, and the outcome they expect) and runs a real ``elastrun`` (or
``elastrun.launch()``) with real workers. The workers (``scripts/conformance``)
are our own and do what upstream's ``bin/`` scripts do: check the worker
environment and touch a file named after the global rank, fail on ``--fail``,
check ``--local_rank``, form a process group with a given init method, report
``is_torchelastic_launched()``.

Upstream cases not here test torch's internals through mocks (an agent or
rendezvous handler patched to raise, ``_get_entrypoint_name``, the event
recorder) or devices this machine lacks (``--nproc-per-node=gpu|xpu`` with
torch's device counts patched); the deliberate differences are listed in
docs/cli.md ("Conformance with torchrun's tests"). torchrun's remaining flags
and LaunchConfig fields are in test_torchrun_flags.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher.devices import count_gpus, count_xpus
from elastrun.launcher.flag_grammar import parse_nnodes
from tests.conftest import REPO
from tests.helpers import free_port, stop_groups, without_pet
from tests.integration.elastic_harness import ELASTRUN
from tests.integration.scripts.conformance.batch import split
from tests.store.etcd_fixture import requires_etcd, start_cluster

BIN = Path(__file__).resolve().parent / "scripts" / "conformance"
TOUCH = str(BIN / "touch_rank.py")
TOUCH_SH = str(BIN / "touch_rank.sh")
RUN_TIMEOUT = 240


def env(**extra: str) -> dict[str, str]:
    """The launcher's environment: no PET_* leftovers, the sentinel upstream
    sets in the parent (the workers must see it), our sources first."""
    out = without_pet()
    out["TEST_SENTINEL_PARENT"] = "FOOBAR"
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO)]))
    out.update(extra)
    return out


def torchrun(
    *args: str, extra_env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """``elastrun ARGS`` (where upstream calls ``torch.distributed.run.main(ARGS)``)."""
    return subprocess.run(
        [*ELASTRUN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**(extra_env or {})),
        check=False,
        cwd=REPO,
    )


def start_elastrun(*args: str) -> subprocess.Popen[str]:
    """``elastrun ARGS`` started in its own process group (stop it with
    ``stop_groups``), its output piped."""
    return subprocess.Popen(
        [*ELASTRUN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=REPO,
        start_new_session=True,
    )


def ranks_touched(folder: Path) -> set[str]:
    return set(os.listdir(folder))


def expect_ranks(proc: subprocess.CompletedProcess[str], folder: Path, world: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ranks_touched(folder) == {str(i) for i in range(world)}, proc.stderr[-3000:]


def run_id() -> str:
    return str(uuid.uuid4().int)  # upstream's run ids


# ------------------------------------------------------------ test_run.py
def test_launch_user_script_python(tmp_path: Path) -> None:
    proc = torchrun(
        "--nnodes=1",
        "--nproc-per-node=4",
        f"--rdzv-id={run_id()}",
        "--monitor-interval=1",
        "--start-method=spawn",
        TOUCH,
        f"--touch-file-dir={tmp_path}",
    )
    expect_ranks(proc, tmp_path, 4)
    # upstream's script prints every variable it reads; the sentinel came through
    assert proc.stdout.count("TEST_SENTINEL_PARENT=FOOBAR") == 4


def test_launch_user_script_python_caffe2_bc(tmp_path: Path) -> None:
    proc = torchrun(
        "--nnodes=1",
        "--nproc-per-node=4",
        "--monitor-interval=1",
        "--start-method=spawn",
        "--master-addr=localhost",
        f"--master-port={free_port()}",
        "--node-rank=0",
        TOUCH,
        f"--touch-file-dir={tmp_path}",
    )
    expect_ranks(proc, tmp_path, 4)


@pytest.mark.parametrize("nproc", [["--nproc-per-node=4"], []], ids=["nproc4", "default_nproc"])
def test_launch_user_script_bash(tmp_path: Path, nproc: list[str]) -> None:
    args = ["--nnodes=1", *nproc, f"--rdzv-id={run_id()}", "--monitor-interval=1"]
    args += ["--start-method=spawn", "--no-python"]
    # --no-python cannot be used with --module (upstream: ValueError; here exit 2)
    bad = torchrun(*args, "--module", TOUCH_SH, str(tmp_path))
    assert bad.returncode == 2 and "--no-python" in bad.stderr and "--module" in bad.stderr
    assert "Traceback" not in bad.stderr
    proc = torchrun(*args, TOUCH_SH, str(tmp_path))
    expect_ranks(proc, tmp_path, 4 if nproc else 1)


def test_launch_with_env_vars(tmp_path: Path) -> None:
    pet = {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_RDZV_ID": run_id(),
        "PET_MONITOR_INTERVAL": "1",
        "PET_START_METHOD": "spawn",
        "PET_NO_PYTHON": "1",
    }
    bad = torchrun(TOUCH_SH, str(tmp_path), extra_env={**pet, "PET_MODULE": "1"})
    assert bad.returncode == 2 and "--module" in bad.stderr, bad.stderr
    proc = torchrun(TOUCH_SH, str(tmp_path), extra_env={**pet, "PET_MODULE": "0"})
    expect_ranks(proc, tmp_path, 4)


@pytest.mark.parametrize(
    ("nproc", "expected"),
    [("auto", len(os.sched_getaffinity(0))), ("4", 4)],
    ids=["auto_cpu", "number"],
)
def test_nproc_launch_configurations(tmp_path: Path, nproc: str, expected: int) -> None:
    # upstream patches torch.accelerator to "none" for auto
    if nproc == "auto" and (count_gpus() or count_xpus()):
        pytest.skip("auto counts this machine's GPUs")
    proc = torchrun(
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--rdzv-id={run_id()}",
        "--monitor-interval=1",
        "--start-method=spawn",
        "--no-python",
        TOUCH_SH,
        str(tmp_path),
    )
    expect_ranks(proc, tmp_path, expected)


@pytest.mark.parametrize(
    "nproc",
    [
        "unknown",
        pytest.param("gpu", marks=pytest.mark.skipif(count_gpus() > 0, reason="has a GPU")),
        pytest.param("xpu", marks=pytest.mark.skipif(count_xpus() > 0, reason="has an XPU")),
    ],
)
def test_nproc_launch_without_devices_is_an_error(tmp_path: Path, nproc: str) -> None:
    # upstream: ValueError for "unknown"; "gpu"/"xpu" without the device are
    # errors in torch too ("Cuda is not available.", "Xpu is not available.").
    # This machine has neither, so both are checked here as the refusal a
    # machine without them gets (the device counts are unit-tested).
    proc = torchrun(f"--nproc-per-node={nproc}", "--no-python", TOUCH_SH, str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "--nproc-per-node" in proc.stderr and "Traceback" not in proc.stderr
    if nproc != "unknown":
        assert f"'{nproc}'" in proc.stderr and "expected a number" not in proc.stderr
    assert not ranks_touched(tmp_path)


ELASTIC_CONF = ["join_timeout=5,last_call_timeout=1,timeout=5"]


def _elastic_args(conf: str, *rest: str) -> list[str]:
    return [
        "--nnodes=1:2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        f"--rdzv-conf={conf}",
        f"--rdzv-id={run_id()}",
        "--monitor-interval=1",
        *rest,
    ]


@pytest.mark.parametrize(
    "conf",
    [
        "'join_timeout=5,last_call_timeout=1,timeout=5'",
        "join_timeout=5,last_call_timeout=1,timeout=5",
    ],
    ids=["upstream_quoted", "unquoted"],
)
def test_launch_elastic(tmp_path: Path, conf: str) -> None:
    # upstream's list holds the quotes literally (no shell removes them)
    proc = torchrun(
        *_elastic_args(conf, "--start-method=spawn"), TOUCH, f"--touch-file-dir={tmp_path}"
    )
    expect_ranks(proc, tmp_path, 4)


@pytest.mark.parametrize(
    "conf",
    [
        "'join_timeout=5,last_call_timeout=1,timeout=5'",
        "join_timeout=5,last_call_timeout=1,timeout=5",
    ],
    ids=["upstream_quoted", "unquoted"],
)
def test_launch_elastic_worker_raise_exception(conf: str) -> None:
    # upstream: the launcher raises ChildFailedError; the CLI's equivalent is
    # a non-zero exit with the root cause named.
    proc = torchrun(
        *_elastic_args(conf, "--max-restarts=0", "--start-method=spawn"), TOUCH, "--fail"
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "ROOT CAUSE" in proc.stderr and "failing on purpose (--fail)" in proc.stderr


def test_launch_standalone(tmp_path: Path) -> None:
    proc = torchrun(
        "--nnodes=1",
        "--nproc-per-node=4",
        "--standalone",
        "--monitor-interval=1",
        "--start-method=spawn",
        TOUCH,
        f"--touch-file-dir={tmp_path}",
    )
    expect_ranks(proc, tmp_path, 4)


def test_launch_run_path(tmp_path: Path) -> None:
    proc = torchrun(
        "--run-path",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--monitor-interval=1",
        "--start-method=spawn",
        TOUCH,
        f"--touch-file-dir={tmp_path}",
    )
    expect_ranks(proc, tmp_path, 4)


def test_launch_elastic_multiple_agents(tmp_path: Path) -> None:
    args = [
        "--nnodes=1:2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        "--rdzv_conf=timeout=5",
        f"--rdzv-id={run_id()}",
        "--monitor-interval=1",
        "--start-method=spawn",
        TOUCH,
        f"--touch-file-dir={tmp_path}",
    ]
    other = start_elastrun(*args)
    try:
        proc = torchrun(*args)
        out, _ = other.communicate(timeout=RUN_TIMEOUT)
    finally:
        stop_groups(other)
    assert other.returncode == 0, out[-3000:]
    expect_ranks(proc, tmp_path, 8)


def test_min_max_nodes_parse() -> None:
    assert parse_nnodes("1") == (1, 1)
    assert parse_nnodes("2:20") == (2, 20)
    with pytest.raises(ConfigError, match="--nnodes"):
        parse_nnodes("2:20:30")


def _is_torchelastic(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    proc = torchrun(
        "--run-path",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--monitor-interval=1",
        *extra,
        str(BIN / "is_torchelastic.py"),
        f"--out-file={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == "True"
    return proc


def test_is_torchelastic_launched(tmp_path: Path) -> None:
    _is_torchelastic(tmp_path)


def test_is_torchelastic_launched_with_logs_spec_defined(tmp_path: Path) -> None:
    # upstream patches the entry points; torch 2.13 really ships "default"
    _is_torchelastic(tmp_path, "--logs_specs=default")


def test_logs_logs_spec_entrypoint_must_be_defined(tmp_path: Path) -> None:
    proc = torchrun(
        "--run-path",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--monitor-interval=1",
        "--logs_specs=DOESNOT_EXIST",
        str(BIN / "is_torchelastic.py"),
        f"--out-file={tmp_path / 'out'}",
    )
    assert proc.returncode == 2 and "--logs_specs" in proc.stderr and "DOESNOT_EXIST" in proc.stderr
    assert not (tmp_path / "out").exists()


ASK_TORCH = """
import os, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from is_torchelastic import is_torchelastic_launched as ours
seen = []
for run_id in (None, "x"):
    if run_id is not None:
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
    seen.append((dist.is_torchelastic_launched(), ours()))
print(seen)
"""


def test_is_not_torchelastic_launched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    clean = {k: v for k, v in env().items() if not k.startswith("TORCHELASTIC_")}
    subprocess.run(
        [sys.executable, str(BIN / "is_torchelastic.py"), f"--out-file={out}"],
        env=clean,
        timeout=RUN_TIMEOUT,
        check=True,
    )
    assert out.read_text() == "False"
    # the worker's answer is torch's own, without and with TORCHELASTIC_RUN_ID
    # (the launched cases above use the worker without importing torch)
    torch_says = subprocess.run(
        [sys.executable, "-c", ASK_TORCH, str(BIN)],
        env=clean,
        timeout=RUN_TIMEOUT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert torch_says.returncode == 0, torch_says.stderr[-3000:]
    assert torch_says.stdout.strip() == "[(False, False), (True, True)]", torch_says.stdout


@pytest.fixture(scope="module")
def init_methods() -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """upstream's two init-method cases in one launch (their arguments, as
    they spell them): the workers form the group with ``tcp://`` on the
    master port, then with ``env://`` (one ``import torch`` a worker for both)."""
    port = free_port()
    methods = {"tcp": f"tcp://localhost:{port}", "env": "env://"}
    proc = torchrun(
        "--run-path",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--master-addr=localhost",
        f"--master-port={port}",
        "--monitor-interval=1",
        str(BIN / "init_method.py"),
        *(f"--init-method={init}" for init in methods.values()),
    )
    return proc, methods


@pytest.mark.parametrize("method", ["tcp", "env"])
def test_init_method_with_torchelastic(
    init_methods: tuple[subprocess.CompletedProcess[str], dict[str, str]], method: str
) -> None:
    proc, methods = init_methods
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(f"{methods[method]} all-reduce ok") == 4, proc.stdout


def test_capture_logs_using_default_logs_specs(tmp_path: Path) -> None:
    proc = torchrun(
        "--nnodes=1",
        "--nproc-per-node=4",
        f"--rdzv-id={run_id()}",
        "--redirect=3",  # upstream's own spelling of --redirects
        "--tee=3",
        "--monitor-interval=1",
        "--start-method=spawn",
        "--no-python",
        TOUCH_SH,
        str(tmp_path),
        extra_env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "},
    )
    assert proc.returncode == 0, proc.stderr
    for i in range(4):
        assert f"[rank{i}]: creating " in proc.stdout, proc.stdout
    assert ": : " not in proc.stdout  # the template, exactly, once


# ------------------------------------------------------------ launch_test.py
def test_launch_without_env() -> None:
    """``python -m torch.distributed.launch`` without --use-env: the script
    gets --local_rank (``python -m elastrun.launch``)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastrun.launch",
            "--nnodes=1",
            "--nproc-per-node=4",
            "--monitor-interval=1",
            "--start-method=spawn",
            "--master-addr=localhost",
            f"--master-port={free_port()}",
            "--node-rank=0",
            str(BIN / "check_local_rank.py"),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 4


def test_launch_with_env(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastrun.launch",
            "--nnodes=1",
            "--nproc-per-node=4",
            "--monitor-interval=1",
            "--start-method=spawn",
            "--master-addr=localhost",
            f"--master-port={free_port()}",
            "--node-rank=0",
            "--use-env",
            TOUCH,
            f"--touch-file-dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env(),
        check=False,
    )
    expect_ranks(proc, tmp_path, 4)


# ------------------------------------------------------------ worker environment
def test_worker_environment_matches_torchrun_where_it_matters(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import json, os\n"
        "keys = ['TORCHELASTIC_USE_AGENT_STORE', 'TORCHELASTIC_SIGNALS_TO_HANDLE', "
        "'TORCH_NCCL_ASYNC_ERROR_HANDLING', 'TORCHELASTIC_RUN_ID', 'PYTHON_EXEC']\n"
        "print('ENV ' + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)\n"
    )
    proc = torchrun("--standalone", "--nproc-per-node=1", str(script))
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.split("ENV ", 1)[1].splitlines()[0])
    # torchrun's default, set the same way for the workers
    assert seen["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # a deliberate difference (docs/cli.md): no agent-hosted TCPStore, so the
    # workers' env:// rendezvous hosts its own (test_init_method_* proves it works)
    assert seen["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    proc = torchrun(
        "--standalone", "--nproc-per-node=1", "--signals-to-handle=SIGTERM,SIGUSR1", str(script)
    )
    seen = json.loads(proc.stdout.split("ENV ", 1)[1].splitlines()[0])
    assert seen["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"


# ------------------------------------------------------------ api_test.py
Case = tuple[str, Any, "Path | None"]


def launch_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """``elastrun.launch()`` calls, one per case, one after the other in one
    process of their own (see api_driver): one interpreter start and one
    ``import torch`` for all of them. Each case's JSON line, its ``stderr``
    added (the driver's stderr while that case ran)."""
    spec = json.dumps([[case, config, str(folder or "")] for case, config, folder in cases])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.scripts.conformance.api_driver", "--cases", spec],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT * len(cases),
        env=env(OMP_NUM_THREADS="1"),
        cwd=REPO,
        check=False,
    )
    said = f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    got = []
    for index, (out, err) in enumerate(split(proc.stdout, proc.stderr)):
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, f"case {index} ({cases[index][0]}): {said}"
        one: dict[str, Any] = json.loads(lines[-1])
        one["stderr"] = err
        got.append(one)
    assert len(got) == len(cases), said
    return got


@pytest.fixture(scope="module")
def etcd_endpoint() -> Any:
    cluster = start_cluster(1)
    try:
        yield cluster.endpoints
    finally:
        cluster.stop()


def etcd_config(endpoint: str, min_nodes: int, max_nodes: int, nproc: int, **kw: Any) -> Any:
    """upstream's get_test_launch_config (run_id "" unless given)."""
    return {
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "nproc_per_node": nproc,
        "run_id": kw.pop("run_id", ""),
        "rdzv_endpoint": endpoint,
        "monitor_interval": 0.1,
        "rdzv_backend": kw.pop("rdzv_backend", "etcd"),
        "start_method": "spawn",
        "max_restarts": 0,
        "rdzv_configs": kw.pop("rdzv_configs", {}),
    }


RUN_IDS = [pytest.param("", id="upstream_empty_run_id"), "conformance"]
# One node of min 1, max 2 starts once the last call ends (upstream: its
# default, 30 s, waited out). A second here: when the last call ends is the
# rendezvous' timer, checked in virtual time (tests/unit/test_rdzv_timers.py).
SHORT_LAST_CALL = {"last_call_timeout": 1}


EtcdCases = dict[tuple[str, str], tuple[dict[str, Any], Path]]


@pytest.fixture(scope="module")
def etcd_cases(etcd_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> EtcdCases:
    """upstream's single-node etcd cases (a script, a bash script, a function;
    elastic: a script, a failing script), each with both run ids: one launch
    each, one after the other in one driver process. Keyed by (case, run id):
    what came back and the case's folder."""
    # kind: (api_driver case, max nodes, rendezvous settings); min 1 node
    kinds: dict[str, tuple[str, int, dict[str, Any]]] = {
        "script": ("script", 1, {}),
        "bash": ("bash", 1, {}),
        "function": ("function", 1, {}),
        "elastic": ("script", 2, SHORT_LAST_CALL),
        "elastic_fail": ("fail", 2, SHORT_LAST_CALL),
    }
    keys: list[tuple[str, str]] = []
    folders: list[Path] = []
    cases: list[Case] = []
    for kind, (case, max_nodes, conf) in kinds.items():
        for rid in ("", "conformance"):
            rid_here = rid and f"{rid}-{uuid.uuid4().hex[:8]}"
            cfg = etcd_config(etcd_endpoint, 1, max_nodes, 4, run_id=rid_here, rdzv_configs=conf)
            keys.append((kind, rid))
            folders.append(tmp_path_factory.mktemp(f"{kind}-{rid or 'empty'}"))
            cases.append((case, cfg, folders[-1]))
    got = launch_cases(cases)
    return {key: (one, folder) for key, one, folder in zip(keys, got, folders, strict=True)}


@requires_etcd
@pytest.mark.etcd
@pytest.mark.parametrize("rid", RUN_IDS)
def test_api_launch_script_python(etcd_cases: EtcdCases, rid: str) -> None:
    got, folder = etcd_cases["script", rid]
    assert got.get("result") == 0, got
    assert ranks_touched(folder) == {"0", "1", "2", "3"}


@requires_etcd
@pytest.mark.etcd
@pytest.mark.parametrize("rid", RUN_IDS)
def test_api_launch_script_bash(etcd_cases: EtcdCases, rid: str) -> None:
    got, folder = etcd_cases["bash", rid]
    assert got.get("result") == 0, got
    assert ranks_touched(folder) == {"0", "1", "2", "3"}


@requires_etcd
@pytest.mark.etcd
@pytest.mark.parametrize("rid", RUN_IDS)
def test_api_launch_function(etcd_cases: EtcdCases, rid: str) -> None:
    got, _ = etcd_cases["function", rid]
    # upstream: sorted(res.values()) == [10, 11, 12, 13] (keys: global ranks)
    assert "result" in got, got
    assert sorted(got["result"].values()) == [10, 11, 12, 13], got
    assert sorted(got["result"]) == ["0", "1", "2", "3"]


def static_config(nproc: int, run_id: str = "") -> Any:
    return etcd_config(
        f"127.0.0.1:{free_port()}",
        1,
        1,
        nproc,
        run_id=run_id,
        rdzv_backend="static",
        rdzv_configs={"rank": 0},
    )


@pytest.fixture(scope="module")
def static_cases() -> dict[str, dict[str, Any]]:
    """upstream's function cases on the static rendezvous (tensors, a
    ``state_dict`` tree, an object refused; the rank sum with both run ids):
    one launch each, one after the other in one driver process (one
    ``import torch`` there for the tensors that come back). Keyed by case
    (``rank_sum:RUN_ID`` for the sums): what came back."""
    cases: dict[str, Case] = {
        "tensors": ("tensors", static_config(2), None),
        "state_dict": ("state_dict", static_config(2), None),
        "object": ("object", static_config(1), None),
    }
    for rid in ("", "conformance"):  # RUN_IDS
        cases[f"rank_sum:{rid}"] = ("rank_sum", static_config(4, run_id=rid), None)
    return dict(zip(cases, launch_cases(list(cases.values())), strict=True))


def test_api_launch_function_returning_tensors(static_cases: dict[str, dict[str, Any]]) -> None:
    # upstream's _dummy_compute returns a tensor: back as a tensor, per rank
    got = static_cases["tensors"]
    assert "result" in got, got
    ones = {"tensor": "Tensor", "dtype": "torch.float32"}
    assert got["result"] == {
        "0": {**ones, "values": [0.0] * 4},
        "1": {**ones, "values": [1.0] * 4},
    }, got


def test_api_launch_function_returning_a_state_dict_tree(
    static_cases: dict[str, dict[str, Any]],
) -> None:
    got = static_cases["state_dict"]
    assert "result" in got, got
    one = got["result"]["1"]
    assert one["model"]["w"]["values"] == [[1.0, 1.0], [1.0, 1.0]], got
    assert one["model"]["b"] == {"tensor": "Tensor", "dtype": "torch.int64", "values": [0, 1, 2]}
    assert one["step"] == 1
    assert one["history"][1:] == ["sgd", None, {"tuple": [1, 2.5]}], got
    assert one["history"][0]["values"] == [0.5]


def test_api_launch_function_returning_an_object_is_refused_saying_why(
    static_cases: dict[str, dict[str, Any]],
) -> None:
    # anything else would need pickle: refused in the worker, with its type
    got = static_cases["object"]
    assert got.get("error") == "WorkerError", got
    assert "neither JSON data nor a tree of tensors" in got["stderr"], got["stderr"][-3000:]
    assert "builtin_function_or_method" in got["stderr"] or "function" in got["stderr"]


@pytest.mark.parametrize("rid", RUN_IDS)
def test_api_launch_dist_sum_with_static_rdzv(
    static_cases: dict[str, dict[str, Any]], rid: str
) -> None:
    got = static_cases[f"rank_sum:{rid}"]
    assert "result" in got, got
    assert sorted(got["result"].values()) == [6, 6, 6, 6], got


@requires_etcd
@pytest.mark.etcd
@pytest.mark.parametrize("rid", RUN_IDS)
def test_api_launch_elastic(etcd_cases: EtcdCases, rid: str) -> None:
    # min 1, max 2, one node: it starts after the last call
    got, folder = etcd_cases["elastic", rid]
    assert got.get("result") == 0, got
    assert ranks_touched(folder) == {"0", "1", "2", "3"}


@requires_etcd
@pytest.mark.etcd
@pytest.mark.parametrize("rid", RUN_IDS)
def test_api_launch_elastic_worker_raise_exception(etcd_cases: EtcdCases, rid: str) -> None:
    # upstream: elastic_launch raises ChildFailedError; launch() with a command
    # returns the agent's exit code instead (docs/cli.md), with the summary.
    got, _ = etcd_cases["elastic_fail", rid]
    assert got.get("result") == 1, got
    assert "failing on purpose (--fail)" in got["stderr"]


@requires_etcd
@pytest.mark.etcd
def test_api_launch_elastic_multiple_agents(etcd_endpoint: str, tmp_path: Path) -> None:
    cfg = json.dumps(etcd_config(etcd_endpoint, 1, 2, 4, run_id=run_id()))
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.scripts.conformance.api_driver",
        "script",
        cfg,
        str(tmp_path),
    ]
    other = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO
    )
    try:
        mine = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            env=env(),
            cwd=REPO,
            check=False,
        )
        out, _ = other.communicate(timeout=RUN_TIMEOUT)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(10)
    assert other.returncode == 0 and mine.returncode == 0, out[-2000:] + mine.stderr[-2000:]
    assert ranks_touched(tmp_path) == {str(i) for i in range(8)}


def test_heterogeneous_roles_form_one_world(tmp_path: Path) -> None:
    """upstream (restated): one agent --role=master with 1 worker and one --role=trainer with 2
    form a world of 3, global ranks in group-rank order, role ranks within each role, each
    worker told its role and its node's process count."""
    port = free_port()

    def args(role: str, nproc: int, node_rank: int) -> list[str]:
        return [
            "--nnodes=2",
            f"--nproc-per-node={nproc}",
            f"--role={role}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=roles",
            f"--rdzv-conf=is_host={int(node_rank == 0)},join_timeout=120",
            f"--node-rank={node_rank}",  # the master node first
            "--monitor-interval=1",
            TOUCH,
            f"--touch-file-dir={tmp_path}",
        ]

    master = start_elastrun(*args("master", 1, 0))
    try:
        trainer = torchrun(*args("trainer", 2, 1))
        out, _ = master.communicate(timeout=RUN_TIMEOUT)
    finally:
        stop_groups(master)
    assert master.returncode == 0, out[-3000:]
    expect_ranks(trainer, tmp_path, 3)
    seen = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir()}
    names = "ROLE_NAME ROLE_RANK ROLE_WORLD_SIZE WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE"
    names += " LOCAL_WORLD_SIZE LOCAL_RANK"
    got = {rank: tuple(v[n] for n in names.split()) for rank, v in seen.items()}
    assert got == {
        0: ("master", "0", "1", "3", "0", "2", "1", "0"),
        1: ("trainer", "0", "2", "3", "1", "2", "2", "0"),
        2: ("trainer", "1", "2", "3", "1", "2", "2", "1"),
    }, seen
