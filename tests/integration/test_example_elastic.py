"""End to end, the example (examples/train.py): kills and joins do not change the result.

``examples/train.py`` trains for a few epochs twice, on loopback, with real
agents, real gloo workers and the embedded store:

* undisturbed: ``elastrun --standalone --nproc-per-node=2``, as ``examples/demo.py``
  runs it with its crash step past the end: the demo in which nothing fails, which
  must then say so and exit non-zero (the demo checks its own story);
* disturbed: agent A (2 workers, ``--nnodes=1:2``, c10d, its own checkpoint
  directory) trains; past its first checkpoints one of its workers is
  SIGKILLed mid-epoch, the group restarts and resumes from the newest
  checkpoint; then agent B (1 worker, an EMPTY checkpoint directory of its
  own: no shared filesystem) joins, gets the checkpoint by broadcast, and
  training continues at world 3 to the end (A's workers pause while B's agent
  starts, so that B joins a job that still trains, however slow the machine).

Both runs end at the same epoch with test accuracies within ``ACC_TOLERANCE``
of each other (the disturbed run trains its last epochs at a 1.5x larger global
batch, so the two trajectories differ: 0.9611 undisturbed, about 0.95 disturbed
depending on where the kill and the join land).
Only the kill counts as a restart (``restarts=1``), not the join.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.helpers import free_port, pid_alive
from tests.helpers import wait_for as _wait_for
from tests.integration.elastic_harness import ELASTRUN, Agent, Job, job

torch = pytest.importorskip("torch")

TRAIN = REPO / "examples" / "train.py"
DEMO = REPO / "examples" / "demo.py"
BOUND = 90.0  # per wait; generous for a loaded 2-core machine
EPOCHS = 3
ACC_TOLERANCE = 0.05
ACC_FLOOR = 0.90
STEP_DELAY = 0.15  # s per step, so the kill and the join land mid-training
# Same math in both runs (--step-delay, --log-every, --keep change no result); --keep 0
# keeps every checkpoint, so the one B received by broadcast is still there at the end.
TRAIN_ARGS = [
    *("--epochs", str(EPOCHS), "--seed", "0", "--checkpoint-every", "5"),
    *("--log-every", "1", "--keep", "0"),
]
FINAL = re.compile(r"final: epoch=(\d+) test_acc=([0-9.]+) world=(\d+) restarts=(\d+)")
STEP_LINE = re.compile(r"epoch (\d+) step (\d+) offset ")


def start(j: Job, name: str, flags: list[str], ckpt: Path, extra: list[str]) -> Agent:
    log_path = j.dir / f"agent-{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                *ELASTRUN,
                *flags,
                str(TRAIN),
                *TRAIN_ARGS,
                "--checkpoint-dir",
                str(ckpt),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
    agent = Agent(name, proc, log_path)
    j.agents.append(agent)
    return agent


def start_demo_without_a_failure(j: Job) -> tuple[Agent, Path]:
    """``examples/demo.py`` with its crash step past the end: an undisturbed
    ``--standalone --nproc-per-node=2`` run of the example (seed 0, the same
    math as ``TRAIN_ARGS``: --checkpoint-every and --log-every change no
    result), after which the demo must say that nothing failed; (the demo as
    an ``Agent``, its stderr)."""
    stderr = j.dir / "demo-ref.stderr"
    argv = [sys.executable, str(DEMO), "--run-dir", str(j.dir / "demo-ref")]
    argv += ["--epochs", str(EPOCHS), "--crash-at-step", "1000", "--no-memory"]
    log_path = j.dir / "agent-ref.log"
    with open(log_path, "wb") as log, open(stderr, "wb") as err:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=err,
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
    agent = Agent("ref", proc, log_path)
    j.agents.append(agent)
    return agent, stderr


def c10d_flags(port: int, name: str, j: Job, *, host: bool, nproc: int) -> list[str]:
    return [
        "--nnodes=1:2",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=example-e2e",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-{name}.jsonl'}",
    ]


def events(j: Job, name: str) -> list[dict[str, Any]]:
    path = j.dir / f"events-{name}.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def final(out: str) -> tuple[int, float, int, int]:
    found = FINAL.findall(out)
    assert len(found) == 1, f"expected one final line, got {found}:\n{out[-3000:]}"
    e, acc, w, r = found[0]
    return int(e), float(acc), int(w), int(r)


def kill_workers(j: Job, names: list[str]) -> None:
    """Workers run in their own sessions: SIGKILL every pid the event logs name."""
    for name in names:
        for ev in events(j, name):
            for pid in ev.get("pids", []) if ev["kind"] == "workers_started" else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def test_example_survives_worker_kill_and_join_with_the_same_result(tmp_path: Path) -> None:
    t_start = time.monotonic()
    timings: dict[str, float] = {}

    def wait_for(pred: Any, what: str) -> Any:
        return _wait_for(pred, BOUND, what, interval=0.2)  # steps take 0.15 s and more

    with job(tmp_path) as j:
        try:
            # The undisturbed run, beside the disturbed one (it needs no delays): the demo
            # in which nothing fails (its crash step is past the end), the same training.
            ref, ref_stderr = start_demo_without_a_failure(j)

            ckpt_a, ckpt_b = tmp_path / "ckpt-a", tmp_path / "ckpt-b"
            ckpt_b.mkdir()
            port = free_port()
            delay = ["--step-delay", str(STEP_DELAY)]
            a = start(j, "a", c10d_flags(port, "a", j, host=True, nproc=2), ckpt_a, delay)

            def a_step() -> tuple[int, int] | None:
                found = STEP_LINE.findall(a.output())
                return (int(found[-1][0]), int(found[-1][1])) if found else None

            # Past the epoch-0 checkpoint and the step-25 one, mid-epoch 1.
            wait_for(lambda: (s := a_step()) and s[1] >= 27, "agent A at step 27")
            assert sorted(p.name for p in ckpt_a.glob("ckpt-*.pt"))[-1] >= "ckpt-000000000025.pt"
            started = [e for e in events(j, "a") if e["kind"] == "workers_started"]
            assert len(started) == 1 and started[0]["restart_count"] == 0, started
            victim = int(started[0]["pids"][1])  # local rank 1 (rank 0 prints)
            assert pid_alive(victim)
            killed_at_step = a_step()
            mark = len(a.output())
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)

            resumed = re.compile(
                r"=> resumed: epoch=(\d+) offset=(\d+)/\d+ global_step=(\d+) "
                r"\(world 2, restart 1\)"
            )
            wait_for(lambda: resumed.search(a.output(), mark), "A's workers to resume")
            timings["kill -> resumed (checkpoint loaded)"] = time.monotonic() - t_kill
            mark = a.output().index("restart 1)", mark)
            wait_for(lambda: STEP_LINE.search(a.output(), mark), "a step after the restart")
            timings["kill -> first step after restart"] = time.monotonic() - t_kill
            res = resumed.search(a.output())
            assert res is not None
            resumed_from = (int(res[1]), int(res[2]), int(res[3]))

            # Node B joins, with an empty checkpoint directory. While its agent starts (its
            # warm interpreter imports torch: many seconds on a loaded machine), A's workers
            # are paused (SIGSTOP), so that the job still trains when B joins; they go on
            # (SIGCONT) once B's warm interpreter is ready, and B joins at once.
            paused = [
                int(pid)
                for e in events(j, "a")
                if e["kind"] == "workers_started" and e["restart_count"] == 1
                for pid in e["pids"]
            ]
            assert len(paused) == 2, paused
            mark_a, join_step = len(a.output()), a_step()
            t_join = time.monotonic()
            for pid in paused:
                os.kill(pid, signal.SIGSTOP)
            try:
                b = start(j, "b", c10d_flags(port, "b", j, host=False, nproc=1), ckpt_b, delay)
                wait_for(
                    lambda: any(e["kind"] == "warm_ready" for e in events(j, "b")),
                    "B's warm interpreter",
                )
            finally:
                for pid in paused:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)

            def both() -> str:  # what the job printed since B started
                return a.output()[mark_a:] + b.output()

            resumed3 = re.compile(r"global_step=(\d+) \(world 3, restart 1\)")
            wait_for(lambda: resumed3.search(both()), "resumed at world 3")
            timings["join -> resumed at world 3"] = time.monotonic() - t_join
            wait_for(
                lambda: STEP_LINE.search(both(), both().index("(world 3, restart 1)")),
                "a step at world 3",
            )
            timings["join -> first step at world 3"] = time.monotonic() - t_join
            res3 = resumed3.search(both())
            assert res3 is not None
            step3 = int(res3[1])
            assert "checkpoint broadcast size is" in both(), both()[-3000:]

            assert a.wait(BOUND) == 0, a.output()[-3000:]
            assert b.wait(BOUND) == 0, b.output()[-3000:]
            timings["total"] = time.monotonic() - t_start

            # The demo checks its own story: nothing failed, so it says so and exits non-zero.
            assert ref.wait(BOUND) != 0, ref.output()[-3000:]
            assert f"final: epoch={EPOCHS}" in ref.output()  # training itself went fine
            demo_err = ref_stderr.read_text()
            assert "did not go as expected: no worker failed" in demo_err, demo_err
            assert "elastrun did not restart the workers" in demo_err
            epoch0, acc0, world0, restarts0 = final(ref.output())
            epoch, acc, world, restarts = final(a.output() + b.output())
            print(f"undisturbed: epoch={epoch0} test_acc={acc0:.4f} world={world0}")
            print(
                f"disturbed:   epoch={epoch} test_acc={acc:.4f} world={world} restarts={restarts}"
            )
            print(
                f"killed at (epoch, step) {killed_at_step}; resumed (epoch, offset, step) "
                f"{resumed_from}; B joined at {join_step}"
            )
            for what, seconds in timings.items():
                print(f"{what}: {seconds:.1f}s")

            assert (epoch0, world0, restarts0) == (EPOCHS, 2, 0)
            assert (epoch, world, restarts) == (EPOCHS, 3, 1)
            assert acc0 >= ACC_FLOOR and acc >= ACC_FLOOR, (acc0, acc)
            assert abs(acc - acc0) <= ACC_TOLERANCE, (acc0, acc)

            # B, started empty, received A's checkpoint byte for byte ...
            steps_b = sorted(int(p.stem.split("-")[1]) for p in ckpt_b.glob("ckpt-*.pt"))
            assert steps_b and steps_b[0] == step3, (steps_b, step3)
            name = f"ckpt-{step3:012d}.pt"
            assert (ckpt_b / name).read_bytes() == (ckpt_a / name).read_bytes()
            # ... and saved the same state as A from then on.
            newest_a = sorted(ckpt_a.glob("ckpt-*.pt"))[-1]
            newest_b = sorted(ckpt_b.glob("ckpt-*.pt"))[-1]
            assert newest_a.name == newest_b.name
            sa = torch.load(newest_a, weights_only=True)
            sb = torch.load(newest_b, weights_only=True)
            assert sa["global_step"] == sb["global_step"] and sa["sampler"] == sb["sampler"]
            assert sa["sampler"]["epoch"] == EPOCHS
            assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
            print(
                f"newest checkpoints byte-equal: {newest_a.read_bytes() == newest_b.read_bytes()}"
            )
        finally:
            kill_workers(j, ["a", "b"])
    stray = [
        p
        for n in ("a", "b")
        for e in events(j, n)
        if e["kind"] == "workers_started"
        for p in e["pids"]
    ]
    assert not any(pid_alive(p) for p in stray), "a worker outlived its agent"


def load_example() -> Any:
    """examples/train.py as a module (its main, in this process)."""
    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_device_cuda_without_a_gpu_is_refused_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The GPU path cannot run on this machine: asking for it must say why, and
    # fail before any training, rather than train on the CPU or fail in NCCL.
    # The script's main in this process (torch is imported here already): the
    # message of the SystemExit is what Python prints on stderr, with exit code 1.
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda runs")
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    example = load_example()
    with pytest.raises(SystemExit) as exited:
        example.main(["--device", "cuda", "--epochs", "1"])
    message = exited.value.code
    assert isinstance(message, str)  # printed on stderr, exit code 1
    assert "--device cuda, but torch sees no GPU" in message, message
    assert "epoch" not in capsys.readouterr().out and not (tmp_path / "runs").exists()


def test_the_default_device_is_the_cpu_and_gloo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run without a launcher, with no --device: CPU and gloo, to the end.
    On the first 500 rows of the data (the test set, 360, and 140 to train
    on): what is asserted does not need the whole epoch. The script's main in
    this process (torch is imported here already), a world of one."""
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "digits.csv.gz"
    with gzip.open(REPO / "examples" / "data" / "digits.csv.gz", "rt") as full:
        rows = [line for line in full if line.strip()][:500]
    with gzip.open(data, "wt") as small:
        small.writelines(rows)
    example = load_example()
    try:
        code = example.main(["--epochs", "1", "--log-every", "0", "--data", str(data)])
    finally:
        if torch.distributed.is_initialized():  # it failed half-way: not left to other tests
            torch.distributed.destroy_process_group()
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "device cpu backend gloo" in out
    assert FINAL.search(out), out[-2000:]
