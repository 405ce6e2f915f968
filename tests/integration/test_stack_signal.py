"""The stack signal (``--stack-signal``) never kills a healthy rank, and a rank
killed by it is never the root cause (real agents and workers).

Rank 1 stops reporting progress (a hang, ``--hang-timeout 3``); rank 0 is
healthy but has changed the stack signal's disposition:

* ``SIG_DFL`` (as a script that resets every real-time signal does): the agent
  sees the signal is not caught (``SigCgt``), skips rank 0's stacks, says why,
  and never sends it. Rank 1's hang is the root cause; rank 0 is stopped with
  SIGTERM like any collateral rank (it used to die of "signal 39" and be named
  the ROOT CAUSE);
* a handler that dies of the signal anyway (it passes the check): rank 0 is
  collateral, stopped by elastrun, and the hang is still the root cause;
* ``--stack-signal=SIGUSR2``: rank 0's reset of SIGRTMIN+5 does not matter, and
  both ranks' stacks are shown; ``--stack-signal=none``: no stacks, and the
  hang is found all the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.elastic_harness import ELASTRUN, SCRIPTS

WORKER = str(SCRIPTS / "progress_worker.py")
BOUND = 120.0


def run(tmp_path: Path, mode: str, *flags: str) -> tuple[int, str, list[dict[str, Any]]]:
    out = tmp_path / "out"
    out.mkdir()
    ev = tmp_path / "events.jsonl"
    res = subprocess.run(
        [
            *ELASTRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--hang-timeout=3",
            "--shutdown-timeout=5",
            f"--events-file={ev}",
            *flags,
            WORKER,
            str(out),
            mode,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
    evs = [json.loads(x) for x in ev.read_text().splitlines()] if ev.exists() else []
    return res.returncode, res.stderr, evs


def of(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind]


def root_cause_line(err: str) -> str:
    return next(ln for ln in err.splitlines() if ln.startswith("[ROOT CAUSE]"))


def test_a_rank_whose_script_reset_the_stack_signal_is_skipped_never_killed(
    tmp_path: Path,
) -> None:
    code, err, evs = run(tmp_path, "sigdfl")
    assert code == 1, err[-3000:]
    (hang,) = of(evs, "hang_detected")
    assert hang["rank"] == 1
    assert root_cause_line(err).startswith("[ROOT CAUSE] rank 1 (local rank 1)"), err
    exits = {e["rank"]: e for e in of(evs, "worker_exited")}
    assert exits[0]["signal"] == "SIGTERM" and exits[0]["cause"] == "collateral", exits[0]
    assert exits[1]["cause"] == "root_cause"
    (skipped,) = of(evs, "stacks_skipped")
    assert skipped["rank"] == 0 and skipped["signal"] == "SIGRTMIN+5"
    assert "the script changed the handler of SIGRTMIN+5" in skipped["why"]
    # Said in the summary, beside rank 1's stacks.
    assert "no stacks: the script changed the handler of SIGRTMIN+5" in err
    assert "rank 1 on " in err and "Python stacks when the hang was declared" in err
    assert "signal 39" not in err and f"signal SIGRTMIN+5 ({signal.SIGRTMIN + 5})" not in err


def test_a_rank_killed_by_the_stack_signal_anyway_is_never_the_root_cause(
    tmp_path: Path,
) -> None:
    code, err, evs = run(tmp_path, "sigdie")
    assert code == 1, err[-3000:]
    exits = {e["rank"]: e for e in of(evs, "worker_exited")}
    assert exits[0]["signal"] == "SIGRTMIN+5", exits[0]  # it did die of it
    assert exits[0]["cause"] == "collateral" and exits[0]["stopped_by_agent"] is True
    assert root_cause_line(err).startswith("[ROOT CAUSE] rank 1 (local rank 1)"), err
    assert "rank 1 made no progress for 3 s" in err
    assert "[collateral (stopped by elastrun)] rank 0 (local rank 0)" in err


@pytest.mark.parametrize("flag", ["--stack-signal=SIGUSR2", "--stack-signal=none"])
def test_another_stack_signal_or_none(tmp_path: Path, flag: str) -> None:
    code, err, evs = run(tmp_path, "sigdfl", flag)
    assert code == 1, err[-3000:]
    (hang,) = of(evs, "hang_detected")
    assert not of(evs, "stacks_skipped")
    assert root_cause_line(err).startswith("[ROOT CAUSE] rank 1 (local rank 1)"), err
    if flag.endswith("none"):
        assert hang["sits_in"] == {} and "Python stacks when the hang was declared" not in err
    else:
        assert set(hang["sits_in"]) == {"0", "1"}, hang
        assert "progress_worker.py" in hang["sits_in"]["1"]
