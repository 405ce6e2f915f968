"""The failure record a node reports: JSON both ways (versioned, older records
readable), one description, and what the agent puts in it."""

from __future__ import annotations

import json

import pytest

from elastrun.agent.error_files import ErrorFileInfo
from elastrun.agent.failures import (
    MAX_TAIL_LINE_CHARS,
    MAX_TAIL_LINES,
    MAX_TRACEBACK_CHARS,
    WorkerFailure,
    classify,
    failure_record,
)
from elastrun.failure import (
    FAILURE_RECORD_VERSION,
    FailedWorker,
    FailureRecord,
    describe_stored,
)


def worker(rank: int, rc: int, at: float, **kw: object) -> WorkerFailure:
    base: dict[str, object] = {
        "rank": rank, "local_rank": rank, "host": "node-a", "pid": 100 + rank,
        "returncode": rc, "exit_time": 1000.0 + at, "exit_monotonic": at,
    }  # fmt: skip
    return WorkerFailure(**{**base, **kw})  # type: ignore[arg-type]


def test_json_round_trip_is_exact_and_versioned() -> None:
    rec = FailureRecord(
        host="node-a", rank=1, local_rank=1, pid=7, signal="SIGKILL", time=12.5,
        role="root_cause", message="boom", traceback="tb", stderr_tail=("a", "b"),
        stderr_log="/l/err", error_file="/l/ef", attempt=2, restart_count=1,
        failures=(FailedWorker(1, None, "SIGKILL", "root_cause", False),),
    )  # fmt: skip
    data = json.loads(json.dumps(rec.to_json()))
    assert data["v"] == FAILURE_RECORD_VERSION
    assert FailureRecord.from_json(data) == rec


def test_a_record_without_a_version_is_read() -> None:
    """Records written before they had a version (the round's ``last_failure``
    of an older job) read as version 1."""
    old = {"reason": "worker_failed", "host": "h", "rank": 1, "exitcode": 3, "signal": None,
           "stderr_tail": ["x"], "failures": [{"rank": 1, "exitcode": 3}]}  # fmt: skip
    rec = FailureRecord.from_json(old)
    assert rec is not None
    assert (rec.host, rec.rank, rec.exitcode, rec.stderr_tail) == ("h", 1, 3, ("x",))
    assert rec.failures == (FailedWorker(rank=1, exitcode=3),)
    assert rec.describe() == "rank 1 on h exited with code 3"


def test_reading_is_lenient_with_newer_and_mistyped_records() -> None:
    newer = {"v": FAILURE_RECORD_VERSION + 1, "host": "h", "rank": 2, "signal": "SIGTERM",
             "something_new": {"a": 1}}  # fmt: skip
    rec = FailureRecord.from_json(newer)
    assert rec is not None and rec.describe() == "rank 2 on h was killed by SIGTERM"
    odd = {"host": 5, "rank": "1", "exitcode": True, "stderr_tail": "x", "failures": [3]}
    rec = FailureRecord.from_json(odd)
    assert rec == FailureRecord()  # every field its default; nothing raises
    assert rec.describe() == "workers failed on ?"


@pytest.mark.parametrize("raw", [None, {}, [], "rank 1", 3])
def test_no_record_describes_as_another_nodes_failure(raw: object) -> None:
    assert FailureRecord.from_json(raw) is None
    assert describe_stored(raw) == "workers failed on another node"


@pytest.mark.parametrize(
    ("rec", "line"),
    [
        (FailureRecord(host="a", rank=1, exitcode=1), "rank 1 on a exited with code 1"),
        (FailureRecord(host="a", rank=1, exitcode=0), "rank 1 on a exited with code 0"),
        (FailureRecord(host="a", rank=1, signal="SIGKILL"), "rank 1 on a was killed by SIGKILL"),
        (FailureRecord(host="a", rank=1), "rank 1 on a failed"),
        (FailureRecord(host="a"), "workers failed on a"),
        (FailureRecord(rank=0, exitcode=2), "rank 0 on ? exited with code 2"),
        (
            FailureRecord(host="a", rank=1, exitcode=-9, hang="rank 1 made no progress for 3 s"),
            "rank 1 made no progress for 3 s on a",
        ),
    ],
)
def test_one_description(rec: FailureRecord, line: str) -> None:
    assert rec.describe() == line
    assert describe_stored(rec.to_json()) == line


def test_the_agent_reports_its_root_cause_trimmed_for_the_store() -> None:
    long_tb = "x" * (MAX_TRACEBACK_CHARS + 100) + "END"
    tail = tuple(f"line {i} " + "y" * 400 for i in range(30))
    failures = classify(
        [
            worker(0, -15, 2.0, stopped_by_agent=True),
            worker(
                1, 1, 1.0, stderr_tail=tail, error=ErrorFileInfo("ValueError: bad", long_tb, None)
            ),
        ]
    )
    rec = failure_record(failures, "node-a")
    assert (rec.rank, rec.exitcode, rec.role, rec.message) == (
        1,
        1,
        "root_cause",
        "ValueError: bad",
    )
    assert rec.traceback is not None and len(rec.traceback) == MAX_TRACEBACK_CHARS
    assert rec.traceback.endswith("END")
    assert len(rec.stderr_tail) == MAX_TAIL_LINES
    assert rec.stderr_tail[-1].startswith("line 29") and len(rec.stderr_tail[-1]) == (
        MAX_TAIL_LINE_CHARS
    )
    assert [(f.rank, f.signal, f.role) for f in rec.failures] == [
        (1, None, "root_cause"),
        (0, "SIGTERM", "collateral"),
    ]
    assert rec.describe() == "rank 1 on node-a exited with code 1"


def test_with_no_root_cause_the_first_failure_is_reported() -> None:
    failures = classify([worker(3, -15, 1.0, stopped_by_agent=True)])
    rec = failure_record(failures, "node-a")
    assert (rec.rank, rec.signal, rec.stopped_by_agent) == (3, "SIGTERM", True)
    assert failure_record([], "node-b") == FailureRecord(host="node-b")
