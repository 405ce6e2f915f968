"""Node loss on the embedded store is detected by the dropped connection, not
the lease TTL: a SIGKILLed agent's socket is closed by its kernel, the store
cuts its lease to the disconnect grace, and the survivors re-form long before
``lease_ttl`` (60 s here) would have run out.

The workers here do not talk to each other (no collective): with gloo, the
survivors' workers would fail on the dead peer's reset and the job would
re-form through that failure whatever the store does. Here only the store can
tell the survivors that a node is gone.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import BOUND, job, steps_after

LEASE_TTL = 60
WELL_BEFORE_TTL = 30.0

# A "training" worker that needs no peer: it logs a step every 0.2 s in the
# format of scripts/elastic_worker.py (so the harness can read and clean up
# after it) until the ``finish`` control file appears.
QUIET_WORKER = r"""
import json, os, time
from pathlib import Path

DIR = Path(os.environ["ELASTIC_TEST_DIR"])
record = {
    "rank": int(os.environ["RANK"]),
    "world": int(os.environ["WORLD_SIZE"]),
    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "pid": os.getpid(),
}
step = 0
while not (DIR / "finish").exists():
    step += 1
    line = json.dumps(dict(record, step=step)) + "\n"
    fd = os.open(DIR / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    time.sleep(0.2)
"""


def flags(port: int, *, host: bool) -> list[str]:
    return [
        "--nnodes=2:3",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=disconnect",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl={LEASE_TTL},join_timeout=60,"
        f"is_host={int(host)}",
        "--shutdown-timeout=5",
        "--no-warm",  # the worker never imports torch: no warm interpreter to import it
    ]


def test_sigkilled_agent_is_dropped_well_before_its_lease_ttl(tmp_path: Path) -> None:
    port = free_port()
    worker = tmp_path / "quiet_worker.py"
    worker.write_text(QUIET_WORKER)
    with job(tmp_path) as j:
        # an absolute path: SCRIPTS / it is it
        a = j.start_agent("a", flags(port, host=True), script=str(worker))
        b = j.start_agent("b", flags(port, host=False), script=str(worker))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        mark = len(j.steps())
        c = j.start_agent("c", flags(port, host=False), script=str(worker))  # group rank 2
        wait_for(
            lambda: steps_after(j, mark, lambda s: s["world"] == 3 and s["group_rank"] == 2),
            BOUND,
            "node c training at world 3",
        )

        c_pids = {s["pid"] for s in j.steps() if s["world"] == 3 and s["group_rank"] == 2}
        assert c_pids, "node c has no worker at world 3"
        mark = len(j.steps())
        t = time.monotonic()
        c.kill_group()  # agent and workers, no goodbye
        wait_for(
            lambda: steps_after(j, mark, lambda s: s["world"] == 2),
            WELL_BEFORE_TTL,
            f"world 2 well before the lease TTL ({LEASE_TTL} s)",
        )
        print(f"node loss (lease_ttl={LEASE_TTL}): world 2 after {time.monotonic() - t:.1f}s")
        assert not any(pid_alive(p) for p in c_pids), "the killed node's workers survived"
        # A membership change, not a restart.
        assert max(s["restart"] for s in j.steps()) == 0

        j.touch("finish")
        for agent in (a, b):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
