"""The frameworks users run, under real ``elastrun`` agents (CPU, gloo, loopback).

* PyTorch Lightning ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``,
  standalone; and ``Trainer(num_nodes=2, devices=1)`` over 2 agents that meet
  on one c10d endpoint. Lightning must pick its ``TorchElasticEnvironment``
  (from the variables elastrun sets), see elastrun's ranks and world size, and
  start no processes of its own: the workers are exactly the pids elastrun's
  event log names, with no children.
* Hugging Face ``accelerate``: ``Accelerator()`` with ``ACCELERATE_USE_CPU=1``
  (what ``accelerate launch --cpu`` sets) trains as 2 processes with the data
  sharded, its loop in ``elastrun.train.in_process``: rank 1 is SIGKILLed once,
  rank 0's process is kept and enters the loop again; without
  ``ACCELERATE_USE_CPU``, on a machine with no accelerator, ``Accelerator()``
  runs each process on its own, exactly as under torchrun.
* Lightning with a worker SIGKILLed mid-epoch (the standalone job above): the
  job restarts once, its workers forked from per-rank warm interpreters (each
  imported Lightning with its rank's variables), and ``fit(ckpt_path="last")``
  resumes from ``last.ckpt``, ending at the right step and epoch with the
  weights of an undisturbed run; rank-zero-only logging is on rank 0 alone.

Every Lightning fit trains a linear model on random tensors, so its final
weights are known: ``reference_checksum`` replays the same steps in this
process. A resumed fit must end with them too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, needs, pid_alive, wait_for
from tests.integration.elastic_harness import ELASTRUN, SCRIPTS, Agent
from tests.integration.test_cli import env_without_pet

torch = pytest.importorskip("torch")
# Found, not imported here: the workers import Lightning, this process never does.
needs_lightning = needs("lightning")

BOUND = 150.0  # per job: a loaded 2-core machine; Lightning alone imports in 3-8 s
FEATURES = 8  # as the worker scripts
BATCH = 4
LR = 0.05


def reference_checksum(world: int, epochs: int, batches: int) -> float:
    """The sum of the weights after the Lightning script's fit, replayed in one
    process: Lightning shards the training set with torch's ``DistributedSampler``
    (shuffled, seed 0, ``set_epoch`` every epoch), and DDP's mean of the ranks'
    gradients is the gradient of the loss over all the ranks' batches."""
    from torch.utils.data import DistributedSampler, TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * BATCH * world, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    samplers: list[DistributedSampler[Any]] = [
        DistributedSampler(TensorDataset(x), num_replicas=world, rank=r, shuffle=True, seed=0)
        for r in range(world)
    ]
    for epoch in range(epochs):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for step in range(batches):
            index = [i for shard in shards for i in shard[step * BATCH : (step + 1) * BATCH]]
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
            optimizer.step()
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def started_pids(*paths: Path, restart: int = 0) -> list[int]:
    """The worker pids elastrun's event logs say it started for ``restart``."""
    return sorted(
        int(pid)
        for path in paths
        for e in events(path)
        if e["kind"] == "workers_started" and e["restart_count"] == restart
        for pid in e["pids"]
    )


class Jobs:
    """Agents started by one test; on exit every agent group and every worker
    pid their event logs name is SIGKILLed (workers lead their own sessions)."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.agents: list[Agent] = []

    def start(self, name: str, flags: list[str], script: str, args: list[str], **env: str) -> Agent:
        log_path = self.dir / f"agent-{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    *ELASTRUN,
                    *flags,
                    f"--events-file={self.events_file(name)}",
                    str(SCRIPTS / script),
                    str(self.out),
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env_without_pet(), "PYTHONUNBUFFERED": "1", **env},
                cwd=self.dir,
                start_new_session=True,
            )
        agent = Agent(name, proc, log_path)
        self.agents.append(agent)
        return agent

    def events_file(self, name: str) -> Path:
        return self.dir / f"events-{name}.jsonl"

    def records(self, pattern: str) -> dict[str, dict[str, Any]]:
        return {p.stem: json.loads(p.read_text()) for p in sorted(self.out.glob(pattern))}

    def steps(self) -> list[dict[str, Any]]:
        return events(self.out / "steps.jsonl")

    def cleanup(self) -> None:
        for agent in self.agents:
            agent.kill_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(10)
        for agent in self.agents:
            for e in events(self.events_file(agent.name)):
                for pid in e.get("pids", []) if e["kind"] == "workers_started" else []:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        j.cleanup()


def lightning_args(j: Jobs, *, epochs: int, batches: int, devices: int, nodes: int) -> list[str]:
    return [
        *("--root", str(j.dir / "root")),
        *("--epochs", str(epochs), "--batches", str(batches)),
        *("--devices", str(devices), "--num-nodes", str(nodes)),
    ]


def check_lightning_fit(
    fits: dict[str, dict[str, Any]],
    pids: list[int],
    *,
    world: int,
    nodes: int,
    epochs: int,
    batches: int,
) -> None:
    """Lightning saw elastrun's world, spawned nothing, and trained to the end."""
    assert len(fits) == world, fits
    assert sorted(f["pid"] for f in fits.values()) == pids, "Lightning ran outside elastrun's pids"
    expected = reference_checksum(world, epochs, batches)
    for f in fits.values():
        assert f["cluster_environment"] == "TorchElasticEnvironment", f
        assert f["creates_processes_externally"] is True
        assert f["launcher_spawned"] == 0 and f["children"] == [], f
        assert f["strategy"] == "DDPStrategy" and f["backend"] == "gloo"
        env = f["env"]
        assert f["global_rank"] == f["dist_rank"] == f["import_rank"] == int(env["RANK"])
        assert f["world_size"] == f["dist_world_size"] == int(env["WORLD_SIZE"]) == world
        assert f["local_rank"] == int(env["LOCAL_RANK"])
        assert f["node_rank"] == int(env["GROUP_RANK"])
        assert f["num_nodes"] == int(env["GROUP_WORLD_SIZE"]) == nodes
        assert f["num_devices"] == int(env["LOCAL_WORLD_SIZE"]) == world // nodes
        assert f["global_step"] == epochs * batches and f["current_epoch"] == epochs, f
        assert f["checksum"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        # Automatic progress: every optimizer step Lightning took was seen
        # through torch's hooks (a resumed fit counts its own steps only).
        steps = f["global_step"] - (f["start_step"] or 0)
        assert f["progress"]["steps"] == steps and f["progress"]["step_time"] > 0, f
    assert sorted(f["global_rank"] for f in fits.values()) == list(range(world))


@needs_lightning
def test_lightning_ddp_two_agents(tmp_path: Path) -> None:
    epochs, batches = 2, 4
    port = free_port()
    flags = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=lightning-two-agents",
    ]
    with jobs(tmp_path) as j:
        args = lightning_args(j, epochs=epochs, batches=batches, devices=1, nodes=2)
        agents = [j.start(name, flags, "lightning_fit.py", args) for name in ("a", "b")]
        for agent in agents:
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        fits = j.records("fit-*.json")
        pids = started_pids(j.events_file("a"), j.events_file("b"))
        check_lightning_fit(fits, pids, world=2, nodes=2, epochs=epochs, batches=batches)
        # One worker per agent: node ranks 0 and 1, each local rank 0.
        assert sorted(f["node_rank"] for f in fits.values()) == [0, 1]
        assert all(f["local_rank"] == 0 for f in fits.values())


@needs("accelerate")
@pytest.mark.parametrize("use_cpu", [True, False], ids=["ACCELERATE_USE_CPU=1", "plain"])
def test_accelerate_loop(tmp_path: Path, use_cpu: bool) -> None:
    if not use_cpu and torch.cuda.is_available():
        pytest.skip("Accelerator() picks the GPU here; this case is about CPU-only machines")
    epochs, steps_per_epoch = 2, 4
    env = {"ACCELERATE_USE_CPU": "1"} if use_cpu else {}
    # The distributed case also restarts in process: rank 1 SIGKILLed after its step 2.
    # No standby process (--standby-ranks=0): rank 1's replacement is forked from the
    # warm interpreter, as standbys are not this test's subject (test_in_process.py).
    restart = ["--max-restarts=1", "--standby-ranks=0"] if use_cpu else []
    in_process = ["--in-process", "--kill-at", "2"] if use_cpu else []
    with jobs(tmp_path) as j:
        agent = j.start(
            "a",
            ["--standalone", "--nproc-per-node=2", *restart],
            "accelerate_loop.py",
            ["--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch), *in_process],
            **env,
        )
        assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        runs = j.records("accelerate-*.json")
        pids = started_pids(j.events_file("a"), restart=1 if use_cpu else 0)
        assert sorted(r["pid"] for r in runs.values()) == pids
        for r in runs.values():
            assert r["children"] == [], r
            assert r["steps"] == epochs * steps_per_epoch  # the data set scales with the world
            # accelerate initialises torch.distributed from elastrun's variables either way.
            assert r["dist_world_size"] == 2 and r["dist_rank"] == int(r["env"]["RANK"])
        if use_cpu:
            for r in runs.values():
                assert r["distributed_type"] == "DistributedType.MULTI_CPU", r
                assert r["backend"] == "gloo" and r["model_class"] == "DistributedDataParallel"
                assert r["num_processes"] == 2
                assert r["process_index"] == int(r["env"]["RANK"])
                assert r["local_process_index"] == int(r["env"]["LOCAL_RANK"])
                assert r["is_main_process"] == (r["process_index"] == 0)
                assert len(r["gathered_losses"]) == 2
            assert sorted(r["process_index"] for r in runs.values()) == [0, 1]
            # In process: rank 0 kept its process (its second entry of the loop, after
            # accelerate's state was reset), rank 1's was replaced.
            evs = events(j.events_file("a"))
            kept = [(e["kept"], e["started"]) for e in evs if e["kind"] == "ranks_kept"]
            assert kept == [([0], [1])], evs
            first = started_pids(j.events_file("a"))
            assert runs["accelerate-r0"]["pid"] in first and runs["accelerate-r0"]["entries"] == 2
            assert runs["accelerate-r1"]["pid"] not in first
            assert runs["accelerate-r1"]["entries"] == 1
            # Gradients were averaged: the ranks, on different shards, end with equal weights.
            checksums = {r["checksum"] for r in runs.values()}
            assert len(checksums) == 1, checksums
        else:
            # No accelerator and no ACCELERATE_USE_CPU: accelerate trains each process
            # alone (torchrun gives the same); see docs/training.md, *Frameworks*.
            for r in runs.values():
                assert r["distributed_type"] == "DistributedType.NO", r
                assert r["num_processes"] == 1 and r["model_class"] == "Linear"


@needs_lightning
def test_lightning_resumes_from_last_checkpoint_in_per_rank_warm_interpreters(
    tmp_path: Path,
) -> None:
    """One standalone Lightning job, 2 ranks, whose rank 1 is SIGKILLed mid-epoch
    past the first epoch's checkpoint. Its first attempt starts from a fresh
    warm cache, so it teaches the agent what the script imports: Lightning reads
    RANK when it is imported, so the shared warm interpreter leaves it to
    per-rank ones, started with each local rank's variables. The restart forks
    each rank's worker from its rank's interpreter; ``fit(ckpt_path="last")``
    resumes from ``last.ckpt`` and ends at the right step and epoch with the
    weights of an undisturbed run; the script's rank-zero-only function (called
    before any Trainer resets the rank) logs on rank 0 alone, in both attempts."""
    epochs, batches = 2, 4
    hold_at = batches + 1  # mid-epoch 1, past the first epoch's checkpoint
    with jobs(tmp_path) as j:
        flags = [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--warm",
            f"--warm-cache={tmp_path / 'cache'}",
        ]
        args = lightning_args(j, epochs=epochs, batches=batches, devices=2, nodes=1)
        agent = j.start("a", flags, "lightning_fit.py", [*args, "--resume", f"--hold-at={hold_at}"])
        log = j.events_file("a")
        last = j.dir / "root" / "ckpt" / "last.ckpt"

        def per_rank_ready() -> bool:
            ready = {
                e["local_rank"]
                for e in events(log)
                if e["kind"] == "warm_ready" and e.get("local_rank") is not None
            }
            return ready >= {0, 1} or agent.proc.poll() is not None

        def held() -> bool:
            # Rank 1 stops after step hold_at (the first attempt) until it is killed.
            steps = [s["step"] for s in j.steps() if s["restart"] == 0 and s["rank"] == 1]
            return hold_at in steps or agent.proc.poll() is not None

        wait_for(per_rank_ready, 2 * BOUND, "a per-rank warm interpreter for each local rank", 0.2)
        wait_for(held, BOUND, f"rank 1 held after step {hold_at}", 0.1)
        assert agent.proc.poll() is None, agent.output()[-3000:]
        assert last.is_file(), "the first epoch's checkpoint is written before the kill"
        pids = started_pids(log)
        assert len(pids) == 2
        first = [s for s in j.steps() if s["restart"] == 0]
        # Every step of the first attempt ran in elastrun's two processes.
        assert {s["pid"] for s in first} == set(pids)
        victim = next(s["pid"] for s in first if s["rank"] == 1)
        killed_at = max(s["step"] for s in first if s["rank"] == 1)
        assert killed_at == hold_at and pid_alive(victim)
        os.kill(victim, signal.SIGKILL)

        assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        assert not any(pid_alive(p) for p in pids)

        # elastrun saw the kill as the root cause and restarted the group once.
        evs = events(log)
        root = [e for e in evs if e["kind"] == "worker_exited" and e["cause"] == "root_cause"]
        assert [(e["pid"], e["signal"]) for e in root] == [(victim, "SIGKILL")]
        restarts = [e for e in evs if e["kind"] == "restart"]
        assert [(e["reason"], e["count"]) for e in restarts] == [("worker_failed", 1)]
        # Lightning's SIGTERM handler let the surviving rank exit within the grace.
        assert not [e for e in evs if e["kind"] == "workers_killed"]

        # The restarted workers came from the per-rank interpreters, each its own rank's.
        per_rank = {
            e["pid"]: e["local_rank"]
            for e in evs
            if e["kind"] == "warm_started" and e.get("local_rank") is not None
        }
        again = started_pids(log, restart=1)
        used = [e for e in evs if e["kind"] == "warm_used" and e["pid"] in again]
        assert sorted(e["pid"] for e in used if e["per_rank"]) == again, used
        assert all(per_rank[e["zygote"]] == e["local_rank"] for e in used), (used, per_rank)
        assert not any(pid_alive(p) for p in again)

        # The killed attempt never finished; the restarted one resumed from last.ckpt.
        assert j.records("fit-*-a0.json") == {}
        fits = j.records("fit-*-a1.json")
        check_lightning_fit(fits, again, world=2, nodes=1, epochs=epochs, batches=batches)
        assert all(f["env"]["GROUP_RANK"] == "0" for f in fits.values())
        # Lightning's rank, read at import, is the worker's own in both attempts
        # (check_lightning_fit: import_rank == RANK), and rank-zero-only logs on rank 0.
        assert {k: (f["import_rank"], f["global_rank"]) for k, f in fits.items()} == {
            "fit-r0-a1": (0, 0),
            "fit-r1-a1": (1, 1),
        }
        zero = events(j.out / "rank-zero.jsonl")
        assert [(z["restart"], z["rank"]) for z in zero] == [(0, "0"), (1, "0")], zero
        assert zero[0]["pid"] in pids and zero[1]["pid"] == fits["fit-r0-a1"]["pid"]
        starts = {(f["start_step"], f["start_epoch"]) for f in fits.values()}
        assert len(starts) == 1, starts
        ((start_step, start_epoch),) = starts
        # An epoch-end checkpoint at or before the kill, not a fresh start.
        assert batches <= start_step <= killed_at and start_step % batches == 0, starts
        assert start_epoch == start_step // batches
        assert all(Path(f["ckpt_path"]).resolve() == last.resolve() for f in fits.values())

        # No step lost: the restarted ranks ran exactly the steps after the checkpoint,
        # in the two processes elastrun started for the restart.
        for rank in (0, 1):
            after = [s["step"] for s in j.steps() if s["restart"] == 1 and s["rank"] == rank]
            assert after == list(range(start_step + 1, epochs * batches + 1)), (rank, after)
        assert {s["pid"] for s in j.steps() if s["restart"] == 1} == set(again)
        assert last.is_file()
