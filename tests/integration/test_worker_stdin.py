"""Workers read the launcher's stdin, as under torchrun (real agents).

torchrun's workers inherit the launcher's stdin: one open file shared by
every worker (whoever reads first gets the data; the others read what is
left). elastrun used to give them ``/dev/null``. Now:

* workers started cold share the agent's stdin (a pipe, or a file);
* workers forked from the warm interpreter too: the agent passes its stdin
  with each fork order, and the warm interpreter, which lives on across
  rounds, keeps no copy of it once the workers are forked.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

from tests.helpers import stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN, SCRIPTS

TEXT = "first line\nsecond line\n"
READ = re.compile(r"rank (\d) read ('.*?'|\".*?\")")


def reads(stdout: str) -> dict[int, str]:
    """rank -> what it read, from the workers' ``rank R read 'text'`` lines."""
    return {int(m[1]): ast.literal_eval(m[2]) for m in READ.finditer(stdout)}


def test_cold_workers_share_the_launcher_s_stdin_pipe_and_file(tmp_path: Path) -> None:
    argv = [
        *ELASTRUN,
        "--standalone",
        "--nproc-per-node=2",
        str(SCRIPTS / "progress_worker.py"),
        str(tmp_path),
        "stdin",
    ]
    piped = subprocess.run(
        argv, input=TEXT, capture_output=True, text=True, timeout=120, check=False
    )
    assert piped.returncode == 0, piped.stderr[-2000:]
    got = reads(piped.stdout)
    assert sorted(got) == [0, 1], piped.stdout
    # One open file for all: together they read it exactly once.
    assert sorted("".join(got.values()).splitlines()) == sorted(TEXT.splitlines()), got
    source = tmp_path / "input.txt"
    source.write_text(TEXT)
    with open(source) as fp:
        from_file = subprocess.run(
            argv, stdin=fp, capture_output=True, text=True, timeout=120, check=False
        )
    assert from_file.returncode == 0, from_file.stderr[-2000:]
    assert sorted("".join(reads(from_file.stdout).values()).splitlines()) == sorted(
        TEXT.splitlines()
    )


def test_warm_workers_get_the_launcher_s_stdin_and_the_zygote_keeps_none(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    r, w = os.pipe()
    agent = subprocess.Popen(
        [
            *ELASTRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--warm",
            "--max-restarts=1",  # the warm interpreter is kept for a restart
            f"--events-file={events}",
            str(SCRIPTS / "stdin_worker.py"),
            str(out),
        ],
        stdin=r,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    os.close(r)
    try:
        os.write(w, TEXT.encode())
        os.close(w)
        wait_for(lambda: all((out / f"{k}.read").exists() for k in (0, 1)), 120, "the reads")
        evs = [json.loads(x) for x in events.read_text().splitlines()]
        (started,) = [e for e in evs if e["kind"] == "workers_started"]
        assert started["warm"] == [True, True], started
        zygotes = [e["pid"] for e in evs if e["kind"] == "warm_started"]
        pipe = os.readlink(f"/proc/{agent.pid}/fd/0")
        assert pipe.startswith("pipe:")
        for pid in zygotes:  # the zygote lives on across rounds: no copy of the pipe
            fds = Path(f"/proc/{pid}/fd")
            if fds.exists():
                held = [os.readlink(f) for f in fds.iterdir() if f.exists()]
                assert pipe not in held, (pid, held)
        (out / "finish").touch()
        stdout, stderr = agent.communicate(timeout=120)
    finally:
        stop_groups(agent)
    assert agent.returncode == 0, stderr[-2000:]
    got = reads(stdout)
    assert sorted(got) == [0, 1], stdout
    assert sorted("".join(got.values()).splitlines()) == sorted(TEXT.splitlines())
    assert "/dev/null" not in stdout
