"""The event catalogue (elastrun/event_kinds.py): docs/events.md documents
every kind and field of it and no other kind; every event reads back as
itself from its JSON line; no event is emitted as a free-form kind."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest

from elastrun.event_kinds import (
    CATALOGUE,
    Event,
    JobFailed,
    JobMarkedFailed,
    RoundOpened,
    WorkerExited,
    parse_event,
)
from elastrun.events import JsonLinesSink, ListSink
from elastrun.failure import FailureRecord

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "events.md"


def documented() -> dict[str, set[str]]:
    """kind -> the names in backticks in its rows' fields column, from the
    ``| kind | fields | when |`` tables of docs/events.md's event log part."""
    text = DOC.read_text(encoding="utf-8")
    text = text[text.index("## The event log") : text.index("## `elastrun status`")]
    rows: dict[str, set[str]] = {}
    in_table = False
    for line in text.splitlines():
        if line.startswith("| kind | fields | when |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        m = re.match(r"\| `([a-z_]+)` \| (.*?) \| ", line)
        if in_table and m:
            rows.setdefault(m.group(1), set()).update(re.findall(r"`([a-z_]+)`", m.group(2)))
    return rows


def test_every_kind_is_documented_and_every_documented_kind_is_in_the_catalogue() -> None:
    doc = documented()
    kinds = {cls.KIND for cls in CATALOGUE}
    assert set(doc) - kinds == set(), "documented, not in elastrun/event_kinds.py"
    assert kinds - set(doc) == set(), "in elastrun/event_kinds.py, not in docs/events.md"


@pytest.mark.parametrize("cls", CATALOGUE, ids=lambda c: c.__name__)
def test_every_field_is_documented(cls: type[Event]) -> None:
    names = {f for f in typing.get_type_hints(cls) if f not in {"KIND", "OMITTED"}}
    assert names - documented()[cls.KIND] == set(), f"{cls.KIND}: fields not in docs/events.md"


def sample(tp: object) -> object:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return sample(next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is list:
        return [sample(typing.get_args(tp)[0])]
    if origin is dict:
        key, value = typing.get_args(tp)
        return {sample(key): sample(value)}
    values: dict[object, object] = {
        int: 3,
        float: 1.5,
        str: "x",
        bool: True,
        Any: {"a": [1]},
        FailureRecord: FailureRecord(rank=1, host="h", exitcode=3, message="boom"),
    }
    return values[tp]


def example(cls: type[Event]) -> Event:
    hints = typing.get_type_hints(cls)
    names = [f for f in hints if f not in {"KIND", "OMITTED"}]
    return cls(**{name: sample(hints[name]) for name in names})


@pytest.mark.parametrize("cls", CATALOGUE, ids=lambda c: c.__name__)
def test_an_event_written_reads_back_as_itself(cls: type[Event], tmp_path: Path) -> None:
    event = example(cls)
    sink = JsonLinesSink(tmp_path / "e.jsonl", run_id="J", host="h", source="agent")
    sink.emit(event)
    sink.close()
    line = json.loads((tmp_path / "e.jsonl").read_text())
    assert line["kind"] == cls.KIND and line["v"] == 1 and line["run_id"] == "J"
    assert parse_event(line) == event


def test_the_line_is_the_fields_as_before() -> None:
    """The JSON written is what the free-form emits wrote: the same names and
    values, optional fields absent rather than null, a failure as its JSON."""
    sink = ListSink()
    failure = FailureRecord(rank=1, host="h", exitcode=3)
    sink.emit(RoundOpened(round=0, reason="job_started", node="n1"))
    sink.emit(JobFailed(exit_code=1, reason="restarts_exhausted", failure=failure))
    first, second = ({k: v for k, v in e.items() if k != "ts"} for e in sink.events)
    assert first == {
        "v": 1,
        "kind": "round_opened",
        "round": 0,
        "reason": "job_started",
        "node": "n1",
    }
    assert second == {
        "v": 1,
        "kind": "job_failed",
        "exit_code": 1,
        "reason": "restarts_exhausted",
        "failure": failure.to_json(),
    }


def test_a_kind_with_two_sources_reads_as_the_one_its_fields_say() -> None:
    assert parse_event(
        {"kind": "job_failed", "round": 4, "reason": "restart budget exhausted"}
    ) == (JobMarkedFailed(round=4, reason="restart budget exhausted"))
    assert parse_event({"kind": "job_failed", "exit_code": 1, "reason": "RendezvousTimeout"}) == (
        JobFailed(exit_code=1, reason="RendezvousTimeout")
    )


def test_a_line_that_is_no_event_reads_as_none() -> None:
    good = example(WorkerExited).to_json() | {"kind": "worker_exited"}
    assert isinstance(parse_event(good), WorkerExited)
    assert parse_event({**good, "kind": "no_such_kind"}) is None
    assert parse_event({k: v for k, v in good.items() if k != "rank"}) is None
    assert parse_event({**good, "rank": "1"}) is None
    assert parse_event({**good, "rank": True}) is None
    assert parse_event({**good, "kind": 3}) is None


def test_no_event_is_emitted_as_a_free_form_kind() -> None:
    """Every ``.emit(`` in src takes a catalogue event: no string kind, no
    keyword fields; the store server's ``on_term`` names its kind by the
    catalogue's ``KIND``."""
    found = []
    for path in sorted((ROOT / "src" / "elastrun").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in {"emit", "on_term"} or not node.args:
                continue
            # emit(event) / EventLog.emit(source, event); the store's on_term(kind, detail)
            kind = node.args[-1] if node.func.attr == "emit" else node.args[0]
            free = node.keywords and node.func.attr == "emit"
            if free or (isinstance(kind, ast.Constant) and isinstance(kind.value, str)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_the_timeline_reads_events_of_the_catalogue() -> None:
    from elastrun.status.timeline import COMMON, DRAWN

    assert set(DRAWN) <= set(CATALOGUE)
    assert set(COMMON) <= {"source", "run_id", "host", "node_id"}


def test_every_kind_is_declared_an_event_kind() -> None:
    """``@event_kind``, not ``@dataclass``: cheap to build (every agent start
    builds the catalogue; elastrun/frozen.py)."""
    tree = ast.parse((ROOT / "src" / "elastrun" / "event_kinds.py").read_text(encoding="utf-8"))
    kinds = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name != "Event"]
    assert {c.name for c in kinds} == {cls.__name__ for cls in CATALOGUE}
    plain = [c.name for c in kinds if [ast.unparse(d) for d in c.decorator_list] != ["event_kind"]]
    assert plain == [], "declare each kind with @event_kind alone"


@pytest.mark.parametrize("cls", CATALOGUE, ids=lambda c: c.__name__)
def test_an_event_compares_hashes_and_shows_as_a_dataclass(cls: type[Event]) -> None:
    """An event is a frozen dataclass to its users: equal to one of the same
    fields, hashed by them, shown as ``@dataclass`` shows it, read-only."""
    event, same = example(cls), example(cls)
    values = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    assert event == same and event != object()
    shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
    assert repr(event) == f"{cls.__qualname__}({shown})"
    if all(isinstance(v, (str, int, float, type(None), FailureRecord)) for v in values.values()):
        assert hash(event) == hash(same) == hash(tuple(values.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.KIND_FIELD = 1  # type: ignore[attr-defined]
