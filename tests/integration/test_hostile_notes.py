"""Job notes written by an attacker: anyone who reaches a store without a token
can write any note. Real agents, a real embedded store, a raw store client
for the attacker, and ``elastrun status`` as a real command.

* hostile bytes under note names (``[`` repeated 100000 times, oversized,
  wrong-typed, escapes) are dropped by ``read_note`` and ``gather_notes``,
  never raised; a hang's round replaces the stacks notes; progress notes
  vanish with their node's lease; status shows the stacks only of the round
  the records say ended on a hang;
* fake ``progress_*``, ``stragglers`` and ``stacks_*`` notes full of terminal
  escapes, for a job that never hung: status (table, ``--json``, ``--watch``)
  prints no escape byte, no stacks section and no straggler; with 10 MB of
  junk notes in the store it still prints the job;
* a real two-node hang (workers reporting progress through
  ``elastrun.train.heartbeat``: the notes, not torch, are what is tested) while
  the attacker keeps overwriting the stacks notes: the declaring agent
  survives and prints the other node's stacks or says they were unreadable;
  the job restarts and ends without waiting out the join timeout;
* a worker's error file with escapes: the failure summary shows them escaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.keys import Keys
from elastrun.status.summary import read_summary
from elastrun.store.client import TcpStore
from elastrun.store.server import StoreServer
from tests.helpers import free_port, stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN
from tests.integration.test_hangs import stacks_block, two_node_hang

SCRIPTS = Path(__file__).parent / "scripts"
BOUND = 150.0  # a whole job on a loaded 2-core machine
CLI_BOUND = 30.0
ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31mFAKE ALERT: rank 0 is a straggler\x1b[0m"
# Any control character a terminal acts on (newline and tab aside).
RAW_CONTROL = re.compile(b"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")
NESTED = b"[" * 100000


def _note(**fields: Any) -> bytes:
    return json.dumps({"v": 1, **fields}).encode()


def hostile_notes(round_: int, node_id: str) -> dict[str, bytes]:
    """What the attacker writes: fake progress, straggler and stacks notes
    (escapes everywhere, nested, oversized, wrong-typed, from non-members)."""
    rank = {"step": 1, "step_time": 9.0, "own_time": 9.0, "phase": ESC, "straggler": True}
    notes = {
        # the real node's id and round, but a rank that is not its own
        "progress_0": _note(
            round=round_,
            group_rank=0,
            node_id=node_id,
            host=ESC,
            at=time.time(),
            ranks=[{"rank": 1, **rank}, {"rank": 7, **rank}],
        ),
        "progress_1": _note(round=round_, group_rank=1, node_id="x", host=ESC, at=1.0, ranks=[]),
        "progress_2": _note(round=round_, host=ESC, ranks=[{"rank": "0", "phase": ESC}]),
        "progress_3": NESTED,
        "stragglers": _note(
            round=round_,
            at=1.0,
            median=0.01,
            stragglers=[{"rank": r, "own_time": 9.0} for r in (0, 1)],
        ),
    }
    for r in range(round_ + 2):
        notes[f"stacks_{r}_0"] = _note(
            round=r,
            group_rank=0,
            node_id=node_id,
            ranks=[{"rank": 0, "host": ESC, "frames": [ESC], "in_torch": False, "hung": True}],
        )
        notes[f"stacks_{r}_1"] = NESTED
        notes[f"stacks_{r}_2"] = _note(round=r, ranks=[[[[[[ESC]]]]]] * 3)
        notes[f"stacks_{r}_3"] = _note(round=r, ranks="x" * (N.NOTE_MAX_BYTES + 1))
    return notes


async def _write(port: int, run_id: str, notes: dict[str, bytes]) -> None:
    store = await TcpStore.connect("127.0.0.1", port, timeout=CLI_BOUND)
    try:
        keys = Keys(RunId(run_id))
        for name, value in notes.items():
            await store.put(keys.note(name), value)
    finally:
        await store.close()


async def _node_ids(port: int, run_id: str) -> list[str]:
    store = await TcpStore.connect("127.0.0.1", port, timeout=CLI_BOUND)
    try:
        kvs, _ = await store.get_prefix(Keys(RunId(run_id)).nodes)
        return [kv.key.rsplit("/", 1)[-1] for kv in kvs]
    finally:
        await store.close()


def status(port: int, run_id: str, *flags: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*ELASTRUN, "status", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", *flags],
        capture_output=True,
        timeout=CLI_BOUND,
        check=False,
    )


def assert_clean(*outputs: bytes) -> None:
    for out in outputs:
        found = RAW_CONTROL.search(out)
        assert found is None, f"raw control byte {found.group()!r} in {out[-3000:]!r}"


# -- the rendezvous' notes, in process, over a real TCP store ---------------------------


def test_hostile_notes_are_dropped_and_notes_keep_their_lifetime() -> None:
    async def scenario() -> None:
        async with StoreServer("127.0.0.1", 0) as server:
            host, port = server.address or ("127.0.0.1", 0)
            store = await TcpStore.connect(host, port)
            settings = RendezvousSettings(
                run_id=RunId("notes-life"),
                min_nodes=1,
                max_nodes=1,
                max_restarts=3,
                lease_ttl=30.0,
                last_call_timeout=0.1,
            )
            rdzv = DynamicRendezvous(store, settings, node_id="a")
            result = await rdzv.next_round()
            await _write(port, "notes-life", hostile_notes(result.round, "a"))
            await _write(port, "notes-life", {"stacks_99_0": _note(round=99, ranks=[])})

            # Dropped, never raised; a wait for a note that never decodes is bounded.
            seats = N.seats([("a", 0, 1), ("b", 1, 1), ("c", 2, 1), ("d", 3, 1)])
            assert await rdzv.read_note(N.StacksNote, 0, seats[1]) is None
            assert await rdzv.read_note(N.ProgressNote, result.round, seats[3]) is None
            assert await rdzv.read_note(N.StacksNote, 0, seats[3]) is None  # over the limit
            got = await asyncio.wait_for(
                rdzv.gather_notes(N.StacksNote, 0, [seats[1], seats[3]], 1.0), CLI_BOUND
            )
            assert got == {}

            # A progress note is on the node's lease.
            mine = N.ProgressNote(result.round, 0, "a", "h", 1.0, ())
            await rdzv.write_note(mine)
            kv = await store.get(rdzv.keys.note("progress_0"))
            assert kv is not None and kv.lease == rdzv.keeper.lease != 0

            # No round ended on a hang: status shows no stacks, whatever the notes say.
            summary = await read_summary(store, RunId("notes-life"))
            assert summary is not None and summary.hang_stacks is None

            # A hang opens the next round: every stacks note so far is gone.
            hang = FailureRecord(host="h", rank=0, hang="rank 0 made no progress for 5s")
            await rdzv.request_restart(hang)
            stacks_left, _ = await store.get_prefix(rdzv.keys.note(N.STACKS_PREFIX))
            assert stacks_left == []
            await rdzv.next_round()
            own = {"rank": 0, "host": "h", "frames": ["mine (m.py:1)"], "in_torch": False}
            note = N.StacksNote.from_json(
                {"round": 0, "group_rank": 0, "node_id": "a", "ranks": [own]}
            )
            await rdzv.write_note(note)
            await _write(port, "notes-life", {"stacks_0_1": NESTED})  # no such member
            summary = await read_summary(store, RunId("notes-life"))
            assert summary is not None and summary.to_json()["hang_stacks"] == {
                "round": 0,
                "ranks": [{**own, "hung": False}],
            }

            # The node leaves: its progress note goes with its lease.
            await rdzv.shutdown()
            assert await store.get(rdzv.keys.note("progress_0")) is None
            await store.close()

    asyncio.run(asyncio.wait_for(scenario(), BOUND))


# -- elastrun status against a real job ----------------------------------------------


@contextlib.contextmanager
def agent(*args: str, stdout: Any = subprocess.DEVNULL) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [*ELASTRUN, *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        stop_groups(proc)


def test_status_shows_no_fake_hang_straggler_or_escape_and_reads_10_mb_of_notes(
    tmp_path: Path,
) -> None:
    port, run_id = free_port(), "hostile-notes"
    flags = [
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=is_host=1",
        "--no-warm",
    ]
    with agent(*flags, str(SCRIPTS / "sleeper.py"), str(tmp_path)):

        def running() -> dict[str, Any] | None:
            proc = status(port, run_id, "--json")
            s = json.loads(proc.stdout) if proc.returncode == 0 else None
            return s if s is not None and s["state"] == "running" else None

        s = wait_for(running, BOUND, "the job running", interval=0.5)
        (node_id,) = asyncio.run(_node_ids(port, run_id))
        asyncio.run(_write(port, run_id, hostile_notes(s["round"], node_id)))

        table = status(port, run_id)
        assert table.returncode == 0, table.stderr
        assert_clean(table.stdout, table.stderr)
        assert f"job {run_id}".encode() in table.stdout
        assert b"stacks at the last hang" not in table.stdout
        assert b"STRAGGLER" not in table.stdout and b"FAKE" not in table.stdout
        as_json = status(port, run_id, "--json")
        assert as_json.returncode == 0
        assert_clean(as_json.stdout)
        s = json.loads(as_json.stdout)
        assert s["hang_stacks"] is None and s["stragglers"] == [] and s["ranks"] == []

        # --watch (into a file: the lines that change) while the notes change
        watch_out = tmp_path / "watch.txt"
        with open(watch_out, "wb") as out:
            watch = subprocess.Popen(
                [
                    *ELASTRUN,
                    "status",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id={run_id}",
                    "--watch",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for(lambda: watch_out.stat().st_size, CLI_BOUND, "the watch's first table")
            asyncio.run(_write(port, run_id, hostile_notes(s["round"] + 1, node_id)))
            asyncio.run(_write(port, run_id, {"progress_1": _note(round=0, host=ESC)}))
            watch.send_signal(signal.SIGINT)
            assert watch.wait(CLI_BOUND) == 0
        finally:
            stop_groups(watch)
        assert_clean(watch_out.read_bytes())
        assert b"STRAGGLER" not in watch_out.read_bytes()

        # 10 MB of notes: junk under any name, and over the limit under the names status reads
        junk = {f"junk_{i}": os.urandom(N.NOTE_MAX_BYTES) for i in range(36)}
        junk |= {"progress_0": b"[" * (1 << 20), "stragglers": os.urandom(1 << 20)}
        asyncio.run(_write(port, run_id, junk))
        assert sum(len(v) for v in junk.values()) > 10 * 1024 * 1024
        for fmt in ([], ["--json"]):
            proc = status(port, run_id, *fmt)
            assert proc.returncode == 0, proc.stderr
            assert run_id.encode() in proc.stdout and b"running" in proc.stdout
            assert_clean(proc.stdout, proc.stderr)


# -- a real two-node hang under a hostile writer ----------------------------------------


class HostileWriter:
    """Keeps overwriting the stacks notes of rounds 0 and 1 (nested JSON, and
    notes from no member) until stopped."""

    def __init__(self, port: int, run_id: str) -> None:
        self.port, self.run_id = port, run_id
        self.stop = threading.Event()
        self.writes = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        with contextlib.suppress(Exception):
            store = await TcpStore.connect("127.0.0.1", self.port, timeout=60.0)
            keys = Keys(RunId(self.run_id))
            forged = _note(
                round=0, group_rank=1, node_id="nobody", ranks=[{"rank": 0, "host": ESC}]
            )
            while not self.stop.is_set():
                value = NESTED if self.writes % 2 == 0 else forged
                for name in ("stacks_0_0", "stacks_0_1", "stacks_1_0", "stacks_1_1"):
                    await store.put(keys.note(name), value)
                self.writes += 1
                await asyncio.sleep(0.2)
            await store.close()


# The hang for the hostile writer: the agents' reading of the notes is what is
# tested, so no torch (no DDP, no warm interpreter importing it). Progress
# through elastrun.train.heartbeat (heartbeat_worker.py hang): rank 1's first
# attempt stops after 5 steps, the other rank steps until stopped; the
# restart's attempt steps a few times and ends.
HEARTBEATS = SCRIPTS / "heartbeat_worker.py"


def test_a_hostile_stacks_note_during_a_real_hang_kills_no_agent(tmp_path: Path) -> None:
    port, run_id = free_port(), "hostile-hang"
    writer = HostileWriter(port, run_id)
    procs: list[subprocess.Popen[str]] = []
    errs: dict[str, str] = {}
    try:
        for name in ("a", "b"):
            # A crashed agent would leave the other waiting 600 s: past BOUND.
            last = ["--no-warm", str(HEARTBEATS), str(tmp_path), "hang"]
            procs.append(two_node_hang(name, port, run_id, tmp_path, 1, ",join_timeout=600", last))
            if name == "a":
                writer.thread.start()  # it waits for the store to listen
        for name, p in zip("ab", procs, strict=True):
            _, errs[name] = p.communicate(timeout=BOUND)
    finally:
        writer.stop.set()
        stop_groups(*procs)
        writer.thread.join(10)
    assert writer.writes > 0
    for name, p in zip("ab", procs, strict=True):
        assert p.returncode == 0, errs[name][-3000:]
        assert "RecursionError" not in errs[name] and "\x1b" not in errs[name], errs[name][-3000:]
    declared = [e for e in errs.values() if "Python stacks when the hang was declared" in e]
    assert declared, errs
    for err in declared:
        *ranks, block = stacks_block(err)
        # its own rank, and the other node's, or a line saying why there is none
        assert len(ranks) == 2 or (len(ranks) == 1 and "no stacks from:" in block), block


# -- the failure summary ---------------------------------------------------------------


def test_the_failure_summary_escapes_a_worker_s_error_file(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *ELASTRUN,
            "--nproc-per-node=1",
            "--max-restarts=0",
            "--no-warm",
            str(SCRIPTS / "escape_error.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=BOUND,
        check=False,
    )
    assert proc.returncode != 0
    err = proc.stderr
    assert b"ROOT CAUSE" in err, err[-3000:]
    assert_clean(err)
    assert b"error: boom \\x1b]0;owned\\x07\\x1b[2J" in err
    assert b"\\x1b[31mRuntimeError: forged" in err
