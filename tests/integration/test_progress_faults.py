"""The hang watchdog never declares a healthy job hung because progress files
failed, and is never blocked by what it finds in their place (real agents,
real workers reporting progress through elastrun.train.heartbeat).

* The workers' folders made immutable (``chattr +i``: nothing can be created
  or removed there, even by root) while they train, under
  ``--hang-timeout 5``: the runners relay their progress over their channels,
  the job finishes 0 and no hang is declared; the agent says it once. A rank
  that then stops for real is still found (judged by what was relayed).
* The same with the log disk full (a 64 KiB tmpfs, ``unshare -m``).
* A FIFO planted at ``heartbeat.json``: the agent says it cannot read it and
  is not blocked. SIGTERM stops the job promptly, within a bounded wait on the
  agent's exit.
* A FIFO planted at a rank's ``stacks.txt``: the hang is declared and
  explained without that rank's stacks (said why), and the job ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN, SCRIPTS
from tests.integration.test_full_disk import on_full_disk

WORKER = str(SCRIPTS / "progress_worker.py")
BOUND = 120.0  # a whole job, on a loaded 2-core machine
CHATTR = shutil.which("chattr")
UNSHARE = shutil.which("unshare")  # for on_full_disk


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def kinds(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind]


def rank_dir(log_dir: Path, local_rank: int) -> Path | None:
    found = sorted(log_dir.glob(f"**/attempt_0/{local_rank}"))
    return found[0] if found else None


def start(tmp_path: Path, *flags: str, nproc: int = 2, mode: str, arg: str = "") -> Any:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    err = open(tmp_path / "agent.err", "w")  # noqa: SIM115 - read while it runs
    proc = subprocess.Popen(
        [
            *ELASTRUN,
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--shutdown-timeout=5",
            f"--log-dir={tmp_path / 'logs'}",
            f"--events-file={tmp_path / 'events.jsonl'}",
            *flags,
            WORKER,
            str(out),
            mode,
            *([arg] if arg else []),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    err.close()
    return proc, out


def stderr_of(tmp_path: Path) -> str:
    return (tmp_path / "agent.err").read_text(errors="replace")


@contextmanager
def immutable(*folders: Path) -> Iterator[None]:
    """``chattr +i`` on ``folders`` (undone on exit)."""
    assert CHATTR is not None
    done: list[Path] = []
    try:
        for f in folders:
            res = subprocess.run(
                [CHATTR, "+i", str(f)], capture_output=True, text=True, check=False
            )
            if res.returncode != 0:
                pytest.skip(f"this file system takes no immutable flag: {res.stderr.strip()}")
            done.append(f)
        yield
    finally:
        for f in done:
            subprocess.run([CHATTR, "-i", str(f)], check=False)


needs_chattr = pytest.mark.skipif(
    os.geteuid() != 0 or CHATTR is None, reason="needs root and chattr(1) (an immutable folder)"
)


@needs_chattr
@pytest.mark.parametrize("stuck", [False, True], ids=["healthy", "rank1-stops"])
def test_unwritable_progress_folders_never_make_a_healthy_job_hung(
    tmp_path: Path, stuck: bool
) -> None:
    proc, out = start(
        tmp_path, "--hang-timeout=5", mode="stop-after-go" if stuck else "steady", arg="15"
    )
    try:
        wait_for(lambda: all((out / f"{r}.beating").exists() for r in (0, 1)), 60, "first progress")
        folders = [rank_dir(tmp_path / "logs", r) for r in (0, 1)]
        assert all(f is not None and (f / "heartbeat.json").exists() for f in folders), folders
        with immutable(*[f for f in folders if f is not None]):
            (out / "go").touch()  # 15 s more of training: 3 times the hang timeout
            code = proc.wait(BOUND)
    finally:
        stop_groups(proc)
    err, evs = stderr_of(tmp_path), events(tmp_path / "events.jsonl")
    if not stuck:
        assert not kinds(evs, "hang_detected"), err[-3000:]
        assert code == 0, err[-3000:]
        assert (out / "0.done").exists() and (out / "1.done").exists()
    else:
        # What the channel relayed shows rank 1 stopped: it is still found.
        (hang,) = kinds(evs, "hang_detected")
        assert hang["rank"] == 1 and hang["last_step"] is not None and hang["last_step"] < 1000
        assert code == 1, err[-3000:]
    failed = kinds(evs, "progress_write_failed")
    assert {e["rank"] for e in failed} == {0, 1} and all(e["relayed"] for e in failed), failed
    assert "Operation not permitted" in failed[0]["error"]
    said = [ln for ln in err.splitlines() if "progress file" in ln and "not recorded" in ln]
    assert len([ln for ln in said if ln.startswith("elastrun: warning:")]) == 1, err


@pytest.mark.skipif(
    os.geteuid() != 0 or UNSHARE is None, reason="needs root and unshare(1) to mount a tmpfs"
)
def test_a_full_log_disk_never_makes_a_healthy_job_hung(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    disk = tmp_path / "disk"  # the tmpfs on_full_disk mounts (the workers fill it)
    res, ev = on_full_disk(
        tmp_path, "--hang-timeout=5", worker=(WORKER, str(out), "fill", str(disk))
    )
    evs = events(ev)
    assert not kinds(evs, "hang_detected"), res.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    failed = kinds(evs, "progress_write_failed")
    assert failed and all("No space left on device" in e["error"] for e in failed), failed
    assert (out / "0.done").exists() and (out / "1.done").exists()


def test_a_fifo_at_the_progress_file_never_blocks_the_agent(tmp_path: Path) -> None:
    proc, out = start(tmp_path, "--hang-timeout=2", nproc=1, mode="silent")
    try:
        wait_for((out / "0.started").exists, 60, "the worker")
        folder = rank_dir(tmp_path / "logs", 0)
        assert folder is not None
        hb = folder / "heartbeat.json"
        hb.unlink(missing_ok=True)
        os.mkfifo(hb)  # a plain open() would wait for a writer forever
        wait_for(
            lambda: "cannot see rank 0's progress" in stderr_of(tmp_path),
            60,
            "the agent reading the FIFO",
        )
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)  # bounded: the agent was not blocked
    finally:
        stop_groups(proc)
    err = stderr_of(tmp_path)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert f"{hb} cannot be read: is a FIFO, not a regular file" in err
    (unknown,) = kinds(events(tmp_path / "events.jsonl"), "progress_unknown")
    assert unknown["rank"] == 0 and "FIFO" in unknown["why"]


def test_a_fifo_at_a_stacks_file_never_blocks_the_hang_report(tmp_path: Path) -> None:
    proc, out = start(tmp_path, "--hang-timeout=3", mode="hang-rank1")
    try:
        wait_for(lambda: all((out / f"{r}.started").exists() for r in (0, 1)), 60, "the workers")
        folder = rank_dir(tmp_path / "logs", 0)
        assert folder is not None and (folder / "stacks.txt").exists()
        (folder / "stacks.txt").unlink()
        os.mkfifo(folder / "stacks.txt")
        code = proc.wait(BOUND)  # bounded: the hang report was not blocked
    finally:
        stop_groups(proc)
    err = stderr_of(tmp_path)
    assert code == 1, err[-3000:]
    evs = events(tmp_path / "events.jsonl")
    (hang,) = kinds(evs, "hang_detected")
    assert hang["rank"] == 1
    (skipped,) = kinds(evs, "stacks_skipped")
    assert skipped["rank"] == 0 and "not a regular file" in skipped["why"]
    assert "rank 0 on " in err and "no stacks: its stacks file" in err
    assert "Python stacks when the hang was declared" in err  # rank 1's
