"""The operator's view, end to end: ``elastrun status`` against a real job on
the embedded store (real agents, real gloo workers, loopback), and the agents'
event logs telling the same story.

Scenario: two agents train at world 2 (one hosts the store, is_host=1); a third
joins (world 3); a worker crashes (restart 1 of the budget); the job finishes.
At each stage ``elastrun status --json`` shows the round, members and restart
count; ``elastrun status --watch --json`` follows it to the end; the merged
event logs hold the rounds, the root-cause exit, the restart and the finish,
in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.store.memory import MemoryStore
from tests.helpers import free_port, stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN, job
from tests.store.etcd_fixture import requires_etcd, start_cluster

BOUND = 90.0  # generous: a loaded 2-core machine
CLI_BOUND = 30.0
RUN_ID = "status-e2e"


def flags(port: int, *, host: bool, events: Path) -> list[str]:
    return [
        "--nnodes=1:3",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={RUN_ID}",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={events}",
    ]


def status(*args: str, timeout: float = CLI_BOUND) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ELASTRUN, "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def status_json(port: int) -> dict[str, Any]:
    proc = status("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID, "--json")
    assert proc.returncode == 0, proc.stderr
    summary: dict[str, Any] = json.loads(proc.stdout)
    return summary


def wait_status(port: int, pred: Any, what: str) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def check() -> dict[str, Any] | None:
        s = status_json(port)
        seen.append(s)
        return s if pred(s) else None

    try:
        result: dict[str, Any] = wait_for(check, BOUND, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last status: {seen[-1] if seen else None}") from None
    return result


def worlds(s: dict[str, Any]) -> int:
    return int(s["world_size"])


def read_events(paths: list[Path]) -> list[dict[str, Any]]:
    events = []
    for path in paths:
        for line in path.read_text().splitlines():
            events.append(json.loads(line))
    return sorted(events, key=lambda e: e["ts"])


@contextlib.contextmanager
def background(args: list[str], out: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(out, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_groups(proc)


def first_index(events: list[dict[str, Any]], start: int, pred: Any, what: str) -> int:
    for i in range(start, len(events)):
        if pred(events[i]):
            return i
    kinds = [(e["kind"], e.get("source")) for e in events[start:]]
    raise AssertionError(f"no {what} after event {start}; events after it: {kinds}")


def test_status_and_event_log_tell_the_job_story(tmp_path: Path) -> None:
    port = free_port()
    ev = {name: tmp_path / f"events-{name}.jsonl" for name in "abc"}
    with job(tmp_path) as j:
        j.start_agent("a", flags(port, host=True, events=ev["a"]))
        j.start_agent("b", flags(port, host=False, events=ev["b"]))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")

        s1 = wait_status(port, lambda s: s["state"] == "running" and worlds(s) == 2, "world 2")
        assert s1["run_id"] == RUN_ID and s1["v"] == 1
        assert s1["members_round"] == s1["round"]
        assert [m["group_rank"] for m in s1["members"]] == [0, 1]
        assert all(m["status"] == "alive" and m["nproc"] == 1 for m in s1["members"])
        assert all(m["addr"] == "127.0.0.1" for m in s1["members"])
        assert (s1["restarts"], s1["max_restarts"], s1["last_failure"]) == (0, 3, None)
        assert (s1["min_nodes"], s1["max_nodes"]) == (1, 3)
        # Round timing, for the operator (wall clock of the agents' host).
        opened, closed = s1["round_opened_at"], s1["round_closed_at"]
        assert isinstance(opened, float) and isinstance(closed, float), s1
        assert opened <= closed <= time.time() + 1
        assert isinstance(s1["state_for_s"], float) and s1["state_for_s"] >= 0

        # Follow the rest of the job with --watch (stops by itself when the job ends).
        watch_out = tmp_path / "watch.jsonl"
        watch_args = [*ELASTRUN, "status", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        watch_args += ["--rdzv-id", RUN_ID, "--json", "--watch"]
        with background(watch_args, watch_out) as watcher:
            wait_for(lambda: watch_out.stat().st_size, CLI_BOUND, "the watch's first line")

            mark = len(j.steps())
            j.start_agent("c", flags(port, host=False, events=ev["c"]))
            wait_for(
                lambda: any(s["world"] == 3 for s in j.steps()[mark:]), BOUND, "training at world 3"
            )
            s2 = wait_status(port, lambda s: s["state"] == "running" and worlds(s) == 3, "world 3")
            assert s2["round"] > s1["round"]
            assert [m["group_rank"] for m in s2["members"]] == [0, 1, 2]
            # Joins are membership changes: not counted against the budget.
            assert s2["restarts"] == 0 and s2["last_failure"] is None
            # Sticky ranks: the two first nodes kept theirs.
            old = {m["node_id"]: m["group_rank"] for m in s1["members"]}
            assert all(
                m["group_rank"] == old[m["node_id"]] for m in s2["members"] if m["node_id"] in old
            )

            mark = len(j.steps())
            j.touch("crash_rank_1")
            wait_for(
                lambda: any(s["restart"] == 1 for s in j.steps()[mark:]),
                BOUND,
                "training after the crash",
            )
            s3 = wait_status(
                port, lambda s: s["state"] == "running" and s["restarts"] == 1, "restart 1"
            )
            assert s3["round"] > s2["round"] and worlds(s3) == 3
            failure = s3["last_failure"]
            assert failure is not None and failure["rank"] == 1, failure
            assert failure["exitcode"] == 1 and failure["reason"] == "worker_failed"
            assert isinstance(failure["time"], float) and failure["host"]

            # The readable table says the same.
            table = status("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID)
            assert table.returncode == 0, table.stderr
            assert "state     running for " in table.stdout, table.stdout
            assert "restarts  1 of 3" in table.stdout
            assert "(opened: restart_requested: rank 1 on " in table.stdout, table.stdout
            assert "last failure: rank 1" in table.stdout, table.stdout

            j.touch("finish")
            for agent in j.agents:
                assert agent.wait(BOUND) == 0, agent.output()[-3000:]
                # Every member says the one restart charged, once the next round formed;
                # c's join is said not counted, as it was not charged.
                said_counts = re.findall(r"restarting workers \(restart (\d+)/3\)", agent.output())
                assert said_counts == ["1"], agent.output()[-3000:]
            assert watcher.wait(CLI_BOUND) == 0, watch_out.read_text()[-3000:]

    # --watch: one JSON object per change, in order, ending with the finished job.
    watched = [json.loads(line) for line in watch_out.read_text().splitlines()]
    assert watched[-1]["state"] == "finished", watched[-1]
    assert watched[-1]["restarts"] == 1 and worlds(watched[-1]) == 3
    order = [
        next(i for i, s in enumerate(watched) if s["state"] == "running" and worlds(s) == 2),
        next(i for i, s in enumerate(watched) if s["state"] == "running" and worlds(s) == 3),
        next(i for i, s in enumerate(watched) if s["restarts"] == 1),
        len(watched) - 1,
    ]
    assert order == sorted(order), [(s["state"], worlds(s), s["restarts"]) for s in watched]
    revisions = [s["revision"] for s in watched]
    assert revisions == sorted(revisions)

    # The merged event logs tell the same story, in order.
    events = read_events(list(ev.values()))
    for e in events:
        assert e["v"] == 1 and isinstance(e["ts"], float) and e["run_id"] == RUN_ID, e
        assert e["host"] and e["source"] in ("launcher", "rendezvous", "agent"), e
        if e["source"] != "launcher" or e["kind"] == "agent_exited":
            assert e.get("node_id"), e
    closed = [e for e in events if e["kind"] == "round_closed"]
    assert [e["round"] for e in closed] == sorted({e["round"] for e in closed}), closed
    # Each node's warm interpreter serves every round: none is discarded for a
    # variable that changes from round to round (the round, the progress interval).
    discarded = [e["reason"] for e in events if e["kind"] == "warm_discarded"]
    assert not [r for r in discarded if r.startswith("started with a different")], discarded
    i2 = first_index(
        events, 0, lambda e: e["kind"] == "round_closed" and len(e["ranks"]) == 2, "w2"
    )
    i3 = first_index(
        events, i2, lambda e: e["kind"] == "round_closed" and len(e["ranks"]) == 3, "w3"
    )
    assert sorted(events[i3]["ranks"].values()) == [0, 1, 2]
    crash = first_index(
        events,
        i3,
        lambda e: e["kind"] == "worker_exited" and e["cause"] == "root_cause",
        "root-cause exit",
    )
    # Rank 1's exit is its node's root cause. A peer node's rank whose collective
    # broke may log its own first (`root_cause` is per node: the first of the
    # node's workers to fail); the job's root cause is rank 1 (the status above).
    rank1 = [
        e
        for e in events[i3:]
        if e["kind"] == "worker_exited" and e["cause"] == "root_cause" and e["rank"] == 1
    ]
    assert rank1 and rank1[0]["exitcode"] == 1, events[crash]
    assert rank1[0]["round"] == events[crash]["round"]
    restart = first_index(
        events,
        crash,
        lambda e: e["kind"] == "restart" and e["reason"] == "worker_failed",
        "restart",
    )
    assert events[restart]["count"] == 1 and events[restart]["counted"] is True
    # Every restart event says what the rendezvous charged: the crash's round,
    # counted, restart 1, on each of its 3 members; c's join, not counted, 0.
    crashed = events[crash]["round"]
    charges = [
        (e["round"] == crashed, e["counted"], e["count"]) for e in events if e["kind"] == "restart"
    ]
    assert sorted(set(charges)) == [(False, False, 0), (True, True, 1)], charges
    assert charges.count((True, True, 1)) == 3, charges
    reopened = first_index(
        events,
        crash,
        lambda e: e["kind"] == "round_opened" and e["reason"] == "restart_requested",
        "round opened for the restart",
    )
    first_index(events, reopened, lambda e: e["kind"] == "round_closed", "round closed after it")
    finished = [e for e in events if e["kind"] == "job_finished" and e["source"] == "agent"]
    assert len(finished) == 3 and all(e["exit_code"] == 0 for e in finished)
    assert sum(e["kind"] == "job_finished" and e["source"] == "rendezvous" for e in events) == 1
    assert min(events.index(e) for e in finished) > restart
    exits = [e for e in events if e["kind"] == "agent_exited"]
    assert [e["exit_code"] for e in exits] == [0, 0, 0]
    # One file per agent, each with its own node id throughout, and its own
    # membership history: a round_joined for each round its workers ran in.
    for path in ev.values():
        mine = read_events([path])
        ids = {e.get("node_id") for e in mine} - {None}
        assert len(ids) == 1, (path.name, ids)
        joined = [e for e in mine if e["kind"] == "round_joined"]
        started = [e for e in mine if e["kind"] == "workers_started"]
        assert [e["round"] for e in joined] == [e["round"] for e in started], path.name
        for jn, st in zip(joined, started, strict=True):
            assert (jn["group_rank"], jn["world_size"]) == (st["group_rank"], st["world_size"])
            assert jn["master"] == st["master"] and jn["members"] == jn["group_world_size"]
    # c came while the group ran: it waited for the next round, then joined it.
    c_events = read_events([ev["c"]])
    waited = first_index(c_events, 0, lambda e: e["kind"] == "node_waiting", "c waiting")
    assert "closed without this node" in c_events[waited]["reason"], c_events[waited]
    first_index(c_events, waited, lambda e: e["kind"] == "round_joined", "c joining")

    # The same logs drawn as a self-contained HTML timeline.
    page = tmp_path / "timeline.html"
    proc = subprocess.run(
        [*ELASTRUN, "timeline", *map(str, ev.values()), "--out", str(page)],
        capture_output=True,
        text=True,
        timeout=CLI_BOUND,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    svg = text[text.index("<svg") : text.index("</svg>") + len("</svg>")]
    ElementTree.fromstring(svg)  # well-formed
    head = text[text.index("<h2>") : text.index("</h2>")]
    # every restart once, and how many the rendezvous charged: the crash's
    # alone (the status above: 1); c's join re-formed the group uncharged.
    restarts = {e["round"] for e in events if e["kind"] == "restart"}
    assert len(restarts) == 2, restarts
    assert "3 nodes" in head and "2 restarts (1 counted)," in head, head
    assert f"round {closed[-1]['round']}" in svg
    assert "rank 1 on" in text and "<script" not in text


def test_a_standalone_job_prints_the_status_command_that_finds_it(tmp_path: Path) -> None:
    """--standalone picks a free port and an id: the job says both, as the
    ``elastrun status`` command to run, and that command shows the job."""
    finish = tmp_path / "finish"
    (tmp_path / "wait.py").write_text(
        "import os, time\n"
        "deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(finish)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n"
    )
    out = tmp_path / "agent.log"
    args = [*ELASTRUN, "--standalone", "--nproc-per-node=2", str(tmp_path / "wait.py")]
    with background(args, out) as agent:
        line = wait_for(
            lambda: next(
                (ln for ln in out.read_text().splitlines() if "standalone job" in ln), None
            ),
            CLI_BOUND,
            "the standalone job's line",
        )
        said = re.fullmatch(
            r"elastrun: standalone job (\S+), store on (127\.0\.0\.1:\d+) "
            r"\((elastrun status [^)]*)\)",
            line,
        )
        assert said, line
        run_id, endpoint, command = said.groups()
        given = shlex.split(command)[2:]
        assert given == [f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"], command

        def running() -> dict[str, Any] | None:
            proc = status(*given, "--json")
            assert proc.returncode in (0, 1), proc.stderr
            shown = json.loads(proc.stdout) if proc.returncode == 0 else None
            return shown if shown and shown["world_size"] == 2 else None

        shown = wait_for(running, BOUND, "status to show the job at world 2", interval=0.5)
        assert shown["run_id"] == run_id and len(shown["members"]) == 1
        finish.touch()
        assert agent.wait(BOUND) == 0, out.read_text()[-3000:]


def test_status_of_unknown_job_says_so(tmp_path: Path) -> None:
    out = tmp_path / "store.log"
    with background([*ELASTRUN, "store", "serve", "--port", "0"], out) as server:
        line = wait_for(
            lambda: next((ln for ln in out.read_text().splitlines() if "listening on" in ln), None),
            CLI_BOUND,
            "the store to listen",
        )
        endpoint = line.rsplit(" ", 1)[-1]
        for extra in ([], ["--json"]):  # each bounded: status() has a timeout
            proc = status("--rdzv-endpoint", endpoint, "--rdzv-id", "nope", *extra)
            assert proc.returncode == 1, (extra, proc.stdout, proc.stderr)
            assert f"no job 'nope' in the store at {endpoint}" in proc.stderr, proc.stderr
            assert proc.stdout == ""
        # --watch waits for the job to register, saying so, until stopped.
        watch_log = tmp_path / "watch.log"
        args = [*ELASTRUN, "status", "--rdzv-endpoint", endpoint, "--rdzv-id", "nope", "--watch"]
        with background(args, watch_log) as watch:
            said = f"waiting for job 'nope' to register in the store at {endpoint}"
            wait_for(lambda: said in watch_log.read_text(), CLI_BOUND, "the watch to wait")
            assert watch.poll() is None, watch_log.read_text()
            watch.send_signal(signal.SIGTERM)
            assert watch.wait(CLI_BOUND) == 0, watch_log.read_text()
        assert watch_log.read_text().count("waiting for job") == 1, watch_log.read_text()
        assert server.poll() is None


def test_status_of_unreachable_endpoint_is_bounded(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    # It gives up on its own, naming the endpoint (status() fails the test
    # after CLI_BOUND if it did not).
    proc = status(
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x", "--timeout", "2", "--json"
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"127.0.0.1:{port}" in proc.stderr, proc.stderr
    # refused at once: said so, without --timeout's retries
    assert "nothing listens at" in proc.stderr and "connection refused" in proc.stderr
    assert proc.stdout == ""


def test_status_bad_arguments_exit_2() -> None:
    proc = status("--rdzv-id", "x")  # no endpoint
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr
    proc = status("--rdzv-endpoint", "127.0.0.1:notaport", "--rdzv-id", "x")
    assert proc.returncode == 2 and "notaport" in proc.stderr, proc.stderr


def test_summary_follows_an_in_process_rendezvous() -> None:
    """read_summary over real DynamicRendezvous nodes on an in-memory store."""
    from elastrun.rendezvous.api import RendezvousSettings
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.status import read_summary

    def settings(host: str) -> RendezvousSettings:
        return RendezvousSettings(
            run_id=RunId("j"), min_nodes=2, max_nodes=2, max_restarts=1, nproc=2, host=host,
            addr=f"10.0.0.{ord(host[-1]) - 96}", join_timeout=30, last_call_timeout=0.1,
        )  # fmt: skip

    async def summary_where(store: MemoryStore, pred: Any) -> dict[str, Any]:
        for _ in range(400):
            summary = await read_summary(store, RunId("j"))
            s = None if summary is None else summary.to_json()  # as --json prints it
            if s is not None and pred(s):
                return s
            await asyncio.sleep(0.025)
        raise AssertionError(f"no such summary; last: {s}")

    async def scenario() -> None:
        store = MemoryStore()
        assert await read_summary(store, RunId("j")) is None
        a = DynamicRendezvous(store, settings("ha"), node_id="a")
        b = DynamicRendezvous(store, settings("hb"), node_id="b")
        ta = asyncio.ensure_future(a.next_round())
        s = await summary_where(store, lambda s: s["joined"])
        assert (s["state"], s["round"], s["members"]) == ("joining", 0, [])
        assert s["joined"] == [{"host": "ha", "node_id": "a", "nproc": 2}]
        ra, rb = await asyncio.wait_for(asyncio.gather(ta, b.next_round()), 30)
        s = await summary_where(store, lambda s: s["state"] == "running")
        assert [(m["host"], m["addr"], m["group_rank"], m["status"]) for m in s["members"]] == [
            ("ha", "10.0.0.1", 0, "alive"),
            ("hb", "10.0.0.2", 1, "alive"),
        ]
        assert s["world_size"] == 4 and s["master"] == f"10.0.0.1:{ra.master_port}"
        failure = FailureRecord(host="hb", rank=3, exitcode=1, time=1.5)
        await asyncio.wait_for(b.request_restart(failure), 30)
        s = await summary_where(store, lambda s: s["state"] == "restarting")
        # Charged when round 1 closes with both members back, not before.
        assert (s["round"], s["members_round"], s["restarts"]) == (1, 0, 0)
        assert s["restart_pending"] is True
        assert s["round_reason"] == "restart_requested"
        assert s["last_failure"]["rank"] == 3 and s["last_failure"]["host"] == "hb"
        await asyncio.wait_for(b.shutdown(), 30)
        s = await summary_where(store, lambda s: s["nodes_present"] == 1)
        assert [m["status"] for m in s["members"]] == ["alive", "lost"]
        await asyncio.wait_for(a.shutdown(), 30)
        assert rb.round == 0

    asyncio.run(scenario())


@pytest.mark.etcd
@requires_etcd
def test_status_reads_a_job_on_etcd() -> None:
    """The same summary from etcd v3 (real server): a job of two in-process
    rendezvous nodes, read by the ``elastrun status`` command."""
    from elastrun.rendezvous.api import RendezvousSettings
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.store.etcd_options import EtcdOptions
    from elastrun.store.factory import Backend, StoreOptions, open_store

    cluster = start_cluster(1)
    prefix = f"/status-test-{os.getpid()}"
    options = StoreOptions(etcd=EtcdOptions(key_prefix=prefix))
    base = ["--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints]
    base += ["--rdzv-conf", f"key_prefix={prefix},join_timeout=5"]

    def settings(host: str) -> RendezvousSettings:
        return RendezvousSettings(
            run_id=RunId("j"), min_nodes=2, max_nodes=2, nproc=1, host=host, addr="127.0.0.1",
            join_timeout=30, last_call_timeout=0.1, lease_ttl=5,
        )  # fmt: skip

    async def scenario() -> None:
        store = await open_store(Backend.ETCD, cluster.endpoints, options, timeout=10)
        a = DynamicRendezvous(store, settings("ha"), node_id="a")
        b = DynamicRendezvous(store, settings("hb"), node_id="b")
        try:
            ra, rb = await asyncio.wait_for(asyncio.gather(a.next_round(), b.next_round()), 30)
            proc = await asyncio.to_thread(status, *base, "--rdzv-id", "j", "--json")
            assert proc.returncode == 0, proc.stderr
            s = json.loads(proc.stdout)
            assert s["state"] == "running" and s["round"] == 0
            # Ranks follow join order, which the two concurrent joins decide.
            ranks = sorted([("ha", ra.group_rank), ("hb", rb.group_rank)], key=lambda x: x[1])
            assert [(m["host"], m["group_rank"]) for m in s["members"]] == ranks
            proc = await asyncio.to_thread(status, *base, "--rdzv-id", "nope")
            assert proc.returncode == 1
            assert f"no job 'nope' in the store at {cluster.endpoints}" in proc.stderr
        finally:
            for node in (a, b):
                await asyncio.wait_for(node.shutdown(), 30)
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()
