"""The ``elastrun`` command as users run it: real processes, loopback only.

Bad flags exit 2 with a message naming the flag; good launches run real gloo
all-reduces (standalone, static two-node, c10d two-agent) and ``launch()``.
Every subprocess has a bounded timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import free_port, without_pet

ELASTRUN = str(Path(sys.executable).with_name("elastrun"))
BAD_TIMEOUT = 30
RUN_TIMEOUT = 180

ALL_REDUCE = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} "
          f"sum={int(t.item())} group={os.environ['GROUP_RANK']} args={sys.argv[1:]}", flush=True)
    dist.destroy_process_group()
    """
)


def env_without_pet() -> dict[str, str]:
    env = without_pet()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def elastrun(*args: str, cwd: Path, timeout: float = RUN_TIMEOUT, env=None):
    return subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        [ELASTRUN, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or env_without_pet(),
    )


def results(stdout: str) -> list[str]:
    return sorted(line.split("RESULT ", 1)[1] for line in stdout.splitlines() if "RESULT " in line)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "allreduce.py").write_text(ALL_REDUCE)
    (tmp_path / "train.py").write_text("print('train')\n")
    return tmp_path


# --------------------------------------------------------------- bad input
BAD = [
    (["--nnodes=3:1", "train.py"], "--nnodes", "larger than maximum"),
    (["--nnodes=0", "train.py"], "--nnodes", "at least 1"),
    (["--nproc-per-node=0", "train.py"], "--nproc-per-node", "at least 1"),
    (["--nproc_per_node=lots", "train.py"], "--nproc-per-node", "auto"),
    (["missing.py"], "script", "not found"),
    ([], "script", "missing"),
    (["--rdzv-conf=join_timeout", "train.py"], "--rdzv-conf", "key=value"),
    (["--rdzv-conf=join_timeout=abc", "train.py"], "--rdzv-conf", "number of seconds"),
    (["--rdzv-conf=joint_timeout=3", "train.py"], "--rdzv-conf", "known keys"),
    (["--rdzv-backend=zookeeper", "train.py"], "--rdzv-backend", "choose one of"),
    (["--rdzv-backend=static", "--nnodes=2", "train.py"], "--node-rank", "required"),
    (["--nnodes=2", "--node-rank=2", "train.py"], "--node-rank", "out of range"),
    (
        ["--rdzv-backend=c10d", "--rdzv-endpoint=host:port", "train.py"],
        "--rdzv-endpoint",
        "bad port",
    ),
    (["--signals-to-handle=SIGWHAT", "train.py"], "--signals-to-handle", "unknown signal"),
    (["--tee=9", "train.py"], "--tee", "0-3"),
    (["--bogus-flag", "train.py"], "unrecognized arguments", "--bogus-flag"),
]


@pytest.mark.parametrize(("args", "flag", "text"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_exits_2_naming_the_flag(workdir, args, flag, text):
    proc = elastrun(*args, cwd=workdir, timeout=BAD_TIMEOUT)
    assert proc.returncode == 2, proc.stderr
    assert f"elastrun: error: {flag}" in proc.stderr or flag in proc.stderr, proc.stderr
    assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_pet_environment_value_exits_2(workdir):
    env = env_without_pet() | {"PET_NNODES": "4:2"}
    proc = elastrun("train.py", cwd=workdir, timeout=BAD_TIMEOUT, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "--nnodes (from PET_NNODES): minimum 4 is larger than maximum 2" in proc.stderr


# Bad numbers to each command, as real processes: exit 2, one error line naming
# the flag or variable, no traceback, nothing started (tests/unit/test_bad_inputs.py
# runs the whole table in-process).
BAD_NUMBERS = [
    # '²'.isdigit() is True: this was a ValueError traceback, and a peer waited
    # join_timeout for the node that never came.
    ([], {"PET_RDZV_CONF": "store_max_connections_per_peer=\u00b2"}, "PET_RDZV_CONF"),
    ([], {"PET_NNODES": "\u0663"}, "PET_NNODES"),
    (["--nnodes=1:3", "--node-unit=4"], {}, "--nnodes=1:3"),
    (["store", "serve", "--port", "\u0663"], {}, "--port"),  # int('٣') == 3 served port 3
    (["store", "serve", "--port=0", "--max-data-bytes", "9" * 5000], {}, "--max-data-bytes"),
    (["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", "--timeout=inf"], {}, "--timeout"),
    (["status", "--rdzv-endpoint=" + "h" * 300, "--rdzv-id=j"], {}, "--rdzv-endpoint"),
    (["timeline", "train.py", "--out="], {}, "--out"),
]


@pytest.mark.parametrize(("args", "env", "named"), BAD_NUMBERS, ids=[b[2] for b in BAD_NUMBERS])
def test_bad_numbers_exit_2_naming_the_flag_or_variable(workdir, args, env, named):
    launch = not args or args[0] not in ("store", "status", "timeline")
    argv = [*args, "train.py"] if launch else args
    if launch:
        argv = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", *argv]
    proc = elastrun(*argv, cwd=workdir, timeout=BAD_TIMEOUT, env=env_without_pet() | env)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and len(errors[0]) < 600


def test_help_is_grouped_and_version(workdir):
    proc = elastrun("--help", cwd=workdir, timeout=BAD_TIMEOUT)
    assert proc.returncode == 0
    for group in ("rendezvous", "static rendezvous", "workers", "logs", "fault tolerance"):
        assert f"\n{group}" in proc.stdout, group
    for flag in ("--nproc-per-node", "--nproc_per_node", "--rdzv-conf", "--standalone", "-m"):
        assert flag in proc.stdout
    assert "etcd-v2" in proc.stdout and "etcd v3" in proc.stdout
    proc = elastrun("--version", cwd=workdir, timeout=BAD_TIMEOUT)
    assert proc.returncode == 0 and proc.stdout.startswith("elastrun ")


def test_unreachable_store_names_who_could_not_reach_whom(workdir):
    port = free_port()
    proc = elastrun(
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-conf=is_host=0,join_timeout=2",
        "allreduce.py",
        cwd=workdir,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"could not reach the rendezvous store at 127.0.0.1:{port}" in proc.stderr
    assert "is_host=0" in proc.stderr


def test_is_host_on_a_busy_port_says_so(workdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = elastrun(
            "--nnodes=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=is_host=1,join_timeout=2",
            "allreduce.py",
            cwd=workdir,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    assert "cannot host the store" in proc.stderr and "in use" in proc.stderr


# --------------------------------------------------------------- real launches
def test_static_single_node_all_reduce_with_script_args(workdir):
    proc = elastrun(
        f"--master-port={free_port()}",
        "--nproc-per-node=2",
        "allreduce.py",
        "--lr",
        "0.1",
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stderr
    assert results(proc.stdout) == [
        "rank=0 world=2 sum=3 group=0 args=['--lr', '0.1']",
        "rank=1 world=2 sum=3 group=0 args=['--lr', '0.1']",
    ]


def test_static_two_nodes_form_one_world_of_four(workdir):
    port = free_port()
    common = [
        "--rdzv-backend=static",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]
    procs = [
        subprocess.Popen(
            [ELASTRUN, *common, f"--node-rank={rank}", "allreduce.py"],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_without_pet(),
        )
        for rank in (1, 0)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=RUN_TIMEOUT)
            assert p.returncode == 0, err
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert results(outs[0]) == [
        "rank=2 world=4 sum=10 group=1 args=[]",
        "rank=3 world=4 sum=10 group=1 args=[]",
    ]
    assert results(outs[1]) == [
        "rank=0 world=4 sum=10 group=0 args=[]",
        "rank=1 world=4 sum=10 group=0 args=[]",
    ]


def test_standalone_two_workers_all_reduce(workdir):
    pytest.importorskip("elastrun.rendezvous.dynamic", reason="needs the dynamic rendezvous")
    proc = elastrun("--standalone", "--nproc-per-node=2", "allreduce.py", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert [r.split(" group")[0] for r in results(proc.stdout)] == [
        "rank=0 world=2 sum=3",
        "rank=1 world=2 sum=3",
    ]


def test_pet_environment_sets_flags(workdir):
    # what is checked is the number of workers: a script without torch (the
    # all-reduce itself is checked above)
    (workdir / "count.py").write_text("import os; print('RESULT rank', os.environ['RANK'])\n")
    env = env_without_pet() | {"PET_NPROC_PER_NODE": "2", "PET_MASTER_PORT": str(free_port())}
    proc = elastrun("count.py", cwd=workdir, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(results(proc.stdout)) == 2


def test_module_no_python_and_run_path(workdir):
    pkg = workdir / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(
        "import os, sys; print('RESULT mod', os.environ['RANK'], sys.argv[1:])\n"
    )
    (workdir / "job.sh").write_text("#!/bin/sh\necho RESULT sh $RANK $1\n")
    (workdir / "job.sh").chmod(0o755)
    port = str(free_port())
    proc = elastrun(f"--master-port={port}", "-m", "mypkg.job", "x", cwd=workdir)
    assert proc.returncode == 0 and results(proc.stdout) == ["mod 0 ['x']"], proc.stderr
    proc = elastrun(f"--master-port={port}", "--no-python", "./job.sh", "y", cwd=workdir)
    assert proc.returncode == 0 and results(proc.stdout) == ["sh 0 y"], proc.stderr
    (workdir / "rp.py").write_text("import sys; print('RESULT rp', __name__, sys.argv[1:])\n")
    proc = elastrun(f"--master-port={port}", "--run-path", "rp.py", "z", cwd=workdir)
    assert proc.returncode == 0 and results(proc.stdout) == ["rp __main__ ['z']"], proc.stderr


def test_failing_worker_gives_nonzero_exit(workdir):
    (workdir / "fail.py").write_text("import sys; sys.exit(3)\n")
    proc = elastrun(f"--master-port={free_port()}", "fail.py", cwd=workdir)
    assert proc.returncode != 0


def test_c10d_two_agents_one_hosts_the_store(workdir):
    pytest.importorskip("elastrun.rendezvous.dynamic", reason="needs the dynamic rendezvous")
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=cli-test",
        "--rdzv-conf=join_timeout=60,last_call_timeout=1",
        "allreduce.py",
    ]
    procs = [
        subprocess.Popen(
            [ELASTRUN, *common],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_without_pet(),
        )
        for _ in range(2)
    ]
    outs, errs = [], []
    try:
        for p in procs:
            out, err = p.communicate(timeout=RUN_TIMEOUT)
            assert p.returncode == 0, err
            outs.append(out)
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    hosts = [e for e in errs if "this node hosts the rendezvous store" in e]
    assert len(hosts) == 1, errs
    assert sorted(r.split(" group")[0] for o in outs for r in results(o)) == [
        "rank=0 world=2 sum=3",
        "rank=1 world=2 sum=3",
    ]


LAUNCH_FN = textwrap.dedent(
    """
    import json, os, sys
    import elastrun

    def work(x, scale=1):
        return {"rank": int(os.environ["RANK"]), "v": x * scale,
                "world": int(os.environ["WORLD_SIZE"])}

    if __name__ == "__main__":
        port = int(sys.argv[1])
        cfg = elastrun.LaunchConfig(nproc_per_node=2, master_port=port or None)
        out = elastrun.launch(cfg, work, 21, scale=2)
        print("LAUNCH " + json.dumps({str(k): v for k, v in sorted(out.items())}), flush=True)
        try:
            elastrun.launch(cfg, lambda: 1)
        except elastrun.ConfigError as e:
            print("LAMBDA " + str(e), flush=True)
    """
)


@pytest.mark.parametrize("mode", ["static", "standalone"])
def test_launch_function_returns_per_rank_results(workdir, mode):
    if mode == "standalone":
        pytest.importorskip("elastrun.rendezvous.dynamic", reason="needs the dynamic rendezvous")
    (workdir / "fn.py").write_text(LAUNCH_FN)
    port = free_port() if mode == "static" else 0
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        [sys.executable, "fn.py", str(port)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env_without_pet(),
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LAUNCH "))
    assert json.loads(line[len("LAUNCH ") :]) == {
        "0": {"rank": 0, "v": 42, "world": 2},
        "1": {"rank": 1, "v": 42, "world": 2},
    }
    assert "module-level function" in proc.stdout


def test_cli_main_programmatic(workdir):
    code = textwrap.dedent(
        f"""
        import sys
        from elastrun.launcher.cli import main
        sys.exit(main(["--master-port={free_port()}", "--nproc-per-node=1", "allreduce.py"]))
        """
    )
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        [sys.executable, "-c", code],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env_without_pet(),
    )
    assert proc.returncode == 0, proc.stderr
    assert results(proc.stdout) == ["rank=0 world=1 sum=1 group=0 args=[]"]
