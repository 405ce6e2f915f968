"""Worker logs on a full disk, for real: ``--log-dir`` on a 64 KiB tmpfs that
the workers' output overflows. Root only (mount); each agent runs in its own
mount namespace (``unshare -m``), so the tmpfs vanishes with it.

* The job is not disturbed: every line still reaches the console, the job
  exits 0; one warning per file names it and the error; the event log
  (kept elsewhere) has ``log_write_failed`` and ``log_output_lost`` with the
  bytes lost.
* ``--redirects`` output (file only) that is lost is said to be lost.
* With ``--require-logs`` the job exits 1, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.elastic_harness import SCRIPTS

WORKER = str(SCRIPTS / "launch_input_worker.py")
LINES = 3000  # 70 bytes each: 210 KB per rank, far over the 64 KiB disk
UNSHARE = shutil.which("unshare")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or UNSHARE is None, reason="needs root and unshare(1) to mount a tmpfs"
)


def on_full_disk(
    tmp_path: Path, *flags: str, worker: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A 2-rank job whose --log-dir is ``tmp_path/disk``, a 64 KiB tmpfs;
    ``worker``: its command (default: a chatty worker that fills it)."""
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    events = tmp_path / f"events-{len(list(tmp_path.glob('events-*')))}.jsonl"
    shell = 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"'
    assert UNSHARE is not None
    res = subprocess.run(
        [
            UNSHARE,
            "-m",
            "sh",
            "-c",
            shell,
            str(disk),
            sys.executable,
            "-m",
            "elastrun",
            "--standalone",
            "--nproc-per-node=2",
            f"--log-dir={disk}",
            f"--events-file={events}",
            *flags,
            *(worker or (WORKER, "chatty", str(LINES))),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if "mount:" in res.stderr and res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()[:200]}")
    return res, events


def kinds(events: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in events.read_text().splitlines()]


def test_full_log_disk_warns_and_the_job_goes_on(tmp_path: Path) -> None:
    res, events = on_full_disk(tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("line ") == 2 * LINES  # the console lost nothing
    warnings = [x for x in res.stderr.splitlines() if "cannot write" in x]
    assert warnings and all("No space left on device" in w for w in warnings), res.stderr
    assert any("stdout.log (rank 0 stdout)" in w for w in warnings), warnings
    assert len(warnings) == len(set(warnings)) <= 4  # once per file
    evs = kinds(events)
    failed = [e for e in evs if e["kind"] == "log_write_failed"]
    lost = [e for e in evs if e["kind"] == "log_output_lost"]
    assert failed and all(e["errno"] == 28 for e in failed), failed
    assert lost and sum(int(str(e["bytes"])) for e in lost) > 0, lost
    assert not tmp_path.joinpath("disk").is_mount()  # gone with its namespace


def test_redirected_output_lost_on_a_full_disk_is_said_to_be_lost(tmp_path: Path) -> None:
    res, _ = on_full_disk(tmp_path, "--redirects=1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "line " not in res.stdout  # redirected: the file was the only place
    assert "that output is lost (--redirects sends it to the file only)" in res.stderr


def test_require_logs_makes_lost_output_fail_the_job(tmp_path: Path) -> None:
    res, events = on_full_disk(tmp_path, "--require-logs")
    assert res.returncode == 1, res.stderr[-2000:]
    assert "the workers succeeded, but not all of their output reached its log files" in res.stderr
    assert "exiting 1 (--require-logs)" in res.stderr
    failed = [e for e in kinds(events) if e["kind"] == "job_failed"]
    assert failed and failed[-1]["reason"] == "log_output_lost"
