"""A round's result is decoded once per process, and only for the same bytes."""

from __future__ import annotations

import pytest

from elastrun.errors import ProtocolError
from elastrun.rendezvous.records import MemberRecord, ResultRecord
from elastrun.rendezvous.view import decode_result


def _result(port: int, n: int = 3) -> bytes:
    members = tuple(MemberRecord(f"n{i}", f"h{i}", "10.0.0.1", 2, i) for i in range(n))
    return ResultRecord(round=4, members=members, master_addr="h0", master_port=port).encode()


def test_the_same_bytes_are_decoded_once_and_other_bytes_again() -> None:
    key = "/elastrun/job-decode/rounds/4/result"
    first = decode_result(key, _result(29500))
    again = decode_result(key, bytes(_result(29500)))  # equal bytes, another object
    assert again is first
    assert [m.group_rank for m in first.members] == [0, 1, 2]
    assert first.ranks == {"n0": 0, "n1": 1, "n2": 2}
    other = decode_result(key, _result(29501))  # same key, other bytes
    assert other is not first and other.record.master_port == 29501


def test_a_bad_record_is_refused_every_time() -> None:
    key = "/elastrun/job-decode/rounds/5/result"
    bad = _result(29500).replace(b'"group_rank": 1', b'"group_rank": 7')
    for _ in range(2):
        with pytest.raises(ProtocolError, match="group-rank order"):
            decode_result(key, bad)
