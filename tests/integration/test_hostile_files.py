"""Hostile files and folders where the agent writes, planted as an attacker would (real agents).

* Another user (uid 65534, through ``setpriv``) pre-creates the job's folders
  ``<log-dir>/<run id>/<host>/`` in a shared sticky folder (mode 1777, as
  ``/tmp``) and plants links at ``.agent.pid``, ``events-<host>.jsonl`` and
  ``attempt_0/0/stdout.log`` pointing at a file of the victim (root, running
  the agent). The agent refuses with one line naming the folder, the problem
  and what to do, exits non-zero, starts no worker, and writes nothing: the
  victim's file and the attacker's tree are unchanged.
* The same with a link planted as the run folder, and at ``--events-file``
  (a link, or a file of the other user).
* A log folder that others may write without the sticky bit is refused.
* A FIFO at the event log, the pid file or a worker log never blocks the
  agent (each run is bounded by a wait on the process, never a clock).
* A relative ``--log-dir`` with a script that changes directory (as Hydra
  does) under ``--hang-timeout``: not declared hung, its error file found.
* A FIFO, or a link, named like the newest checkpoint, its checksum record or
  ``latest``: ``load_checkpoint`` returns the older intact one (bounded).

The run id is given with ``--rdzv-id`` (``--standalone`` makes a random one):
an attacker knows the ids a team uses, and host names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.names import path_component
from tests.conftest import REPO
from tests.helpers import stop_groups

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
TIMEOUT = 180  # every agent run is bounded by this wait on its process
RUN_ID = "job1"
HOST = path_component(socket.gethostname(), "unknown-host")

needs_another_user = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="needs root and setpriv(1) to act as another user (uid 65534)",
)

WORKER = textwrap.dedent(
    """
    import sys
    print("hello from the worker", flush=True)
    with open(sys.argv[1], "w") as f:
        f.write("ran")
    """
)

# Trains (real torch: the runner records optimizer steps) for 2 hang
# timeouts after changing directory, as Hydra does, then fails under @record.
CHDIR_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from elastrun import record

    @record
    def main():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()

        step()  # progress seen before the change of directory
        os.chdir(sys.argv[1])
        for _ in range(int(sys.argv[2])):
            step()
            time.sleep(0.1)
        raise RuntimeError("distinctive failure after chdir")

    main()
    """
)


def agent_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    return env


def run_agent(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A real agent (one node, its own store, predictable run id), bounded:
    an agent that blocks (on a FIFO) fails the test when the wait runs out."""
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--rdzv-id={RUN_ID}",
        "--no-warm",
        *args,
    ]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=agent_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_groups(proc)
        pytest.fail(f"the agent did not finish within {TIMEOUT} s (blocked?)")
    finally:
        stop_groups(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def as_other_user(script: str) -> None:
    """Run ``script`` (sh) as uid/gid 65534 with no supplementary groups."""
    assert SETPRIV is not None
    subprocess.run(
        [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-ec", script],
        cwd="/",
        check=True,
        timeout=30,
    )


def tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``root``: (kind, owner, link target)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            target = os.readlink(p) if p.is_symlink() else ""
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_uid, target)
    return out


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user may write, sticky (as /tmp), reachable by uid 65534."""
    path = Path(tempfile.mkdtemp(prefix="elastrun-shared-", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.conf"
    path.write_text("precious: do not overwrite\n")
    return path


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def unchanged(victim: Path) -> None:
    assert victim.read_text() == "precious: do not overwrite\n"


# ------------------------------------------------------------ another user


@needs_another_user
def test_planted_job_folders_and_links_are_refused_and_nothing_is_written(
    shared: Path, victim: Path, worker: Path, tmp_path: Path
) -> None:
    host = f"{RUN_ID}/{HOST}"
    as_other_user(
        f"""
        cd {shared}
        mkdir -p {host}/attempt_0/0
        ln -s {victim} {host}/.agent.pid
        ln -s {victim} {RUN_ID}/events-{HOST}.jsonl
        ln -s {victim} {host}/attempt_0/0/stdout.log
        ln -s {victim} {host}/attempt_0/0/stderr.log
        """
    )
    planted = tree(shared)
    assert planted[f"{host}/.agent.pid"][1] == NOBODY

    res = run_agent(f"--log-dir={shared}", str(worker), str(tmp_path / "ran"), cwd=tmp_path)

    assert res.returncode != 0, res.stderr
    line = f"elastrun: error: --log-dir: refusing {shared}/{RUN_ID}: it is owned by uid {NOBODY}"
    assert line in res.stderr, res.stderr
    assert "another user may have planted it: remove it or choose another folder" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "ran").exists()  # no worker started
    unchanged(victim)
    assert tree(shared) == planted  # nothing written, nothing removed


@needs_another_user
def test_a_run_folder_planted_as_a_link_is_refused(
    shared: Path, worker: Path, tmp_path: Path
) -> None:
    theirs = tmp_path / "root-only"  # a folder of the victim the link points at
    theirs.mkdir(mode=0o700)
    as_other_user(f"ln -s {theirs} {shared}/{RUN_ID}")

    res = run_agent(f"--log-dir={shared}", str(worker), str(tmp_path / "ran"), cwd=tmp_path)

    assert res.returncode != 0, res.stderr
    assert f"--log-dir: refusing {shared}/{RUN_ID}: it is a symbolic link" in res.stderr
    assert "remove it, or choose another --log-dir" in res.stderr
    assert list(theirs.iterdir()) == []
    assert not (tmp_path / "ran").exists()


@needs_another_user
@pytest.mark.parametrize("planted", ["link", "their file"])
def test_a_planted_events_file_is_refused(
    shared: Path, victim: Path, worker: Path, tmp_path: Path, planted: str
) -> None:
    events = shared / "events.jsonl"
    if planted == "link":
        as_other_user(f"ln -s {victim} {events}")
        problem = "it is a symbolic link"
    else:
        as_other_user(f"echo theirs > {events}")
        problem = f"it is owned by uid {NOBODY}, not by this process"

    res = run_agent(f"--events-file={events}", str(worker), str(tmp_path / "ran"), cwd=tmp_path)

    assert res.returncode != 0, res.stderr
    assert f"--events-file: refusing {events}: {problem}" in res.stderr, res.stderr
    assert not (tmp_path / "ran").exists()
    unchanged(victim)
    if planted == "their file":
        assert events.read_text() == "theirs\n"


# ------------------------------------------------------------ shared folders


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_log_dir_others_may_write_without_the_sticky_bit_is_refused(
    worker: Path, tmp_path: Path, mode: int
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, mode)

    res = run_agent(f"--log-dir={logs}", str(worker), str(tmp_path / "ran"), cwd=tmp_path)

    assert res.returncode != 0, res.stderr
    expected = (
        f"--log-dir: refusing {logs}: it is writable by other users (mode {mode:o}) "
        "without the sticky bit"
    )
    assert expected in res.stderr, res.stderr
    assert list(logs.iterdir()) == []
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------ FIFOs


def private_tree(*folders: Path) -> None:
    for folder in folders:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)


@pytest.mark.parametrize("where", ["event log", "pid file", "worker log"])
def test_a_fifo_at_a_file_the_agent_writes_never_blocks_it(
    worker: Path, tmp_path: Path, where: str
) -> None:
    logs = tmp_path / "logs"
    run = logs / RUN_ID
    rank = run / HOST / "attempt_0" / "0"
    private_tree(rank)
    fifo = {
        "event log": run / f"events-{HOST}.jsonl",
        "pid file": run / HOST / ".agent.pid",
        "worker log": rank / "stdout.log",
    }[where]
    os.mkfifo(fifo)

    res = run_agent(f"--log-dir={logs}", str(worker), str(tmp_path / "ran"), cwd=tmp_path)

    if where == "event log":  # refused at start, before any worker
        assert res.returncode != 0, res.stderr
        assert f"--log-dir: refusing {fifo}: it is a FIFO, not a regular file" in res.stderr
        assert not (tmp_path / "ran").exists()
        return
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ran").read_text() == "ran"
    assert "hello from the worker" in res.stdout
    if where == "pid file":  # not a pid file: stale, made anew, released at exit
        assert not os.path.lexists(fifo)
        assert (rank / "stdout.log").read_text() == "hello from the worker\n"
    else:  # a log write error, said once; the console still has the output
        said = f"cannot write {fifo} (rank 0 stdout): is a FIFO, not a regular file"
        assert said in res.stderr, res.stderr
        assert stat.S_ISFIFO(fifo.lstat().st_mode)


# ------------------------------------------------------------ absolute paths


def test_a_relative_log_dir_survives_a_script_that_changes_directory(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(CHDIR_WORKER)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # A timeout well above a step on a loaded machine; the run lasts two of
    # them after the chdir, so relative paths would be declared hung.
    hang = 5
    steps = 2 * hang * 10  # 0.1 s each

    res = run_agent(
        "--log-dir=logs",
        f"--hang-timeout={hang}",
        "--events-file=events.jsonl",
        str(script),
        str(elsewhere),
        str(steps),
        cwd=tmp_path,
    )

    assert res.returncode == 1, res.stderr[-3000:]
    assert "made no progress" not in res.stderr, res.stderr[-3000:]
    kinds = (tmp_path / "events.jsonl").read_text()
    assert '"kind": "hang_detected"' not in kinds
    # The summary has the error file's message and traceback, not only stderr.
    assert "error: RuntimeError: distinctive failure after chdir" in res.stderr
    assert "traceback (from the error file):" in res.stderr
    error_file = tmp_path / "logs" / RUN_ID / HOST / "attempt_0" / "0" / "error.json"
    assert "distinctive failure after chdir" in error_file.read_text()
    assert list(elsewhere.iterdir()) == []  # nothing written relative to the new directory


# ------------------------------------------------------------ checkpoints


def _load_bounded(d: Path, unblock: list[Path]) -> tuple[dict[str, object] | None, list[str]]:
    """load_checkpoint in a thread, waited on for at most 60 s; if it is
    blocked, the FIFOs in ``unblock`` are opened to free it, and the test fails."""
    from elastrun.train import load_checkpoint

    lines: list[str] = []
    result: list[dict[str, object] | None] = []
    t = threading.Thread(target=lambda: result.append(load_checkpoint(d, log=lines.append)))
    t.daemon = True
    t.start()
    t.join(60)
    if t.is_alive():
        for fifo in unblock:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"load_checkpoint blocked: {lines}")
    assert result, lines
    return result[0], lines


@pytest.mark.parametrize("planted", ["fifo as data", "fifo as record", "link as data"])
def test_a_special_file_named_like_the_newest_checkpoint_is_skipped(
    tmp_path: Path, victim: Path, planted: str
) -> None:
    torch = pytest.importorskip("torch")
    from elastrun.train import save_checkpoint
    from elastrun.worker.checkpoint_files import CORRUPT_DIR, record_path

    d = tmp_path / "ckpt"
    for step in (10, 20):
        save_checkpoint({"step": step, "w": torch.full((8,), float(step))}, d, step=step)
    newest = d / "ckpt-000000000030.pt"
    if planted == "fifo as data":
        os.mkfifo(newest)
        why = "is a FIFO, not a regular file"
    elif planted == "fifo as record":
        save_checkpoint({"step": 30, "w": torch.zeros(8)}, d, step=30)
        record_path(newest).unlink()
        os.mkfifo(record_path(newest))
        why = "its checksum record is a FIFO, not a regular file"
    else:
        newest.symlink_to(victim)
        why = "is a symbolic link"
    os.unlink(d / "latest")
    os.mkfifo(d / "latest")  # read when the damaged one is moved aside

    state, lines = _load_bounded(d, [newest, record_path(newest), d / "latest"])

    assert state is not None and state["step"] == 20, lines
    damaged = [ln for ln in lines if "is damaged" in ln]
    assert len(damaged) == 1 and str(newest) in damaged[0] and why in damaged[0], lines
    assert f"moved to {d / CORRUPT_DIR / newest.name}" in damaged[0]
    assert not os.path.lexists(newest)
    unchanged(victim)
