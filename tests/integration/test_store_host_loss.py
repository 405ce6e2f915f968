"""Losing the embedded store's host is reported within seconds, not minutes.

Two agents on loopback: ``a`` hosts the store, ``b`` connects to it. ``a`` is
SIGKILLed with its workers. Nothing listens on the store's port any more, so
every reconnection of ``b`` is refused: that is not a blip, the store is gone.
``b`` stops its workers and exits non-zero with an error naming the store's
address within about 10 s (it used to retry for ``read_timeout``, 60 s by
default), whether its workers noticed first (gloo: the dead peer's reset
fails them at once) or not (workers that do not talk to each other: only the
store tells). Here ``read_timeout`` is an hour: ``b`` exiting at all within
the test's bounded wait shows it did not wait for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import BOUND, job
from tests.integration.test_node_loss_disconnect import QUIET_WORKER

READ_TIMEOUT = 3600  # far beyond the test's bounded wait (BOUND)


def flags(port: int, *, host: bool) -> list[str]:
    return [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=hostloss",
        "--max-restarts=3",
        "--rdzv-conf=last_call_timeout=1,lease_ttl=10,join_timeout=60,"
        f"read_timeout={READ_TIMEOUT},is_host={int(host)}",
        "--shutdown-timeout=5",
    ]


@pytest.mark.parametrize("workers", ["gloo", "quiet"])
def test_the_other_node_reports_a_killed_store_host_before_its_read_timeout(
    tmp_path: Path, workers: str
) -> None:
    port = free_port()
    script = "elastic_worker.py"
    if workers == "quiet":
        (tmp_path / "quiet_worker.py").write_text(QUIET_WORKER)
        script = str(tmp_path / "quiet_worker.py")
    with job(tmp_path) as j:
        a = j.start_agent("a", flags(port, host=True), script=script)
        wait_for(lambda: "hosts the rendezvous store" in a.output(), BOUND, "a hosting the store")
        b = j.start_agent("b", flags(port, host=False), script=script)
        wait_for(lambda: sum(s["world"] == 2 for s in j.steps()) >= 4, BOUND, "training at world 2")
        b_pids = {s["pid"] for s in j.steps() if s["world"] == 2 and s["group_rank"] == 1}
        a.kill_group()
        code = b.wait(BOUND)  # bounded, and BOUND < READ_TIMEOUT
        out = b.output()
        assert code != 0, out[-3000:]
        assert f"127.0.0.1:{port}" in out, f"the error does not name the store:\n{out[-3000:]}"
        assert "connection refused" in out, out[-3000:]
        own = [line for line in out.splitlines() if not line.startswith("[")]  # not workers'
        assert not any(line.startswith("Traceback") for line in own), out[-3000:]
        assert not any(pid_alive(p) for p in b_pids), "the other node's workers survived"
