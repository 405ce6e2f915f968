"""Environment a script sets before it imports torch takes effect under
warm starts too: its workers start cold, and the agent says why in one line.

A real ``elastrun`` run, warm as by default in the tests' environment.
"""

from __future__ import annotations

from tests.helpers import WARM_ENV
from tests.integration.test_cli import elastrun, env_without_pet

SCRIPT = (
    "import os, sys\n"
    "warm = 'torch' in sys.modules\n"
    "os.environ['OMP_NUM_THREADS'] = '1'\n"
    "import torch\n"
    "print('RESULT', warm, torch.get_num_threads(), flush=True)\n"
)


def test_a_script_that_sets_omp_num_threads_before_torch_gets_it(tmp_path):
    (tmp_path / "threads.py").write_text(SCRIPT)
    # The agent's workers get 2 threads (the zygote imports torch with them);
    # the script asks for 1 before it imports torch.
    env = {**env_without_pet(), **WARM_ENV, "OMP_NUM_THREADS": "2"}
    proc = elastrun(
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "threads.py",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT False 1" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if "sets OMP_NUM_THREADS" in line]
    assert len(lines) == 1 and "before it imports torch" in lines[0] and "cold" in lines[0]
