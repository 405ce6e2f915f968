"""In-process restarts with a real agent and real torch workers (gloo on CPU).

examples/train.py --in-process --setup-seconds: three ranks, one SIGKILLed at
step 10 (its process is replaced), then one raising at step 20 (its process
is replaced too: an exception of its own makes it suspect). The survivors'
processes are kept: their pids never change, their setup is not done again
(``setup done`` is printed once per process), and the training resumes from
the memory checkpoint of the step it was at (no step redone). With a standby
rank, a SIGKILLed rank is served by the standby's process instead.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrun.status.timeline import load_events, render_html
from tests.helpers import OPTIMIZER_MODULES, finished, plant_modules, stop_groups, wait_for
from tests.integration.elastic_harness import SCRIPTS
from tests.integration.test_status import status

pytest.importorskip("torch")

BOUND = 240.0
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_env(folder: Path, faults: list[dict[str, Any]], steps: int) -> dict[str, str]:
    """The environment of scripts/inproc_worker.py: ``faults[n]`` in its run of
    restart count n."""
    plan = json.dumps(faults)
    return {
        **os.environ,
        "ELASTIC_TEST_DIR": str(folder),
        "INPROC_PLAN": plan,
        "INPROC_STEPS": str(steps),
    }


def run_job(log: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    """elastrun on one node of 3 ranks with ``args`` (its flags, the script and
    the script's), to its end: its output (the job must succeed)."""
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--standalone",
        "--nproc-per-node=3",
        f"--events-file={log}",
        *args,
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    return finished(proc, BOUND)


def test_example_keeps_the_survivors_processes(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    args = [
        "--max-restarts=2",
        "--standby-ranks=0",  # replaced ranks start as new processes (standbys: below)
        str(EXAMPLE),
        "--epochs=2",
        "--in-process",
        "--setup-seconds=0.01",  # (what is asserted: its line, once per process)
        "--memory-checkpoint",
        f"--checkpoint-dir={tmp_path / 'ckpt'}",
        "--crash-at-step=10",
        "--crash-how=sigkill",
        "--raise-at-step=20",
        "--log-every=5",
    ]
    # As on a machine where the job ran before: its 3 workers (more than the 2
    # CPUs) are forked once the warm interpreter imported what they import.
    cache = tmp_path / "cache"
    plant_modules(cache, os.getcwd(), str(EXAMPLE), args[3:], OPTIMIZER_MODULES)
    text = run_job(log, args, {**os.environ, "ELASTRUN_CACHE_DIR": str(cache)})
    assert "final: epoch=2" in text

    evs = events(log)
    started = [e for e in evs if e["kind"] == "workers_started"]
    assert [e["round"] for e in started] == [0, 1, 2]
    pids = [dict(zip(e["ranks"], e["pids"], strict=True)) for e in started]
    # Round 1: rank 2 was SIGKILLed, ranks 0 and 1 kept their processes.
    assert pids[1][0] == pids[0][0] and pids[1][1] == pids[0][1]
    assert pids[1][2] != pids[0][2]
    # Round 2: rank 0 raised, its process replaced; ranks 1 and 2 kept theirs.
    assert pids[2][1] == pids[1][1] and pids[2][2] == pids[1][2]
    assert pids[2][0] != pids[1][0]
    kept = [e for e in evs if e["kind"] == "ranks_kept"]
    assert [(e["kept"], e["started"]) for e in kept] == [([0, 1], [2]), ([1, 2], [0])]
    left = [e for e in evs if e["kind"] == "ranks_left"]
    assert [(e["kept"], e["replaced"]) for e in left] == [([0, 1], [2]), ([1, 2], [0])]

    # The setup ran once per process: 3 first ones, then only the 2 replaced.
    # (the console's lines, "[host:local_rank]: ..."; not the failure summaries' quotes)
    setups = [int(p) for p in re.findall(r"^\[[^]]+\]: setup done: pid (\d+)", text, re.M)]
    assert sorted(setups) == sorted({*pids[0].values(), pids[1][2], pids[2][0]})

    # Each restart resumed at the step the failure happened at: none redone.
    resumed = re.findall(
        r"^\[[^]]+\]: => resumed: epoch=\d+ offset=\d+/\d+ global_step=(\d+)", text, re.M
    )
    assert resumed == ["10", "20"], text[-4000:]

    # The timeline marks each restart's kept and replaced ranks, with the kept pids.
    page = render_html(load_events([str(log)]))
    assert f"ranks kept 0 (pid {pids[0][0]}), 1 (pid {pids[0][1]}); replaced 2" in page
    assert f"ranks kept 1 (pid {pids[1][1]}), 2 (pid {pids[1][2]}); replaced 0" in page


@pytest.fixture(scope="module")
def two_faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job of scripts/inproc_worker.py (3 ranks) for the next two tests, a
    fault in each of its first two runs: rank 2 is SIGKILLed at step 2 while
    rank 0 waits in the group's store (restart count 0), then rank 1, a kept
    process, hangs at step 2 beside rank 0, the kept process that was stuck
    the round before (restart count 1); its output, events and the workers'
    views."""
    folder = tmp_path_factory.mktemp("two-faults")
    log = folder / "events.jsonl"
    hang = {"rank": 1, "how": "hang", "step": 2}
    faults = [{"rank": 2, "how": "kill", "step": 2, "stuck": 0}, hang]
    env = worker_env(folder, faults, steps=4)
    worker = str(SCRIPTS / "inproc_worker.py")
    text = run_job(log, ["--max-restarts=2", "--hang-timeout=10", worker], env)
    return {"text": text, "events": events(log), "views": events(folder / "views.jsonl")}


def test_a_hung_rank_is_replaced_and_its_peers_kept(two_faults: dict[str, Any]) -> None:
    """Rank 1 stops making progress outside any collective; the others wait
    for it in theirs. The watchdog declares the hang on rank 1, whichever
    rank's timeout expired first and whatever the kept processes did in the
    round before (rank 0 sat in the store then): every rank's stack is
    collected, kept processes' too. Rank 1 is stopped first, which ends its
    peers' collectives, and their processes are kept."""
    text, evs = two_faults["text"], two_faults["events"]
    hangs = [e for e in evs if e["kind"] == "hang_detected"]
    assert [(e["round"], e["rank"]) for e in hangs] == [(1, 1)], text[-3000:]
    assert sorted(hangs[0]["sits_in"]) == ["0", "1", "2"], hangs
    assert "rank 1 made no progress for 10 s" in text, text[-3000:]
    left = [(e["kept"], e["replaced"]) for e in evs if e["kind"] == "ranks_left"]
    assert left == [([0, 1], [2]), ([0, 2], [1])], text[-3000:]  # (the next test's first)
    started = [e for e in evs if e["kind"] == "workers_started"]
    assert len(started) == 3, started
    first, before, after = (dict(zip(e["ranks"], e["pids"], strict=True)) for e in started)
    assert before[1] == first[1]  # the hung rank's process was kept from the round before
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]


def test_a_survivor_waiting_in_the_store_leaves_and_is_kept(two_faults: dict[str, Any]) -> None:
    """Rank 2 is SIGKILLed while rank 0 waits in the group's store for a key
    no rank sets: aborting the process group does not end that wait, the
    connections rank 0 opened in its function are shut down under it, it
    leaves its function and its process is kept (it is not replaced for
    having missed the agent's time to leave)."""
    text, views = two_faults["text"], two_faults["views"]
    stuck = [v for v in views if "stuck" in v]
    assert [(v["rank"], v["stuck"]) for v in stuck] == [(0, stuck[0]["stuck"])], views
    left = [(e["kept"], e["replaced"]) for e in two_faults["events"] if e["kind"] == "ranks_left"]
    assert left == [([0, 1], [2]), ([0, 2], [1])], text[-3000:]  # (then the previous test's)
    # The process that waited in the store trains on as rank 0 of the next rounds.
    again = [v["pid"] for v in views if v.get("restarts") in (1, 2) and v.get("rank") == 0]
    assert again == [stuck[0]["stuck"]] * 2, views


def test_a_killed_rank_is_served_by_a_standby_and_status_shows_it(tmp_path: Path) -> None:
    """Once the node's standby is ready (it ran the script up to its
    in-process function), rank 2 is SIGKILLed: the standby's process takes
    rank 2 (its pid is the standby's, it ran its setup once, before the kill),
    ranks 0 and 1 keep theirs, the job trains on and ends; ``elastrun status``
    shows ranks 0 and 1 kept and rank 2 served by the standby, in --json and
    in its table. No standby outlives the job."""
    finish = tmp_path / "finish"
    env = worker_env(tmp_path, [{"rank": 0, "how": "none", "step": -1}], steps=4)
    env["INPROC_UNTIL"] = str(finish)
    out, log = tmp_path / "agent.log", tmp_path / "events.jsonl"
    argv = [
        *(sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=3"),
        *("--max-restarts=1", "--standby-ranks=1", f"--events-file={log}"),
        str(SCRIPTS / "inproc_worker.py"),
    ]
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        line = wait_for(
            lambda: next(
                (ln for ln in out.read_text().splitlines() if "standalone job" in ln), None
            ),
            BOUND,
            "the standalone job's line",
        )
        given = shlex.split(line[line.index("(elastrun status") + 1 : -1])[2:]

        def ready() -> dict[str, Any] | None:
            evs = events(log) if log.exists() else []
            kinds = {e["kind"]: e for e in evs}
            return kinds if {"workers_started", "standby_ready"} <= set(kinds) else None

        ready_events = wait_for(ready, BOUND, "the standby to be ready")
        first = ready_events["workers_started"]
        standby = ready_events["standby_ready"]["pid"]
        pids = dict(zip(first["ranks"], first["pids"], strict=True))
        views = tmp_path / "views.jsonl"
        before = [json.loads(x) for x in views.read_text().splitlines()]
        setups_before = [r["setup"] for r in before if "setup" in r]
        os.kill(pids[2], signal.SIGKILL)

        def standby_shown() -> dict[str, Any] | None:
            shown = status(*given, "--json")
            s = json.loads(shown.stdout) if shown.returncode == 0 else None
            ranks = s["ranks"] if s and s["restarts"] == 1 else []
            seen = [(r["kept"], r["standby"]) for r in ranks]
            return s if seen == [(True, None), (True, None), (False, True)] else None

        s = wait_for(standby_shown, BOUND, "status to show rank 2 served by the standby")
        assert [r["pid"] for r in s["ranks"]] == [pids[0], pids[1], standby]
        table = status(*given).stdout
        assert f"kept (pid {pids[0]})" in table and f"standby (pid {standby})" in table, table
        finish.touch()
        assert proc.wait(BOUND) == 0, out.read_text()[-3000:]
    finally:
        stop_groups(proc)
    evs = events(log)
    used = [e for e in evs if e["kind"] == "standby_used"]
    assert [(e["rank"], e["pid"]) for e in used] == [(2, standby)]
    # The standby in its place is spawned after the round's workers started, not before
    # (its spawn is not on the path to the round's first step).
    kinds = [e["kind"] for e in evs]
    after_use = kinds[kinds.index("standby_used") :]
    assert after_use.index("workers_started") < after_use.index("standby_started"), kinds
    started = [e for e in evs if e["kind"] == "workers_started"]
    after = dict(zip(started[1]["ranks"], started[1]["pids"], strict=True))
    assert after == {0: pids[0], 1: pids[1], 2: standby}
    records = [json.loads(x) for x in views.read_text().splitlines()]
    # The standby ran its setup once, before the kill; rank 2 trained in round 1.
    assert standby in setups_before
    assert [r["setup"] for r in records if "setup" in r].count(standby) == 1
    assert any(r.get("pid") == standby and r.get("rank") == 2 for r in records if "members" in r)
    # Every standby (the used one, the one started after it) ended with the job.
    for e in evs:
        if e["kind"] == "standby_started":
            assert not _alive(e["pid"]), f"standby {e['pid']} outlived the job"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.bench  # each process imports torch._dynamo and compiles: ~30 s on 2 loaded cores
def test_kept_ranks_do_not_compile_their_model_again(tmp_path: Path) -> None:
    """bench/compile_worker.py (a ``torch.compile``d model, compiled in each
    process's setup, a backend that counts the graphs) with 2 ranks, rank 1
    SIGKILLed after step 3: rank 0's process is kept and compiles nothing
    after the kill; rank 1's new process compiles its model again."""
    from argparse import Namespace

    from bench.compile_restart import run_one
    from bench.configs import ELASTRUN_TUNED

    args = Namespace(nproc=2, backend="aot_eager", steps=6, kill_at=3, timeout=BOUND)
    got = run_one("in-process", ELASTRUN_TUNED, True, args, tmp_path / "run")
    log = (tmp_path / "run" / "launcher.log").read_text(errors="replace")[-3000:]
    assert got.returncode == 0, log
    assert [(r.rank, r.kept) for r in got.ranks] == [(0, True), (1, False)], (got, log)
    kept, new = got.ranks
    assert kept.compiled == 0, got
    assert new.compiled >= 1, got
