"""Real workers through the runner: a rank other than 0 that starts before
rank 0 forms the group as soon as rank 0's store listens
(``elastrun/worker/_master.py``), and the store is intact."""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO

pytest.importorskip("torch")

RUNNER = REPO / "src" / "elastrun" / "worker" / "_runner.py"
RUN_TIMEOUT = 60.0  # s for one worker (about 2 s on a loaded 2-core machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist

    rdzv = sys.modules["torch.distributed.rendezvous"]
    print("wrapped", getattr(rdzv._create_c10d_store, "_elastrun_wait", False), flush=True)
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    print("sum", int(t.item()), flush=True)
    dist.destroy_process_group()
    """
)


def test_real_workers_rank_1_first_form_the_group_through_the_runner(tmp_path: Path) -> None:
    """Real torch, real TCPStore: rank 1 starts before rank 0 exists; both
    run through the runner and all-reduce; the probes left the store intact."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = _free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    base.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", PYTHONPATH=str(REPO / "src"))

    def start(rank: int) -> subprocess.Popen[str]:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(rank)}
        return subprocess.Popen(
            [PYTHON, "-u", str(RUNNER), str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = start(1)
    assert first.stdout is not None
    try:
        assert first.stdout.readline().split() == ["wrapped", "True"]  # it is about to wait
        second = start(0)
        try:
            out0, _ = second.communicate(timeout=RUN_TIMEOUT)
        finally:
            second.kill()
        out1, _ = first.communicate(timeout=RUN_TIMEOUT)
    finally:
        first.kill()
    assert second.returncode == 0, out0
    assert first.returncode == 0, out1
    assert "sum 3" in out0 and "sum 3" in out1
