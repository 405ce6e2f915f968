"""A job whose ranks all finished is reported as finished, even when its
script never destroys its gloo process group.

Such a script (like PyTorch's own ``test_script_init_method.py``: init, one
all-reduce, a print) could abort at exit ("terminate called without an active
exception", SIGABRT): the interpreter finalized while the group's worker
thread still held the all-reduce's tensors (see ``elastrun/worker/_settle.py``).
Measured with these tests on a loaded 2-core machine before the fix: 8 of 30
``--run-path`` runs and 8 of 30 ``launch()`` function runs failed (plain
scripts: 4 of 15; torchrun: 4 of 15 plain scripts, 0 of 15 ``--run-path``, its
function wrapper holding each finished worker a moment); after: 0 of 30 each.
Here each kind runs ``RUNS`` times under the real agent and every run must
finish with exit 0.

How many: a race that fails one run in four (as these did) is caught by a
series of 2 with probability 1 - 0.75**2 = 44 %, by 30 with 99.98 %. The
three series without destroy test one fix (``_settle.py``): its race goes
unseen by all three series of 2 with probability 0.75**6 = 18 %; the DDP
teardown's (3 of 12 warm runs) by its series of 2, whose first run (cold,
one rank) fills the module cache for the warm ones, with 0.75 = 75 %. ``make
test`` runs 2 (``ELASTRUN_SERIES_RUNS``): each run is a whole job (about 10 s
on a loaded 2-core machine), and the suite's time is bounded; ``make soak``
runs 30, as these series were measured with, and is the run that vouches for
the fixes.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import elastrun.worker
from tests.conftest import PYTHON, REPO

pytest.importorskip("torch")

RUNS = int(os.environ.get("ELASTRUN_SERIES_RUNS") or 2)
RUN_TIMEOUT = 90.0  # s for one run (about 3 s on a loaded 2-core machine): a hang
SERIES_TIMEOUT = RUNS * RUN_TIMEOUT + 60  # the test's own bound

# What torch's test_script_init_method.py does: no destroy_process_group().
NO_DESTROY = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.nn.functional.one_hot(torch.tensor(rank), num_classes=world)
    dist.all_reduce(t)
    derived = int(torch.sum(t).item())
    if derived != world:
        raise RuntimeError(f"wrong world size {derived}")
    print(f"rank {rank}: world size {derived} ok", flush=True)
    """
)

FUNCTION = textwrap.dedent(
    """
    import json, sys
    import elastrun

    def work():
        import torch
        import torch.distributed as dist
        dist.init_process_group(backend="gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.nn.functional.one_hot(torch.tensor(rank), num_classes=world)
        dist.all_reduce(t)
        print(f"rank {rank}: world size {int(t.sum())} ok", flush=True)
        return int(t.sum())

    if __name__ == "__main__":
        out = elastrun.launch(elastrun.LaunchConfig(nproc_per_node=2), work)
        print("LAUNCH " + json.dumps(out), flush=True)
    """
)


def _repeat(
    cmd: list[str],
    cwd: Path,
    ok: Callable[[str], bool],
    timeout: float = RUN_TIMEOUT,
    env: dict[str, str] | None = None,
    runs: range = range(1, RUNS + 1),
) -> list[str]:
    """Run ``cmd`` once per number in ``runs`` (RUNS times), each bounded by
    ``timeout``; the failures' output tails."""
    failures = []
    for run in runs:
        try:
            proc = subprocess.run(
                cmd,
                check=False,
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=timeout,
                start_new_session=True,
                env=env,
            )
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = f"timed out: {e.stdout!r} {e.stderr!r}", -1
        if rc != 0 or "terminate called" in out or not ok(out):
            failures.append(f"run {run}: exit {rc}\n{out[-1500:]}")
    return failures


def _both_ranks(out: str) -> bool:
    return "rank 0: world size 2 ok" in out and "rank 1: world size 2 ok" in out


def _check(failures: list[str], kind: str) -> None:
    print(f"{kind}: {len(failures)} of {RUNS} runs failed")
    assert not failures, f"{len(failures)} of {RUNS} {kind} runs failed:\n" + "\n".join(
        failures[:3]
    )


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_run_path_script_without_destroy_finishes_every_time(tmp_path: Path) -> None:
    (tmp_path / "no_destroy.py").write_text(NO_DESTROY)
    cmd = [PYTHON, "-m", "elastrun", "--standalone", "--nproc-per-node=2", "--run-path"]
    failures = _repeat([*cmd, "no_destroy.py"], tmp_path, _both_ranks)
    _check(failures, "--run-path")


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_function_entrypoint_without_destroy_finishes_every_time(tmp_path: Path) -> None:
    (tmp_path / "fn_job.py").write_text(FUNCTION)

    def ok(out: str) -> bool:
        return _both_ranks(out) and 'LAUNCH {"0": 2, "1": 2}' in out

    failures = _repeat([PYTHON, "fn_job.py"], tmp_path, ok)
    _check(failures, "launch() function")


RUNNER = Path(elastrun.worker.__file__).parent / "_runner.py"


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.skipif(
    not RUNNER.exists(),
    reason="plain scripts run as 'python -u script' until every Python worker starts "
    "through elastrun's worker runner, which then wraps the script in after_success()",
)
def test_plain_script_without_destroy_finishes_every_time(tmp_path: Path) -> None:
    (tmp_path / "no_destroy.py").write_text(NO_DESTROY)
    cmd = [PYTHON, "-m", "elastrun", "--standalone", "--nproc-per-node=2", "no_destroy.py"]
    failures = _repeat(cmd, tmp_path, _both_ranks)
    _check(failures, "plain script")


# -- what after_success does and does not do, in one real process each ---------

# Each mode's process is forked from one interpreter that imported
# torch.distributed (as elastrun's warm interpreter forks workers): one
# import of torch for the five, each mode still a process of its own that
# runs the script at its top level and ends as that script makes it end.
_OBSERVED = textwrap.dedent(
    """
    import atexit, os, sys
    import torch.distributed as dist
    from elastrun.worker._settle import after_success

    outdir = sys.argv[1]
    for mode in sys.argv[2:]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # this mode's process: the script below, then exit as it ends
            for fd, name in ((1, ".out"), (2, ".err")):
                path = os.path.join(outdir, mode + name)
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), fd)
            break
        _, status = os.waitpid(pid, 0)
        with open(os.path.join(outdir, mode + ".rc"), "w") as fp:
            fp.write(str(os.waitstatus_to_exitcode(status)))
    else:
        sys.exit(0)

    # registered first, so it runs last: after elastrun's settle
    atexit.register(lambda: print("FINAL initialized=" + str(dist.is_initialized()), flush=True))
    with after_success():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        # the script's own exit function still finds its group
        atexit.register(lambda: print("SCRIPT initialized=" + str(dist.is_initialized())))
        if mode == "exit0":
            sys.exit(0)
        if mode == "exit3":
            sys.exit(3)
        if mode == "raise":
            raise RuntimeError("the script failed")
        if mode == "destroyed":
            dist.destroy_process_group()
    """
)

# mode: (exit status, what the script's exit function sees, what is seen last)
_MODES = {
    "return": (0, "True", "False"),
    "exit0": (0, "True", "False"),
    "exit3": (3, "True", "True"),
    "raise": (1, "True", "True"),
    "destroyed": (0, "False", "False"),
}


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every mode of ``_OBSERVED`` run once, its exit status and output in the folder."""
    outdir = tmp_path_factory.mktemp("after_success")
    proc = subprocess.run(
        [PYTHON, "-c", _OBSERVED, str(outdir), *_MODES],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return outdir


@pytest.mark.parametrize("mode", list(_MODES))
def test_after_success_shuts_the_group_down_only_when_the_script_succeeded(
    observed: Path, mode: str
) -> None:
    rc, script_sees, final = _MODES[mode]
    stderr = (observed / f"{mode}.err").read_text()
    out = (observed / f"{mode}.out").read_text() + stderr
    assert int((observed / f"{mode}.rc").read_text()) == rc, out
    assert f"SCRIPT initialized={script_sees}" in out, out
    assert f"FINAL initialized={final}" in out, out
    assert "elastrun:" not in stderr, out  # nothing to report


def test_settle_without_torch_distributed_imports_nothing() -> None:
    code = (
        "import sys\n"
        "from elastrun.worker._settle import after_success, settle\n"
        "with after_success():\n"
        "    pass\n"
        "assert settle() is True\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


# The usual end of a DDP script: destroy_process_group(), then the model goes
# out of scope. With torch._dynamo imported before the process group, as a
# warm worker has it once the module cache knows the script, about one run in
# four of the benchmark's worker (DDP, an optimizer, a data loader, a
# checkpoint) hung for ever in the model's teardown: torch joins gloo's
# threads holding the GIL while one of them waits for it (see
# worker/_runner.py, pause_before_destroy). Measured before the fix with this
# series: 3 of 12 and 4 of 12 runs hung. (The benchmark, which ends every run of
# this worker warm, also counts such a hang as a failed run.)
BENCH_WORKER = REPO / "bench" / "bench_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_a_ddp_script_ending_with_destroy_never_hangs_warm(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ELASTRUN_CACHE_DIR": str(tmp_path / "cache"),  # one cache: runs 2.. are warm
        "BENCH_EVENTS": str(tmp_path / "events.jsonl"),
        "BENCH_DIR": str(tmp_path),
        "BENCH_TARGET_STEP": "10",
        "BENCH_STEP_INTERVAL": "0.02",
    }

    def cmd(nproc: int) -> list[str]:
        launch = [PYTHON, "-m", "elastrun", "--standalone", f"--nproc-per-node={nproc}", "--warm"]
        return [*launch, str(BENCH_WORKER)]

    def finished(_out: str) -> bool:
        (tmp_path / "ckpt.pt").unlink(missing_ok=True)  # the next run starts from step 0
        return True

    # A hang is for ever: the bound of the other series (a run took 25 s on
    # average on a 2-core machine at load 16, so 30 s failed runs that finished).
    # Run 1 starts cold and fills the module cache (torch._dynamo among the
    # script's imports): one rank records the same modules as two, without a
    # second cold rank importing them (seconds of CPU), and a cold run, which
    # imports torch._dynamo after the process group, is not the one that hung.
    # Runs 2..RUNS: two ranks, warm.
    failures = _repeat(cmd(1), tmp_path, finished, env=env, runs=range(1, 2))
    warm = range(2, max(RUNS, 2) + 1)
    failures += _repeat(cmd(2), tmp_path, finished, env=env, runs=warm)
    _check(failures, "DDP teardown")
