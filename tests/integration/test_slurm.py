"""The SLURM recipe of docs/slurm.md, run on loopback with SLURM's variables set by the test.

The recipe is two files the doc quotes verbatim (checked here): ``deploy/slurm/train.sbatch``
(the batch script: ``srun`` one task per node, requeue 90 s before the time limit) and
``deploy/slurm/elastrun-node.sh`` (what ``srun`` runs on each node: one elastrun agent, the store
on the allocation's first node, the job id as run id).

* Two "nodes" on this machine: the node script runs twice, as ``srun`` would start it, with
  ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_NODEID``,
  ``SLURM_PROCID``... and the elastrun flags of the batch script's ``srun`` line (plus a CPU
  worker count and this test's worker). They meet, train at world 4, SIGUSR1 to the agents
  (SLURM's ``--signal=USR1@T``) reaches every worker without stopping it when
  ``--signals-to-handle`` lists it, and the job finishes.
* The batch script itself runs with stand-ins for ``srun`` and ``scontrol`` that record what
  they are asked: SIGUSR1 to the batch shell (``--signal=B:USR1@90``) makes it requeue the job,
  and it exits with srun's status once srun ends (as SLURM's SIGTERM at requeue ends it).

No SLURM here: ``scontrol`` (and ``srun`` in the second test) are tiny shell scripts on PATH.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.helpers import free_port, pid_alive, stop_groups, wait_for, without_pet

pytest.importorskip("torch")

SLURM = REPO / "deploy" / "slurm"
SBATCH = SLURM / "train.sbatch"
NODE_SCRIPT = SLURM / "elastrun-node.sh"
WORKER = REPO / "tests" / "integration" / "scripts" / "slurm_worker.py"
DOC = REPO / "docs" / "slurm.md"
BOUND = 90.0
JOB_ID = "4242"

FAKE_SCONTROL = """#!/bin/sh
# Stand-in for SLURM's scontrol: `show hostnames LIST` for a plain comma-separated list (SLURM
# also expands ranges such as node[1-4]); `requeue ID` is recorded, and the job's step (srun)
# gets SIGTERM, as SLURM does when it requeues a running job.
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' "$3" | tr ',' '\\n'; exit 0; fi
if [ "$1" = requeue ]; then
    echo "requeue $2" >> "$FAKE_SLURM_DIR/scontrol.log"
    kill -TERM "$(cat "$FAKE_SLURM_DIR/srun.pid")"
    exit 0
fi
echo "fake scontrol: unsupported: $*" >&2
exit 1
"""

FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: records its arguments, then runs until SIGTERM (exit 143), at most 120 s.
printf '%s\\n' "$@" > "$FAKE_SLURM_DIR/srun.args"
echo $$ > "$FAKE_SLURM_DIR/srun.pid"
trap 'exit 143' TERM
for _ in $(seq 1200); do sleep 0.1; done
exit 0
"""


def fake_bin(tmp: Path, *, srun: bool) -> Path:
    bin_dir = tmp / "fake-slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    programs = {"scontrol": FAKE_SCONTROL, **({"srun": FAKE_SRUN} if srun else {})}
    for name, text in programs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def srun_line() -> list[str]:
    """The batch script's srun command, as words (continuation lines joined, up to `&`)."""
    text = SBATCH.read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("srun "))
    words = shlex.split(line.split(" &")[0])
    assert words[0] == "srun"
    return words


def sbatch_elastrun_flags() -> list[str]:
    """The elastrun flags the batch script passes to the node script (before the script)."""
    words = srun_line()
    at = words.index("deploy/slurm/elastrun-node.sh")
    flags = []
    for w in words[at + 1 :]:
        if not w.startswith("--"):
            break
        flags.append(w)
    return flags


def slurm_env(tmp: Path, node: int, nodes: int, bin_dir: Path) -> dict[str, str]:
    """What srun sets for task `node` of a one-task-per-node step, on loopback."""
    env = without_pet(None, "SLURM")
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
        PYTHONUNBUFFERED="1",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOBID=JOB_ID,
        SLURM_JOB_NAME="elastrun-train",
        SLURM_JOB_NODELIST=",".join(f"127.0.0.{i + 1}" for i in range(nodes)),
        SLURM_NNODES=str(nodes),
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NTASKS=str(nodes),
        SLURM_NODEID=str(node),
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
        SLURMD_NODENAME=f"127.0.0.{node + 1}",
        SLURM_CPUS_PER_TASK="2",
        SLURM_SUBMIT_DIR=str(tmp),
        SLURM_TEST_DIR=str(tmp),
        FAKE_SLURM_DIR=str(tmp),
    )
    return env


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def test_doc_quotes_the_recipe_files_verbatim() -> None:
    doc = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", doc, re.S)
    for path in (SBATCH, NODE_SCRIPT):
        assert path.read_text(encoding="utf-8") in blocks, f"docs/slurm.md must quote {path.name}"
        assert f"deploy/slurm/{path.name}" in doc
    assert os.access(NODE_SCRIPT, os.X_OK), "srun runs the node script directly"
    for script in (SBATCH, NODE_SCRIPT):
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    assert "docs/slurm.md" in (REPO / "README.md").read_text(encoding="utf-8")


def test_sbatch_directives_one_agent_per_node_requeue_and_signal() -> None:
    directives = re.findall(r"^#SBATCH (\S+)", SBATCH.read_text(encoding="utf-8"), re.M)
    assert "--ntasks-per-node=1" in directives
    assert "--requeue" in directives
    assert "--signal=B:USR1@90" in directives
    words = srun_line()
    assert "--ntasks-per-node=1" in words and "--kill-on-bad-exit=0" in words
    flags = dict(f.split("=", 1) for f in sbatch_elastrun_flags())
    # The workers' SIGTERM grace fits in SLURM's default KillWait (30 s).
    assert float(flags["--shutdown-timeout"]) < 30
    assert int(flags["--max-restarts"]) >= 1


@pytest.mark.timeout(240)
def test_two_nodes_run_the_recipe_and_sigusr1_reaches_the_workers(tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path, srun=False)
    port = free_port()
    usr1 = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for node in (1, 0):  # the order nodes come up in does not matter
            env = slurm_env(tmp_path, node, 2, bin_dir)
            env["ELASTRUN_PORT"] = str(port)
            events = f"--events-file={tmp_path / f'events-node{node}.jsonl'}"
            argv = [
                str(NODE_SCRIPT),
                *sbatch_elastrun_flags(),
                "--nproc-per-node=2",  # CPU workers here instead of the recipe's `gpu`
                usr1,
                events,
                str(WORKER),
            ]
            log = tmp_path / f"node{node}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=REPO,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

        def steps() -> list[dict[str, Any]]:
            return read_jsonl(tmp_path / "steps.jsonl")

        def output() -> str:
            return "\n".join(p.read_text(errors="replace")[-3000:] for p in logs)

        wait_for(
            lambda: {s["rank"] for s in steps() if s["world"] == 4} == {0, 1, 2, 3},
            BOUND,
            "4 ranks training",
        )
        # SLURM's --signal=USR1@T (without B:) signals every task: each agent.
        for p in procs:
            os.kill(p.pid, signal.SIGUSR1)
        wait_for(
            lambda: {s["rank"] for s in steps() if s.get("usr1")} == {0, 1, 2, 3},
            BOUND,
            "SIGUSR1 at every worker",
        )
        mark = max(s["step"] for s in steps() if s.get("usr1"))
        wait_for(
            lambda: {s["rank"] for s in steps() if s["step"] > mark + 2} == {0, 1, 2, 3},
            BOUND,
            "training going on after SIGUSR1",
        )
        (tmp_path / "finish").write_text("")
        for p in procs:
            assert p.wait(BOUND) == 0, output()
    finally:
        stop_groups(*procs)
        for s in read_jsonl(tmp_path / "steps.jsonl"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(s["pid"]), signal.SIGKILL)

    records = steps()
    assert {s["run_id"] for s in records} == {JOB_ID}, "the run id is the SLURM job id"
    # Workers of each node see their node's SLURM variables; ranks 0-1 and 2-3 share a node.
    by_group = {s["group_rank"]: s["slurm_node"] for s in records}
    assert sorted(by_group) == [0, 1] and sorted(by_group.values()) == ["0", "1"]
    for node in (0, 1):
        evs = read_jsonl(tmp_path / f"events-node{node}.jsonl")
        started = next(e for e in evs if e["kind"] == "agent_started")
        assert (started["min_nodes"], started["max_nodes"]) == (2, 2)
        assert started["backend"] == "c10d"
        assert started["endpoint"] == f"127.0.0.1:{port}"
        assert started["max_restarts"] == 3  # from the batch script's srun line
        assert {e["run_id"] for e in evs} == {JOB_ID}
        assert [e["signal"] for e in evs if e["kind"] == "signal_forwarded"] == ["SIGUSR1"]
        assert len([e for e in evs if e["kind"] == "workers_started"]) == 1  # no restart
        assert evs[-1]["kind"] == "agent_exited" and evs[-1]["exit_code"] == 0
    assert not any(pid_alive(int(s["pid"])) for s in records)


@pytest.mark.timeout(120)
def test_batch_script_requeues_on_sigusr1_and_exits_with_srun(tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path, srun=True)
    env = slurm_env(tmp_path, 0, 4, bin_dir)
    batch = subprocess.Popen(
        ["bash", str(SBATCH)],
        cwd=REPO,  # sbatch runs the script in the submit directory: the repository root
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for((tmp_path / "srun.pid").exists, 30, "srun to start")
        time.sleep(0.2)  # the batch shell is now in `wait`
        os.kill(batch.pid, signal.SIGUSR1)  # --signal=B:USR1@90: the batch shell only
        out, _ = batch.communicate(timeout=60)
    finally:
        stop_groups(batch)
    text = out.decode(errors="replace")
    assert batch.returncode == 143, text  # srun's status: it ended on SLURM's SIGTERM
    assert f"requeueing job {JOB_ID}" in text
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == f"requeue {JOB_ID}"

    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[:4] == [
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--kill-on-bad-exit=0",
        "deploy/slurm/elastrun-node.sh",
    ], args
    script_at = args.index("examples/train.py")
    assert args[4:script_at] == sbatch_elastrun_flags()
    ckpt = tmp_path / "runs" / f"slurm-{JOB_ID}" / "checkpoints"
    assert f"--checkpoint-dir={ckpt}" in args[script_at:]
    # The training script's own flags are the example's.
    spec = importlib.util.spec_from_file_location("slurm_example", REPO / "examples/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ns = module.parse_args(args[script_at + 1 :])
    assert ns.checkpoint_dir == str(ckpt)
    # One worker per GPU, each on its own GPU: the script runs on CUDA, not 8 CPU workers.
    assert "--nproc-per-node=gpu" in args[4:script_at] and ns.device == "cuda"


@pytest.mark.timeout(240)
def test_the_recipe_with_a_hot_spare_replaces_a_lost_node(tmp_path: Path) -> None:
    """Three SLURM nodes with ELASTRUN_NNODES=2:3 ELASTRUN_NODE_UNIT=2: two train, one
    waits as a spare; a training node's agent SIGKILLed, the spare trains in its place."""
    bin_dir = fake_bin(tmp_path, srun=False)
    port = free_port()
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def events(node: int) -> list[dict[str, Any]]:
        return read_jsonl(tmp_path / f"events-node{node}.jsonl")

    def steps() -> list[dict[str, Any]]:
        return read_jsonl(tmp_path / "steps.jsonl")

    try:
        for node in range(3):
            env = slurm_env(tmp_path, node, 3, bin_dir)
            env.update(ELASTRUN_PORT=str(port), ELASTRUN_NNODES="2:3", ELASTRUN_NODE_UNIT="2")
            argv = [
                str(NODE_SCRIPT),
                *sbatch_elastrun_flags(),
                "--nproc-per-node=1",
                f"--events-file={tmp_path / f'events-node{node}.jsonl'}",
                str(WORKER),
            ]
            with open(tmp_path / f"node{node}.log", "wb") as out:
                procs[node] = subprocess.Popen(
                    argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            if node == 1:
                wait_for(lambda: any(s["world"] == 2 for s in steps()), BOUND, "world 2")
        wait_for(
            lambda: any(e["kind"] == "node_waiting" and e["spare"] for e in events(2)),
            BOUND,
            "the third node waiting as a spare",
        )
        by_node = {s["slurm_node"]: s["group_rank"] for s in steps()}
        assert sorted(by_node) == ["0", "1"], by_node
        old = {s["pid"] for s in steps()}  # the first workers (one may log a step more)
        os.kill(procs[1].pid, signal.SIGKILL)  # the agent: its guard takes its workers

        def after() -> dict[str, int]:
            """Who trains at world 2 now: the steps of the workers started since."""
            new = [s for s in steps() if s["pid"] not in old and s["world"] == 2]
            return {s["slurm_node"]: s["group_rank"] for s in new}

        wait_for(lambda: {"0", "2"} <= set(after()), BOUND, "the spare training at world 2")
        assert after() == {"0": by_node["0"], "2": by_node["1"]}, after()
        (tmp_path / "finish").write_text("")
        for node in (0, 2):
            assert procs[node].wait(BOUND) == 0, (tmp_path / f"node{node}.log").read_text()[-3000:]
    finally:
        stop_groups(*procs.values())
        for s in read_jsonl(tmp_path / "steps.jsonl"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(s["pid"]), signal.SIGKILL)
    started = next(e for e in events(2) if e["kind"] == "agent_started")
    assert (started["min_nodes"], started["max_nodes"], started["node_unit"]) == (2, 3, 2)
    assert [e["replaces"] for e in events(2) if e["kind"] == "spare_promoted"] == [
        next(e for e in events(1) if e["kind"] == "round_joined")["node_id"]
    ]
    wait_for(lambda: not any(pid_alive(int(s["pid"])) for s in steps()), BOUND, "workers gone")


def test_node_script_takes_the_node_list_from_elastrun_nodes_without_scontrol(
    tmp_path: Path,
) -> None:
    """In a container without the SLURM client: ELASTRUN_NODES (docs/slurm.md, pyxis) gives the
    node list, and the candidate hosts are its first three names; scontrol is not called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "elastrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    (bin_dir / "elastrun").chmod(0o755)
    env = slurm_env(tmp_path, 1, 4, bin_dir)  # no scontrol on this PATH
    env["ELASTRUN_NODES"] = "n1 n2 n3 n4"
    proc = subprocess.run(
        ["bash", str(NODE_SCRIPT), "train.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.splitlines()
    assert "--rdzv-endpoint=n1:29400,n2:29400,n3:29400" in words, words
    assert not (tmp_path / "scontrol.log").exists()
