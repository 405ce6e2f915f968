"""Error files (torch's format), root cause and the failure summary."""

from __future__ import annotations

import json
import signal

import pytest

from elastrun import record
from elastrun.agent.error_files import read_error_file
from elastrun.agent.failures import (
    COLLATERAL,
    OK,
    ROOT_CAUSE,
    Ending,
    WorkerFailure,
    classify,
    describe_exit,
    format_summary,
    roles,
)


def _raise_distinctive() -> None:
    raise KeyError("distinctive-key-42")


def test_reads_an_error_file_written_by_torch(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        _raise_distinctive()
    except KeyError as e:
        ErrorHandler().record_exception(e)
    info = read_error_file(str(path))
    assert info is not None
    assert info.message == "KeyError: 'distinctive-key-42'"
    assert info.traceback is not None and "_raise_distinctive" in info.traceback
    assert info.timestamp is not None and info.timestamp > 1_600_000_000


def test_elastrun_record_writes_torch_format(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main() -> None:
        _raise_distinctive()

    with pytest.raises(KeyError):
        main()
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    assert set(data["message"]) == {"message", "extraInfo"}
    assert set(data["message"]["extraInfo"]) == {"py_callstack", "timestamp"}
    info = read_error_file(str(path))
    assert info is not None and info.message == "KeyError: 'distinctive-key-42'"
    assert info.traceback is not None and "_raise_distinctive" in info.traceback


def test_record_passes_results_through_and_writes_nothing_on_success(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert record(lambda x: x + 1)(41) == 42
    assert not path.exists()


def test_unreadable_error_files():
    assert read_error_file(None) is None
    assert read_error_file("/nonexistent/error.json") is None


def test_old_format_and_garbage(tmp_path):
    p = tmp_path / "e.json"
    p.write_text(json.dumps({"message": "Signal 9 received", "timestamp": "12"}))
    info = read_error_file(str(p))
    assert info is not None and info.message == "Signal 9 received" and info.timestamp == 12
    p.write_text("not json at all")
    info = read_error_file(str(p))
    assert info is not None and info.traceback is None


def test_describe_exit():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL (9)"


def _f(rank: int, t: float, rc: int = 1, stopped: bool = False, **kw) -> WorkerFailure:
    return WorkerFailure(
        rank=rank,
        local_rank=rank,
        host="node-a",
        pid=1000 + rank,
        returncode=rc,
        exit_time=1_700_000_000 + t,
        exit_monotonic=t,
        stopped_by_agent=stopped,
        **kw,
    )


def test_root_cause_is_the_earliest_own_failure():
    out = classify(
        [
            _f(0, 5.0, rc=-signal.SIGTERM, stopped=True),
            _f(3, 2.0),
            _f(1, 1.0),
            _f(2, 0.5, stopped=True),
        ]
    )
    assert [(f.rank, f.role) for f in out] == [
        (1, ROOT_CAUSE),
        (3, COLLATERAL),
        (2, COLLATERAL),
        (0, COLLATERAL),
    ]


STACK = int(signal.SIGRTMIN) + 5


def test_a_rank_killed_by_the_agent_s_stack_signal_is_never_the_root_cause():
    # Its script changed the handler after the agent's check: the agent's doing.
    killed = Ending(-STACK, 1.0, agent_signals=frozenset({STACK}))
    crashed = Ending(1, 2.0)
    assert killed.by_agent and roles([killed, crashed]) == [COLLATERAL, ROOT_CAUSE]
    # Alone, it leaves no root cause on this node.
    assert roles([killed]) == [COLLATERAL]
    # The same signal the agent never sent (or another one): the rank's own failure.
    assert roles([Ending(-STACK, 1.0), crashed]) == [ROOT_CAUSE, COLLATERAL]
    other = Ending(-signal.SIGSEGV, 1.0, agent_signals=frozenset({STACK}))
    assert roles([other, crashed]) == [ROOT_CAUSE, COLLATERAL]
    # It exited by itself after the agent signalled it: its own failure.
    assert roles([Ending(1, 1.0, agent_signals=frozenset({STACK}))]) == [ROOT_CAUSE]


def test_a_hang_fails_at_its_declaration():
    # Declared at 3.0 while it ran (it exits later, stopped): the root cause
    # unless a rank failed by itself before.
    hung = Ending(-signal.SIGTERM, 3.0, stopped_by_agent=True, declared=True)
    later = Ending(1, 4.0)
    earlier = Ending(1, 2.0)
    assert roles([later, hung]) == [COLLATERAL, ROOT_CAUSE]
    assert roles([hung, earlier]) == [COLLATERAL, ROOT_CAUSE]
    # Still running when declared: the failure it will be.
    assert roles([Ending(None, 3.0, declared=True), later]) == [ROOT_CAUSE, COLLATERAL]


def test_roles_of_ranks_that_succeeded_were_stopped_or_tie():
    ok = Ending(0, 0.5)
    stopped = Ending(-signal.SIGTERM, 1.0, stopped_by_agent=True)
    assert roles([ok, stopped]) == [OK, COLLATERAL]  # no root cause here
    assert roles([Ending(1, 2.0), Ending(1, 2.0)]) == [ROOT_CAUSE, COLLATERAL]
    assert roles([]) == []


def test_the_event_s_cause_and_the_summary_agree():
    # classify marks a failure list by the same rule as each exit's event.
    failures = [
        _f(0, 5.0, rc=-signal.SIGTERM, stopped=True),
        _f(3, 2.0),
        _f(1, 1.0),
        _f(2, 0.5, stopped=True),
        _f(4, 3.0, hang="rank 4 made no progress for 10 s"),
    ]
    expected = roles([f.ending() for f in failures])
    by_rank = {f.rank: f.role for f in classify(failures)}
    assert [by_rank[f.rank] for f in failures] == expected


def test_summary_without_decorator_shows_stderr_tail_and_log_path():
    tail = tuple(f"line {i}" for i in range(30))
    failures = classify(
        [
            _f(1, 1.0, stderr_tail=tail, stderr_log="/logs/run/attempt_0/1/stderr.log"),
            _f(0, 2.0, rc=-signal.SIGTERM, stopped=True),
        ]
    )
    text = format_summary(failures, "job failed")
    root_at = text.index("[ROOT CAUSE] rank 1 (local rank 1) on node-a, pid 1001: exit code 1")
    assert text.index("collateral (stopped by elastrun)] rank 0") > root_at
    assert "signal SIGTERM (15)" in text
    assert "line 29" in text and "line 10" in text and "line 9\n" not in text
    assert "/logs/run/attempt_0/1/stderr.log" in text
    j = failures[0].to_json()
    assert j["rank"] == 1 and j["exitcode"] == 1 and j["signal"] is None
    assert json.loads(json.dumps(j)) == j
