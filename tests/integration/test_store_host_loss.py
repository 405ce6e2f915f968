"""Losing the embedded store's host is reported within seconds, not minutes.

Two agents on loopback: ``a`` hosts the store, ``b`` connects to it. ``a`` is
SIGKILLed with its workers. Nothing listens on the store's port any more, so
every reconnection of ``b`` is refused: that is not a blip, the store is gone.
``b`` stops its workers and exits non-zero with an error naming the store's
address within about 10 s (it used to retry for ``read_timeout``, 60 s),
whether its workers noticed first (gloo: the dead peer's reset fails them at
once) or not (workers that do not talk to each other: only the store tells).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import BOUND, job
from tests.integration.test_node_loss_disconnect import QUIET_WORKER

REPORT_BOUND = 15.0  # the refusal window (5 s) plus stopping workers, on a loaded machine


def flags(port: int, *, host: bool) -> list[str]:
    return [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=hostloss",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=10,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
    ]


@pytest.mark.parametrize("workers", ["gloo", "quiet"])
def test_the_other_node_reports_a_killed_store_host_within_seconds(
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
        t = time.monotonic()
        a.kill_group()
        code = b.wait(BOUND)
        took = time.monotonic() - t
        out = b.output()
        print(f"store host killed ({workers} workers): the other agent exited {code} "
              f"after {took:.1f} s")  # fmt: skip
        assert code != 0, out[-3000:]
        assert took < REPORT_BOUND, f"took {took:.1f} s:\n{out[-3000:]}"
        assert f"127.0.0.1:{port}" in out, f"the error does not name the store:\n{out[-3000:]}"
        assert "connection refused" in out, out[-3000:]
        own = [line for line in out.splitlines() if not line.startswith("[")]  # not workers'
        assert not any(line.startswith("Traceback") for line in own), out[-3000:]
        assert not any(pid_alive(p) for p in b_pids), "the other node's workers survived"
