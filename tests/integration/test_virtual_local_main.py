"""--virtual-local-rank: every worker is LOCAL_RANK=0, and the node's real
local rank 0 is still the only one that does the node's one-per-node work
(worker/local_main.py). A real ``elastrun`` run, warm."""

from __future__ import annotations

from tests.helpers import WARM_ENV
from tests.integration.test_cli import elastrun, env_without_pet, results

SCRIPT = (
    "import os\n"
    "from elastrun.train import WorkerContext\n"
    "ctx = WorkerContext.from_env()\n"
    "print('RESULT', os.environ['RANK'], os.environ['LOCAL_RANK'], ctx.is_local_main, flush=True)\n"
)


def test_only_the_real_local_rank_0_is_the_local_main(tmp_path):
    (tmp_path / "who.py").write_text(SCRIPT)
    env = {**env_without_pet(), **WARM_ENV}
    proc = elastrun(
        "--standalone",
        "--nproc-per-node=3",
        "--virtual-local-rank",
        "who.py",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results(proc.stdout) == ["0 0 True", "1 0 False", "2 0 False"], proc.stdout
