"""Migrating from ``python -m torch.distributed.launch``: real launches.

``python -m elastrun.launch`` runs scripts written for torch.distributed.launch
unchanged: each worker gets its local rank as an argument (``--local_rank=N``,
or ``--local-rank=N`` for a script that declares only that spelling) unless
``--use-env``/``--use_env`` is given. ``elastrun`` itself refuses
``--local-rank`` (it is a script argument) instead of taking it for a prefix
of ``--local-ranks-filter``, and never abbreviates a flag. ``${local_rank}`` in
script arguments becomes each worker's local rank, cold or from a warm interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.helpers import free_port, stop_groups, without_pet

TIMEOUT = 240
LAUNCH = [sys.executable, "-m", "elastrun.launch"]
ELASTRUN = [sys.executable, "-m", "elastrun"]

# A script as the torch.distributed.launch tutorials wrote them: the local
# rank comes from argparse (a string: no type given), the model trains with DDP.
SEED = textwrap.dedent(
    """
    import argparse, os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", default=-1)
    parser.add_argument("--steps", type=int, default=20)
    FLAGS = parser.parse_args()
    local_rank = FLAGS.local_rank

    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(64, 10, generator=g)
    y = x.sum(dim=1, keepdim=True)
    first = None
    for step in range(FLAGS.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    print("TRAINED " + json.dumps({
        "local_rank_arg": local_rank, "LOCAL_RANK": os.environ["LOCAL_RANK"],
        "rank": dist.get_rank(), "world": dist.get_world_size(),
        "first_loss": first, "last_loss": loss.item()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
).replace("import argparse, os", "import argparse, json, os")

# Argument checks only (no torch): what the script received.
ARGS = textwrap.dedent(
    """
    import argparse, json, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument({decl})
    parser.add_argument("--tag", default="")
    ns, rest = parser.parse_known_args() if {lenient} else (parser.parse_args(), [])
    print("ARGS " + json.dumps({{"argv": sys.argv[1:], "LOCAL_RANK": os.environ["LOCAL_RANK"],
                                "ns": vars(ns)}}), flush=True)
    """
)


def env() -> dict[str, str]:
    out = without_pet()
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO)]))
    return out


def run(cmd: list[str], cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env(), check=False
    )


def tagged(stdout: str, tag: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in stdout.splitlines():
        if tag + " " in line:
            out.append(json.loads(line.split(tag + " ", 1)[1]))
    return sorted(out, key=lambda d: str(d.get("rank", d.get("LOCAL_RANK"))))


def args_script(tmp_path: Path, decl: str, lenient: bool = False, name: str = "a.py") -> Path:
    path = tmp_path / name
    path.write_text(ARGS.format(decl=decl, lenient=lenient))
    return path


# ----------------------------------------------------------------- the seed script
@pytest.mark.parametrize("nproc", ["--nproc_per_node=2", "--nproc-per-node=2"])
def test_seed_script_trains_unchanged_under_elastrun_launch(tmp_path: Path, nproc: str) -> None:
    (tmp_path / "ddp.py").write_text(SEED)
    proc = run([*LAUNCH, nproc, "ddp.py", "--steps", "20"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = tagged(proc.stdout, "TRAINED")
    assert [d["rank"] for d in done] == [0, 1] and {d["world"] for d in done} == {2}
    for d in done:
        # the argument arrived (as a string: the seed gives no type) and matches LOCAL_RANK
        assert d["local_rank_arg"] == d["LOCAL_RANK"] == str(d["rank"])
        assert d["last_loss"] < d["first_loss"] / 2, d  # it really trained
    assert "--local_rank=<local rank>" in proc.stderr  # said once, what it passes


def test_seed_script_two_static_nodes_with_master_flags(tmp_path: Path) -> None:
    """torch.distributed.launch's multi-node form: --nnodes, --node_rank,
    --master_addr, --master_port (static rendezvous), one launcher per node."""
    (tmp_path / "ddp.py").write_text(SEED)
    port = free_port()

    def node(rank: int) -> list[str]:
        return [
            *LAUNCH,
            "--nnodes=2",
            f"--node_rank={rank}",
            "--nproc_per_node",
            "1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "ddp.py",
            "--steps=5",
        ]

    other = subprocess.Popen(
        node(1),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        start_new_session=True,
    )
    try:
        mine = run(node(0), tmp_path)
        out, err = other.communicate(timeout=TIMEOUT)
    finally:
        stop_groups(other)
    assert mine.returncode == 0 and other.returncode == 0, mine.stderr[-2000:] + err[-2000:]
    done = tagged(mine.stdout + out, "TRAINED")
    assert [(d["rank"], d["world"], d["local_rank_arg"]) for d in done] == [
        (0, 2, "0"),
        (1, 2, "0"),
    ]


@pytest.mark.parametrize("flag", ["--use_env", "--use-env"])
def test_use_env_passes_no_argument(tmp_path: Path, flag: str) -> None:
    script = args_script(tmp_path, '"--unused", default=None')
    proc = run([*LAUNCH, "--nproc_per_node=2", flag, str(script), "--tag=x"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = tagged(proc.stdout, "ARGS")
    assert [s["argv"] for s in seen] == [["--tag=x"], ["--tag=x"]]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert "each worker gets" not in proc.stderr


# ----------------------------------------------------------------- which spelling
@pytest.mark.parametrize(
    ("decl", "style", "passed"),
    [
        ('"--local_rank", type=int', "auto", "--local_rank"),  # torch 1.x scripts
        ('"--local-rank", type=int', "auto", "--local-rank"),  # torch 2.x scripts
        ('"--local-rank", "--local_rank", type=int', "auto", "--local_rank"),  # both
        ('"--local_rank", type=int', "dash", "--local-rank"),  # forced
    ],
    ids=["underscore", "dash", "both", "forced_dash"],
)
def test_local_rank_spelling(tmp_path: Path, decl: str, style: str, passed: str) -> None:
    script = args_script(tmp_path, decl, lenient=style == "dash" and "local_rank" in decl)
    cmd = [*LAUNCH, "--nproc-per-node=2", f"--local-rank-style={style}", str(script), "--tag=t"]
    proc = run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = tagged(proc.stdout, "ARGS")
    assert [s["argv"] for s in seen] == [[f"{passed}=0", "--tag=t"], [f"{passed}=1", "--tag=t"]]


def test_wrong_forced_spelling_fails_like_the_script_would(tmp_path: Path) -> None:
    script = args_script(tmp_path, '"--local-rank", type=int')
    proc = run([*LAUNCH, "--local-rank-style=underscore", str(script)], tmp_path)
    assert proc.returncode == 1
    assert "unrecognized arguments: --local_rank=0" in proc.stderr


def test_module_entry_point_gets_the_argument(tmp_path: Path) -> None:
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    args_script(pkg, '"--local-rank", type=int', name="__main__.py")
    proc = run([*LAUNCH, "--nproc-per-node=2", "-m", "trainer"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [s["argv"] for s in tagged(proc.stdout, "ARGS")] == [
        ["--local-rank=0"],
        ["--local-rank=1"],
    ]


def test_no_python_needs_use_env(tmp_path: Path) -> None:
    proc = run([*LAUNCH, "--no-python", "true"], tmp_path)
    assert proc.returncode == 2 and "--no-python" in proc.stderr and "--use-env" in proc.stderr
    proc = run([*LAUNCH, "--no-python", "--use-env", "true"], tmp_path)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------- elastrun itself
@pytest.mark.parametrize(
    "args",
    [["--local-rank=0"], ["--local_rank", "0"], ["--local-rank", "1"]],
    ids=["dash_eq", "underscore", "dash"],
)
def test_elastrun_refuses_local_rank_instead_of_guessing(tmp_path: Path, args: list[str]) -> None:
    script = args_script(tmp_path, '"--x"')
    proc = run([*ELASTRUN, "--nproc-per-node=2", *args, str(script)], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    name = args[0].split("=")[0]
    assert f"elastrun: error: {name}: not an elastrun flag" in proc.stderr
    assert "LOCAL_RANK" in proc.stderr and "elastrun.launch" in proc.stderr
    assert "ARGS" not in proc.stdout  # nothing ran (not taken as --local-ranks-filter)


@pytest.mark.parametrize(
    ("flag", "suggestion"),
    [("--nproc=2", "--nproc-per-node"), ("--max_restart=1", "--max_restarts")],
)
def test_elastrun_does_not_abbreviate_flags(tmp_path: Path, flag: str, suggestion: str) -> None:
    script = args_script(tmp_path, '"--x"')
    proc = run([*ELASTRUN, flag, str(script)], tmp_path)
    assert proc.returncode == 2
    assert f"did you mean {suggestion}?" in proc.stderr and "ARGS" not in proc.stdout


def test_use_env_to_elastrun_explains(tmp_path: Path) -> None:
    script = args_script(tmp_path, '"--x"')
    proc = run([*ELASTRUN, "--use_env", str(script)], tmp_path)
    assert proc.returncode == 2 and "--use_env: not an elastrun flag" in proc.stderr


def test_local_rank_after_the_script_is_the_scripts(tmp_path: Path) -> None:
    script = args_script(tmp_path, '"--local-rank", type=int')
    proc = run([*ELASTRUN, str(script), "--local-rank=7"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert tagged(proc.stdout, "ARGS")[0]["ns"]["local_rank"] == 7


# ----------------------------------------------------------------- ${local_rank}
def test_local_rank_macro_cold_and_from_warm_interpreters(tmp_path: Path) -> None:
    """``${local_rank}`` in a script argument is each worker's local rank, for
    cold workers and for warm interpreters (a restart of a script importing torch
    takes them). The first attempt fails on rank 1, the second succeeds."""
    (tmp_path / "m.py").write_text(
        textwrap.dedent(
            """
            import json, os, sys, time
            import torch  # so that a restart takes the warm interpreters
            attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
            seen = {"argv": sys.argv[1:], "LOCAL_RANK": os.environ["LOCAL_RANK"]}
            print("ARGS " + json.dumps({**seen, "attempt": attempt}), flush=True)
            open(f"printed-{os.environ['LOCAL_RANK']}-{attempt}", "w").close()
            if attempt == "0" and os.environ["LOCAL_RANK"] == "1":
                for _ in range(1200):  # rank 0 printed before the group fails
                    if os.path.exists("printed-0-0"):
                        break
                    time.sleep(0.05)
                sys.exit(3)
            """
        )
    )
    events = tmp_path / "events.jsonl"
    proc = run(
        [
            *ELASTRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--warm",
            "--max-restarts=1",
            f"--events-file={events}",
            "m.py",
            "--out=part-${local_rank}.txt",
            "plain$$text",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = tagged(proc.stdout, "ARGS")
    assert len(seen) == 4
    for s in seen:
        assert s["argv"] == [f"--out=part-{s['LOCAL_RANK']}.txt", "plain$$text"], s
    started = [
        e
        for e in map(json.loads, events.read_text().splitlines())
        if e["kind"] == "workers_started"
    ]
    assert len(started) == 2 and started[1]["warm"] == [True, True], started


def test_python_api_survives_importing_the_module(tmp_path: Path) -> None:
    code = (
        "import elastrun, elastrun.launch\n"
        "assert callable(elastrun.launch)\n"
        "from elastrun import launch\n"
        "print('CODE', launch(elastrun.LaunchConfig(nproc_per_node=2), 'true'))\n"
    )
    proc = run([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "CODE 0" in proc.stdout
