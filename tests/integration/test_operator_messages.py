"""What the operator reads, from real agents and real workers: failure
summaries (stdout when stderr is empty; a header that is true for a single
node and for a group), console prefixes (one per line; torch's template
exactly as torchrun prints it) and the rendezvous waiting line."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from tests.conftest import REPO
from tests.helpers import free_port, stop_groups, without_pet

ELASTRUN = [sys.executable, "-m", "elastrun"]
TIMEOUT = 180
# For a script that never imports torch: no warm interpreter importing it meanwhile.
NO_TORCH = "--no-warm"

STDOUT_ERROR = textwrap.dedent(
    """
    import os, sys
    print("step 1 ok", flush=True)
    if os.environ["RANK"] == "1":
        print("error: the data file is missing (printed, not raised)", flush=True)
        sys.exit(3)
    """
)

RAISES_IN_GROUP = textwrap.dedent(
    """
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("hi from", dist.get_rank(), flush=True)
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("boom in rank 1")
    """
)


def env(**extra: str) -> dict[str, str]:
    out = without_pet()
    out.pop("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", None)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO)]))
    out.update(extra)
    return out


def elastrun(
    *args: str, cwd: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ELASTRUN, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env(**(extra_env or {})),
        check=False,
    )


def test_single_node_failure_shows_stdout_and_says_the_job_fails(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(STDOUT_ERROR)
    proc = elastrun("--standalone", "--nproc-per-node=2", NO_TORCH, "w.py", cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr
    assert "no restarts are left (max restarts 0): the job fails" in err, err
    assert "node was lost" not in err and "re-forming" not in err
    assert "last 2 lines of stdout (nothing on stderr):" in err, err
    assert "    error: the data file is missing (printed, not raised)" in err
    assert "nothing on stderr)" in err and "(no error file" not in err
    assert "restart budget (0 restarts, --max-restarts)" in err


def test_one_prefix_per_line_for_torchs_exception_report(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(RAISES_IN_GROUP)
    proc = elastrun("--standalone", "--nproc-per-node=2", "w.py", cwd=tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    console = [ln for ln in lines if ln.startswith("[")]
    assert any(ln.endswith(":1]: ValueError: boom in rank 1") for ln in console), lines
    # our "[host:1]: " prefix, without torch's "[rank1]: " behind it
    assert not [ln for ln in lines if "]: [rank1]: " in ln], proc.stderr
    assert any(
        ln.startswith("[") and ":1]: Traceback (most recent call last):" in ln for ln in lines
    )
    # the summary's tail too
    assert "\n    ValueError: boom in rank 1" in proc.stderr


def test_torch_prefix_template_exactly_as_torchrun(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(RAISES_IN_GROUP)
    tmpl = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}
    raw = elastrun("--standalone", "--nproc-per-node=2", "w.py", cwd=tmp_path, extra_env=tmpl)
    # without --tee torchrun shows the workers' lines as written
    assert sorted(ln for ln in raw.stdout.splitlines() if "hi from" in ln) == [
        "hi from 0",
        "hi from 1",
    ]
    teed = elastrun(
        "--standalone", "--nproc-per-node=2", "--tee=3", "w.py", cwd=tmp_path, extra_env=tmpl
    )
    assert sorted(ln for ln in teed.stdout.splitlines() if "hi from" in ln) == [
        "[rank0]: hi from 0",
        "[rank1]: hi from 1",
    ]
    assert "[rank1]: ValueError: boom in rank 1" in teed.stderr.splitlines()
    assert "[rank1]: [rank1]:" not in teed.stderr and ": : " not in teed.stdout


def test_group_failure_header_names_the_only_way_on(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(
        "import os, sys, time\n"
        "time.sleep(1)\n"
        "sys.exit(4 if os.environ['GROUP_RANK'] == '1' else 0)\n"
    )
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=msg-group",
        "--max-restarts=0",
        NO_TORCH,
    ]
    host = subprocess.Popen(
        [*ELASTRUN, *common, "--rdzv-conf=is_host=1", "--node-rank=0", "w.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        start_new_session=True,
    )
    try:
        other = elastrun(*common, "--rdzv-conf=is_host=0", "--node-rank=1", "w.py", cwd=tmp_path)
        host.communicate(timeout=TIMEOUT)
    finally:
        stop_groups(host)
    assert other.returncode == 1
    assert (
        "no restarts are left (max restarts 0); the job goes on only if another node of the "
        "group was lost" in other.stderr
    ), other.stderr


def test_waiting_line_after_the_last_call_is_not_the_join_timeout(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("print('ran', flush=True)\n")
    proc = elastrun(
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=msg-wait",
        "--rdzv-conf=last_call_timeout=3,join_timeout=600",
        NO_TORCH,
        "w.py",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    waits = [ln for ln in proc.stderr.splitlines() if "rendezvous round 0" in ln]
    assert waits and all("1 node joined (min 1, max 2)" in ln for ln in waits), waits
    assert all("last call closes the round" in ln for ln in waits), waits
    assert "join timeout in" not in proc.stderr


def test_a_port_held_by_another_program_is_said_not_to_be_a_store(tmp_path: Path) -> None:
    """Another program listens on the store's port (it closes every connection
    unanswered): the agent, which takes it for another agent's store, says
    within seconds that it is not an elastrun store, not "timed out" after
    join_timeout."""
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(16)
        port = other.getsockname()[1]
        stop = threading.Event()

        def refuse_hellos() -> None:
            other.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    conn, _ = other.accept()
                    conn.close()

        closer = threading.Thread(target=refuse_hellos, daemon=True)
        closer.start()
        try:
            proc = elastrun(
                "--nnodes=1",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=held-port",
                f"--rdzv-conf=join_timeout={TIMEOUT * 2}",  # beyond the test's own bound
                str(script),
                cwd=tmp_path,
            )
        finally:
            stop.set()
            closer.join(5)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "not an elastrun store" in proc.stderr, proc.stderr
    assert "held by another program" in proc.stderr and "timed out" not in proc.stderr
