"""Many workers: a signal is acted on while they spawn, and the number is bounded.

* A real agent starting ``--nproc-per-node=1000`` sleeping workers (the
  documented limit is 1024) gets SIGTERM once about 100 have started: it
  stops the spawn there (it used to finish spawning first: 7 s here at 1000,
  over 12 s at 100000), stops only the workers it started, each on the
  SIGTERM, exits 143 and leaves no worker, alive or zombie.
* A number of workers the machine cannot hold (the open-file limit, lowered
  for the agent) is refused before anything starts: exit 2 naming
  ``--nproc-per-node`` and ``ulimit -n``.
* What 1000 workers ending at once bring the agent, a SIGCHLD each while its
  loop is busy, scaled down: workers that send it bursts of SIGCHLD. Nothing
  is printed (it used to print "Exception ignored ... signal wakeup fd" once
  its wakeup socket was full, and to lose the signals that did not fit), and
  a SIGTERM in the middle of it still stops the job (agent/signals.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import threading
import uuid
from pathlib import Path

from tests.helpers import stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN

NPROC = 1000


def children_of(pid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                n += 1
    return n


def with_marker(marker: str) -> list[int]:
    """Pids whose command line holds ``marker`` (this test's workers only)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    out.append(int(entry))
    return out


def test_sigterm_while_a_large_group_spawns(tmp_path: Path) -> None:
    marker = f"{uuid.uuid4().int % 10**6 + 10**6}"  # sleep's argument: unique to this run
    script = tmp_path / "sleeper.sh"
    script.write_text(f"#!/bin/sh\nexec sleep {marker}\n")
    script.chmod(0o755)
    events_file = tmp_path / "events.jsonl"
    agent = subprocess.Popen(
        [
            *ELASTRUN,
            "--standalone",
            f"--nproc-per-node={NPROC}",
            "--no-python",
            f"--events-file={events_file}",
            str(script),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_for(lambda: children_of(agent.pid) >= 100, 60, "100 workers started", 0.02)
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(60)
        stderr = agent.stderr.read().decode() if agent.stderr else ""
        assert code == 128 + signal.SIGTERM, stderr
        assert "received SIGTERM" in stderr and "Traceback" not in stderr
        assert "Exception ignored" not in stderr
        events = [json.loads(line) for line in events_file.read_text().splitlines()]
        kinds = [e["kind"] for e in events]
        # The spawn stopped at the signal: the group never finished starting,
        # and only the workers already started were stopped, each on the
        # SIGTERM (none waited out the grace and was killed).
        (stopping,) = [e for e in events if e["kind"] == "workers_stopping"]
        print(f"SIGTERM with {len(stopping['pids'])} of {NPROC} workers started")
        assert 100 <= len(stopping["pids"]) < NPROC
        assert "workers_started" not in kinds and "workers_killed" not in kinds
        assert kinds.count("worker_exited") == len(stopping["pids"])
        # Every worker gone: none alive, none a zombie (the agent reaped them).
        assert wait_for(lambda: not with_marker(marker), 10, "no worker left"), marker
    finally:
        stop_groups(agent)
        for pid in with_marker(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait(10)


FLOODER = """
import os, signal, sys, threading, time
parent, marker = os.getppid(), sys.argv[1]

def chatter():  # fills the agent's stdout, which the test does not read yet
    line = "x" * 200
    while True:
        print(line, flush=True)

threading.Thread(target=chatter, daemon=True).start()
deadline = time.monotonic() + 60
burst = 0
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(2000):
        os.kill(parent, signal.SIGCHLD)
    burst += 1
    if burst == 20:
        open(marker, "w").close()
"""


def test_a_flood_of_sigchld_prints_nothing_and_sigterm_still_stops(tmp_path: Path) -> None:
    """The agent's loop is held (its stdout is full: writing the workers'
    lines blocks) while the workers send it SIGCHLD, as a group's exits do
    while the loop is busy; then SIGTERM."""
    script = tmp_path / "flood.py"
    script.write_text(FLOODER)
    err_path = tmp_path / "agent.err"
    with open(err_path, "w") as err:
        agent = subprocess.Popen(
            [*ELASTRUN, "--standalone", "--nproc-per-node=2", str(script), str(tmp_path / "f")],
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    drain = threading.Thread(target=lambda: agent.stdout and agent.stdout.read(), daemon=True)
    try:
        wait_for((tmp_path / "f").exists, 60, "the workers flooding")
        drain.start()  # the agent's loop goes on
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(30)  # bounded: the SIGTERM was not lost
    finally:
        stop_groups(agent)
    drain.join(10)
    stderr = err_path.read_text(errors="replace")
    assert "Exception ignored" not in stderr and "wakeup fd" not in stderr, stderr[-3000:]
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "received SIGTERM" in stderr


def test_more_workers_than_the_machine_allows_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("print('ran')\n")

    def low_nofile() -> None:  # in the agent's process only
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    res = subprocess.run(
        [*ELASTRUN, "--standalone", "--nproc-per-node=100", f"--log-dir={tmp_path}", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=low_nofile,
        check=False,
    )
    assert res.returncode == 2, res.stderr
    assert "--nproc-per-node: 100 workers are more than this machine allows" in res.stderr
    assert "ulimit -n" in res.stderr and "ran" not in res.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["w.py"]  # nothing was started
