"""The rendezvous' store records, typed: what a node writes is what the next
node reads, and what anyone else wrote is refused by name.

Pure: records through their bytes (``encode`` / ``decode``), the JSON shape
on the wire, records of other elastrun versions, and records an attacker (or
a bug) wrote under the job's keys.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from elastrun.errors import ProtocolError
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import rounds
from elastrun.rendezvous.records import (
    DONE,
    AgreedSettings,
    ConfigRecord,
    JoinRecord,
    MemberRecord,
    NodeInfo,
    PresenceRecord,
    PrevMember,
    ResultRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.results import RESULT_VERSION, ResultHeader, stored_form

KEYS = K.Keys(RunId("job"))
FAILURE = FailureRecord(host="b", rank=1, exitcode=1, time=5.0, stderr_tail=("boom",))
MEMBERS = (MemberRecord("a", "ha", "10.0.0.1", 2, 0), MemberRecord("b", "hb", "10.0.0.2", 1, 1))
ROUND = RoundRecord(
    4,
    RoundState.CLOSED,
    restarts=1,
    last_failure=FAILURE,
    pending_failure=FAILURE,
    prev=(PrevMember("a", 0), PrevMember("b", 1)),
    reason="restart_requested",
    detail=FAILURE.describe(),
    counts=True,
    opened_at=12.5,
    hang_round=2,
)
RESULT = ResultRecord(4, MEMBERS, "10.0.0.1", 29500, 1, True, "last_call", 12.5, 13.0)
HEADER_JSON = stored_form(RESULT, 1)[0].to_json()  # the result's header, as stored
CONFIG = ConfigRecord(AgreedSettings(1, 4, 3, 600, 30.0))


def stored(obj: dict[str, Any], version: int = 1) -> bytes:
    return json.dumps({"v": version, **obj}).encode()


# -- what is written is what is read -----------------------------------------------------
@pytest.mark.parametrize(
    ("key", "record"),
    [
        (KEYS.round, ROUND),
        (KEYS.round, RoundRecord(0, RoundState.OPEN, reason="job_started", opened_at=1.0)),
        (KEYS.config, CONFIG),
        (KEYS.join(4, "a"), JoinRecord(NodeInfo("a", "ha", "10.0.0.1", 2, 0, 7), port=29500)),
        (KEYS.node("a"), PresenceRecord(NodeInfo("a", "ha", "10.0.0.1", 2, None, 7), since=3.0)),
        (KEYS.waiting("c"), WaitingRecord("c", "hc", 4)),
    ],
)
def test_every_record_reads_back_as_it_was_written(key: str, record: Any) -> None:
    data = record.encode()
    assert json.loads(data)["v"] == K.RECORD_VERSION
    assert type(record).decode(key, data) == record


def test_the_round_record_keeps_its_wire_shape() -> None:
    """The keys other elastrun versions read; no list of members (the result
    holds them: every node reads and watches the round record)."""
    closed = json.loads(ROUND.encode())
    assert set(closed) == {
        "v", "round", "state", "restarts", "last_failure", "pending_failure", "prev", "reason",
        "detail", "counts", "opened_at", "hang_round",
    }  # fmt: skip
    assert closed["state"] == "closed"
    assert closed["prev"] == [{"node_id": "a", "group_rank": 0}, {"node_id": "b", "group_rank": 1}]
    assert closed["last_failure"] == FAILURE.to_json()
    opened = json.loads(rounds.first_round(1.0).encode())
    assert "members" not in opened and opened["state"] == "open"
    assert opened["pending_failure"] is None and opened["hang_round"] is None
    # Sorted keys, as every version wrote them: the bytes of one record are one.
    assert ROUND.encode() == json.dumps({"v": 1, **ROUND.to_json()}, sort_keys=True).encode()
    assert DONE == b'{"v": 1}'


def test_records_of_other_versions_are_read() -> None:
    """An older round 0 (no pending failure nor hang round), a failure opened
    with an empty record, a newer version's extra fields."""
    old = {"round": 0, "state": "open", "restarts": 0, "last_failure": None, "prev": [],
           "reason": "job_started", "detail": "", "counts": False, "opened_at": 1.0}  # fmt: skip
    rec = RoundRecord.decode(KEYS.round, stored(old))
    assert rec == rounds.first_round(1.0)
    rec = RoundRecord.from_json({**old, "counts": True, "pending_failure": {}, "future": [1]})
    assert rec.counts and rec.pending_failure is None
    join = {"node_id": "a", "host": "h", "addr": "x", "nproc": 1, "rank_hint": None, "port": 9}
    assert JoinRecord.from_json(join).node.pid is None  # written before joins had a pid
    # A config written with a field no longer agreed on still agrees.
    older = {"settings": {**CONFIG.settings.to_json(), "close_timeout": 60.0}}
    assert ConfigRecord.from_json(older) == CONFIG


def test_fields_kept_for_people_read_as_absent_when_malformed() -> None:
    raw = {**ROUND.to_json(), "reason": 7, "detail": ["x"], "opened_at": "noon"}
    raw |= {"last_failure": "boom", "pending_failure": [1], "hang_round": "2"}
    rec = RoundRecord.from_json(raw)
    assert (rec.reason, rec.detail, rec.opened_at, rec.hang_round) == ("", "", None, None)
    assert rec.last_failure is None and rec.pending_failure is None
    assert RoundRecord.from_json({**raw, "hang_round": -1}).hang_round is None
    header = ResultHeader.from_json({**HEADER_JSON, "closed_at": float("inf")})
    assert header.closed_at is None


# -- what anyone else wrote -----------------------------------------------------------------
ROUND_JSON = ROUND.to_json()
MEMBER = MEMBERS[0].to_json()


@pytest.mark.parametrize(
    ("kind", "raw", "field"),
    [
        (RoundRecord, {**ROUND_JSON, "round": "4"}, "round"),
        (RoundRecord, {**ROUND_JSON, "round": -1}, "round"),
        (RoundRecord, {**ROUND_JSON, "round": True}, "round"),
        (RoundRecord, {k: v for k, v in ROUND_JSON.items() if k != "round"}, "round is missing"),
        (RoundRecord, {**ROUND_JSON, "state": "paused"}, "state"),
        (RoundRecord, {**ROUND_JSON, "restarts": 2**60}, "restarts"),
        (RoundRecord, {**ROUND_JSON, "counts": "yes"}, "counts"),
        (RoundRecord, {**ROUND_JSON, "reporters": ["a", "../b"]}, "reporters"),
        (RoundRecord, {**ROUND_JSON, "reporters": "ab"}, "reporters"),
        (RoundRecord, {**ROUND_JSON, "prev": [{"node_id": "a"}]}, "group_rank"),
        (ResultHeader, {**HEADER_JSON, "first": MEMBERS[1].to_json()}, "first"),
        (ResultHeader, {**HEADER_JSON, "size": 0}, "size"),
        (ResultHeader, {**HEADER_JSON, "first": {**MEMBER, "nproc": 0}}, "nproc"),
        (ResultHeader, {**HEADER_JSON, "first": {**MEMBER, "host": 7}}, "host"),
        (ResultHeader, {**HEADER_JSON, "first": {**MEMBER, "node_id": "x" * 129}}, "node_id"),
        (ResultHeader, {**HEADER_JSON, "master_port": 0}, "master_port"),
        (ResultHeader, {**HEADER_JSON, "master_addr": "h" * 1025}, "master_addr"),
        (ConfigRecord, {"settings": {"min_nodes": 1}}, "max_nodes"),
        (ConfigRecord, {}, "settings"),
        (ConfigRecord, {"settings": {**CONFIG.settings.to_json(), "join_timeout": "9"}}, "join"),
        (WaitingRecord, {"node_id": "c", "host": "hc"}, "round"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_key_and_the_field(
    kind: Any, raw: dict[str, Any], field: str
) -> None:
    with pytest.raises(ProtocolError, match=f"store key {KEYS.round}.*{field}"):
        kind.decode(KEYS.round, stored(raw, RESULT_VERSION if kind is ResultHeader else 1))


def test_a_per_node_record_names_the_node_of_its_key() -> None:
    join = JoinRecord(NodeInfo("a", "ha", "10.0.0.1", 1), port=29500)
    assert JoinRecord.decode(KEYS.join(0, "a"), join.encode()) == join
    with pytest.raises(ProtocolError, match="node_id 'a' is not its key's"):
        JoinRecord.decode(KEYS.join(0, "b"), join.encode())  # b's place, a's name


def test_bytes_that_are_no_record_are_refused_naming_the_key() -> None:
    for raw in (b"[" * 100000, b"not json", b'{"v": 2, "round": 0}', b"[1]", b"x" * 2**23):
        with pytest.raises(ProtocolError, match=f"store key {KEYS.round}"):
            RoundRecord.decode(KEYS.round, raw)
