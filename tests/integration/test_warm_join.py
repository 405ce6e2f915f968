"""A node joining a running job waits for its warm interpreter first (bounded),
so the running nodes pause only for the restart, and a module list recorded
by one run makes the next run's first start warm.

Real agents on the embedded store (loopback), real gloo workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

from tests.helpers import WARM_ENV, free_port, plant_modules, stop_groups, wait_for
from tests.integration.test_cli import ELASTRUN, RUN_TIMEOUT, env_without_pet

# Steps every 0.1 s at whatever world size the round has, logging each step;
# all ranks stop together once the stop file exists.
TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    if os.environ.get("IMPORT_SLOW"):
        import slowmod
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = os.environ["STEPS"]
    while True:
        flag = torch.tensor([1.0 if os.path.exists(out + ".stop") else 0.0])
        dist.all_reduce(flag)
        line = json.dumps({"t": time.monotonic(), "rank": rank, "world": world,
                           "node": os.environ["NODE"], "pid": os.getpid()})
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, (line + "\\n").encode())
        os.close(fd)
        if flag.item() > 0:
            break
        time.sleep(0.1)
    dist.destroy_process_group()
    """
)


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _plant(cache_dir: Path, cwd: Path, modules: list[str]) -> None:
    """A module list for trainer.py as if an earlier run had recorded it."""
    plant_modules(cache_dir, cwd, "trainer.py", [], modules)


def _join(
    tmp_path: Path, slow_s: float, warm_join_timeout: float, via_note: bool = False
) -> dict[str, Any]:
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "slowmod.py").write_text(f"import time\ntime.sleep({slow_s})\n")
    steps = tmp_path / "steps.jsonl"
    port = free_port()
    common = [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=warm-join",
        "--max-restarts=0",
    ]
    base = {**env_without_pet(), **WARM_ENV, "STEPS": str(steps)}
    env_a = {**base, "NODE": "a", "ELASTRUN_CACHE_DIR": str(tmp_path / "cache-a")}
    env_b = {**base, "NODE": "b", "ELASTRUN_CACHE_DIR": str(tmp_path / "cache-b")}
    # A store with a token: only then does a node use the job's module note.
    token = tmp_path / "token"
    token.write_text("warm-join-token")
    token.chmod(0o600)  # a token file others can read is refused
    flags_a = [f"--rdzv-conf=is_host=1,last_call_timeout=1,token_file={token}"]
    if via_note:
        # Node a's worker imports slowmod and records it; node b, new to this
        # machine's cache, learns it from the job's note in the store.
        for env in (env_a, env_b):
            env.update(IMPORT_SLOW="1", ELASTRUN_MODULES_AFTER="1")
        flags_a.append("--warm-modules=all")
    else:
        # Node b's warm interpreter has a slow import to do before it is ready.
        _plant(tmp_path / "cache-b", tmp_path, ["torch", "slowmod"])
    events_b = tmp_path / "b.jsonl"

    def start(env: dict[str, str], *flags: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [ELASTRUN, *common, *flags, "trainer.py"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    procs = [start(env_a, *flags_a)]
    try:
        wait_for(lambda: any(s["world"] == 1 for s in _lines(steps)), 120, "a trains alone")
        if via_note:
            time.sleep(2)  # (node a records what its worker imported after 1 s)
        t_b = time.monotonic()
        procs.append(
            start(
                env_b,
                f"--rdzv-conf=is_host=0,last_call_timeout=1,token_file={token}",
                "--warm-modules=all",
                f"--warm-join-timeout={warm_join_timeout}",
                f"--events-file={events_b}",
            )
        )
        wait_for(
            lambda: {s["node"] for s in _lines(steps) if s["world"] == 2} == {"a", "b"},
            120,
            "world 2 on both nodes",
        )
        (tmp_path / "steps.jsonl.stop").touch()
        for p in procs:
            _, err = p.communicate(timeout=RUN_TIMEOUT)
            assert p.returncode == 0, err[-3000:]
        b_err = err
    finally:
        stop_groups(*procs)
    evs = [json.loads(x) for x in events_b.read_text().splitlines()]
    lines = _lines(steps)
    return {
        "events_b": evs,
        "t_b": t_b,
        "warm_join": [e for e in evs if e["kind"] == "warm_join"],
        "started": [e for e in evs if e["kind"] == "workers_started"],
        "last_world1_a": max(s["t"] for s in lines if s["world"] == 1 and s["node"] == "a"),
        "stderr_b": b_err,
    }


def test_a_joining_node_enters_the_round_once_its_workers_can_start_warm(tmp_path):
    got = _join(tmp_path, slow_s=4, warm_join_timeout=60)
    (wj,) = got["warm_join"]
    assert wj["ready"] is True and wj["waited_s"] >= 3
    assert "joining a running job: waiting up to 60s" in got["stderr_b"]
    # Node a trained on while node b imported: it paused only for the restart.
    assert got["last_world1_a"] >= got["t_b"] + 3
    assert got["started"][0]["warm"] == [True]


def test_a_node_new_to_the_job_learns_what_to_import_from_the_job(tmp_path):
    got = _join(tmp_path, slow_s=4, warm_join_timeout=60, via_note=True)
    learned = [e for e in got["events_b"] if e["kind"] == "modules_recorded"]
    assert learned and learned[0]["why"] == "job"
    (wj,) = got["warm_join"]
    assert wj["ready"] is True and wj["waited_s"] >= 3  # it imported slowmod first
    assert got["last_world1_a"] >= got["t_b"] + 3
    assert got["started"][0]["warm"] == [True]


def test_a_joining_node_whose_warm_interpreter_is_slow_joins_after_the_bound(tmp_path):
    got = _join(tmp_path, slow_s=120, warm_join_timeout=2)
    (wj,) = got["warm_join"]
    assert wj["ready"] is False and wj["waited_s"] >= 1.5  # it waited (its own measure)
    assert "not ready after 2s; joining anyway" in got["stderr_b"]
    # It joined without waiting for the slow import: its worker started cold,
    # while its warm interpreter was still importing (neither ready nor
    # discarded before the start).
    assert got["started"][0]["warm"] == [False]
    kinds = [e["kind"] for e in got["events_b"]]
    before = kinds[: kinds.index("workers_started")]
    assert "warm_started" in before
    assert "warm_ready" not in before and "warm_discarded" not in before


RECORDER = textwrap.dedent(
    """
    import os, sys
    seen = [m for m in ("email.mime.text", "xml.dom.minidom") if m in sys.modules]
    import torch
    import email.mime.text, xml.dom.minidom
    name = f"{os.environ['RUN']}-{os.environ['RANK']}"
    with open(os.path.join(os.environ["OUT"], name), "w") as f:
        f.write(",".join(seen))
    # The first optimizer step: the runner records what the worker imported.
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    w.sum().backward()
    opt.step()
    """
)


def test_the_module_list_survives_the_run_and_the_next_first_start_is_warm(tmp_path):
    (tmp_path / "rec.py").write_text(RECORDER)
    env = {
        **env_without_pet(),
        **WARM_ENV,
        "OUT": str(tmp_path),
        "ELASTRUN_CACHE_DIR": str(tmp_path / "cache"),
    }
    one_cpu = min(os.sched_getaffinity(0))
    for run in ("one", "two"):
        # On one CPU, 2 workers are more than the CPUs: a first start waits for
        # the zygote's imports (with CPUs to spare it forks at once, and the
        # workers import the rest in parallel).
        proc = subprocess.run(
            [ELASTRUN, "--standalone", "--nproc-per-node=2", "rec.py"],
            cwd=tmp_path,
            env={**env, "RUN": run},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
            preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    (cached,) = (tmp_path / "cache").glob("modules-*.json")
    modules = json.loads(cached.read_text())["modules"]
    assert {"email.mime.text", "torch.optim"} <= set(modules)  # (torch: always preloaded)
    assert "rec" not in modules and "__main__" not in modules  # never the script
    # First run: nothing recorded yet. Second run, first start: already imported.
    for rank in ("0", "1"):
        assert (tmp_path / f"one-{rank}").read_text() == ""
        assert (tmp_path / f"two-{rank}").read_text() == "email.mime.text,xml.dom.minidom"


def test_a_node_replacing_a_lost_one_waits_for_its_warm_interpreter_not_the_survivor(
    tmp_path: Path,
) -> None:
    """Node b's worker dies and its agent stops answering (SIGSTOP: its lease
    holds the survivor's round open); a replacement starts while that round
    is open. The survivor reaches the smallest world alone, so the
    replacement does not hold the survivor's restart for its imports: it
    waits for its warm interpreter first (here a slow import), then joins."""
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(3)\n")
    _plant(tmp_path / "cache-c", tmp_path, ["torch", "slowmod"])
    steps, events_a, events_c = (tmp_path / n for n in ("steps.jsonl", "a.jsonl", "c.jsonl"))
    port = free_port()
    base = {**env_without_pet(), **WARM_ENV, "STEPS": str(steps)}

    def start(name: str, *flags: str) -> subprocess.Popen[str]:
        env = {**base, "NODE": name, "ELASTRUN_CACHE_DIR": str(tmp_path / f"cache-{name}")}
        argv = [
            *("--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d"),
            *(f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=warm-replace"),
            "--max-restarts=3",
            *flags,
        ]
        return subprocess.Popen(
            [ELASTRUN, *argv, "trainer.py"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def opened() -> int:
        return sum(e["kind"] == "round_opened" for e in _lines(events_a))

    conf = "--rdzv-conf=is_host={},last_call_timeout=20,lease_ttl=30"
    procs = [start("a", conf.format(1), f"--events-file={events_a}")]
    try:
        procs.append(start("b", conf.format(0)))
        wait_for(
            lambda: {s["node"] for s in _lines(steps) if s["world"] == 2} == {"a", "b"},
            120,
            "world 2 on both nodes",
        )
        before = opened()
        (worker_b,) = {s["pid"] for s in _lines(steps) if s["node"] == "b"}
        os.kill(procs[1].pid, signal.SIGSTOP)  # node b's agent hangs
        os.kill(worker_b, signal.SIGKILL)
        wait_for(lambda: opened() > before, 60, "the survivor's round opened")
        procs.append(
            start(
                "c",
                conf.format(0),
                "--warm-modules=all",
                "--warm-join-timeout=60",
                f"--events-file={events_c}",
            )
        )
        wait_for(
            lambda: any(s["world"] == 2 and s["node"] == "c" for s in _lines(steps)),
            120,
            "the replacement trains",
        )
    finally:
        (tmp_path / "steps.jsonl.stop").touch()
        for p in (procs[0], procs[-1]):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=RUN_TIMEOUT)
        stop_groups(*procs)
    kinds = [e["kind"] for e in _lines(events_c)]
    (wj,) = [e for e in _lines(events_c) if e["kind"] == "warm_join"]
    assert wj["ready"] is True and wj["waited_s"] >= 2, wj  # it imported slowmod first
    assert kinds.index("warm_join") < kinds.index("node_joined"), kinds
