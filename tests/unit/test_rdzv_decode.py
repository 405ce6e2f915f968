"""A round's result in the store: a header and its members in shards, each
member's place readable alone, the whole decoded once per process and only
for the same bytes, anything that does not add up refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import pytest

from elastrun.errors import ProtocolError, RecordDamaged
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.node_io import decode_part, decode_whole
from elastrun.rendezvous.records import MemberRecord, ResultRecord
from elastrun.rendezvous.results import (
    RESULT_VERSION,
    Head,
    ResultHeader,
    ResultShard,
    load,
    shard_count,
    shard_of,
    stored_form,
)
from elastrun.rendezvous.rounds import partial_result, round_result
from elastrun.store.base import KeyValue

KEYS = K.Keys(RunId("job-decode"))


def _result(port: int, n: int = 3, nproc: tuple[int, ...] = ()) -> ResultRecord:
    members = tuple(
        MemberRecord(f"n{i}", f"h{i}", "10.0.0.1", nproc[i] if nproc else 2, i) for i in range(n)
    )
    return ResultRecord(round=4, members=members, master_addr="h0", master_port=port)


def _kvs(result: ResultRecord, shards: int) -> tuple[KeyValue, list[KeyValue]]:
    header, parts = stored_form(result, shards)
    r = result.round
    head = KeyValue(KEYS.result(r), header.encode(), 1, 1, 1)
    return head, [KeyValue(KEYS.shard(r, p.shard), p.encode(), 1, 1, 1) for p in parts]


def test_the_shard_count_follows_max_nodes_within_bounds() -> None:
    assert [shard_count(n) for n in (1, 64, 65, 2048, 8192, 10**6)] == [1, 1, 2, 32, 64, 64]


def test_heterogeneous_nproc_keeps_every_first_global_rank() -> None:
    result = _result(29500, n=40, nproc=tuple(1 + i % 3 for i in range(40)))
    header, parts = stored_form(result, 4)
    assert header.size == 40 and header.world_size == result.world_size
    bases = {s.member.node_id: s.rank_base for p in parts for s in p.seats}
    expected = 0
    for m in result.members:
        assert bases[m.node_id] == expected
        expected += m.nproc
    # One member's own place gives what its workers need, without the others.
    me = result.members[17]
    shard = parts[shard_of(me.node_id, 4)]
    rr = partial_result("job", Head.find(header, shard, me.node_id), max_restarts=3)
    assert not rr.complete and rr.members[0].node_id == me.node_id
    assert (rr.group_rank, rr.group_world_size, rr.world_size) == (17, 40, result.world_size)
    assert rr.rank_offset == sum(m.nproc for m in result.members[:17])
    assert rr.me.nproc == me.nproc and (rr.master_addr, rr.master_port) == ("h0", 29500)


def test_a_node_outside_the_round_finds_no_place() -> None:
    header, parts = stored_form(_result(29500), 1)
    assert Head.find(header, parts[0], "stranger").mine is None


def test_the_same_bytes_are_decoded_once_and_other_bytes_again() -> None:
    head, shards = _kvs(_result(29500, n=300), 3)
    first = decode_whole((head, *shards))
    again = decode_whole((dataclasses.replace(head, value=bytes(head.value)), *shards))
    assert again is first
    assert [m.group_rank for m in first.members] == list(range(300))
    assert first.ranks["n7"] == 7
    other_head, other_shards = _kvs(_result(29501, n=300), 3)
    other = decode_whole((other_head, *other_shards))  # same keys, other bytes
    assert other is not first and other.record.master_port == 29501
    part = decode_part((head, shards[1]))
    assert decode_part((head, shards[1])) is part
    assert part[1].shard == 1 and all(shard_of(s.member.node_id, 3) == 1 for s in part[1].seats)


def _whole(head: KeyValue, shards: list[KeyValue]) -> ResultRecord:
    header = ResultHeader.decode(head.key, head.value)
    parts = [ResultShard.decode(kv.key, kv.value, header) for kv in shards]
    return load(header, parts, head.key)


def _rewrite(kv: KeyValue, old: bytes, new: bytes) -> KeyValue:
    assert old in kv.value
    return dataclasses.replace(kv, value=kv.value.replace(old, new, 1))


def test_shards_that_do_not_add_up_are_refused() -> None:
    head, shards = _kvs(_result(29500, n=20), 2)
    assert _whole(head, shards) == _result(29500, n=20)
    with pytest.raises(ProtocolError, match="not the 2 the header names"):
        _whole(head, shards[:1])  # a shard missing
    # A member moved into the other shard: it does not hash there.
    header = ResultHeader.decode(head.key, head.value)
    s0 = ResultShard.decode(shards[0].key, shards[0].value, header)
    moved = dataclasses.replace(shards[1], value=dataclasses.replace(s0, shard=1).encode())
    with pytest.raises(ProtocolError, match="which is not in this shard"):
        _whole(head, [shards[0], moved])
    # A first global rank that does not follow from the nproc before it.
    bad = _rewrite(shards[1], b'"rank_base": ', b'"rank_base": 1')
    with pytest.raises(ProtocolError, match=r"first global rank|outside the header"):
        _whole(head, [shards[0], bad])
    # Group ranks out of range of the header's size.
    small = _rewrite(head, b'"size": 20', b'"size": 19')
    with pytest.raises(ProtocolError, match=r"outside the header's sizes|group ranks"):
        _whole(small, shards)
    # A node named twice (one shard: every node hashes to it).
    head1, (only,) = _kvs(_result(29500), 1)
    with pytest.raises(ProtocolError, match="naming a node twice"):
        _whole(head1, [_rewrite(only, b'"node_id": "n1"', b'"node_id": "n0"')])
    for _ in range(2):  # refused every time (the job's verdict), never remembered
        with pytest.raises(RecordDamaged, match="round result is damaged: store key"):
            decode_whole((small, *shards))


def test_a_single_record_result_of_another_version_is_named() -> None:
    single = {"round": 4, "members": [], "master_addr": "h0", "master_port": 29500}
    old = KeyValue(KEYS.result(4), K.encode(single, version=1), 1, 1, 1)  # one record, version 1
    expected = f"record version 1; this elastrun reads version {RESULT_VERSION}"
    with pytest.raises(ProtocolError, match=expected):
        ResultHeader.decode(old.key, old.value)


def _roles_result(roles: str) -> ResultRecord:
    """Members n0.. of roles ``roles`` (one letter each), 1 + i % 3 workers each."""
    members = tuple(
        MemberRecord(f"n{i}", f"h{i}", "10.0.0.1", 1 + i % 3, i, role)
        for i, role in enumerate(roles)
    )
    return ResultRecord(round=4, members=members, master_addr="h0", master_port=29500)


def test_each_members_role_ranks_are_readable_from_its_own_place() -> None:
    result = _roles_result("mtmttmt" * 6)  # 42 members of two roles, in 4 shards
    head, shards = _kvs(result, 4)
    assert _whole(head, shards) == result  # the roles round-trip
    header = ResultHeader.decode(head.key, head.value)
    whole = round_result("job", "n0", result, 3)
    for me in result.members:
        shard = next(kv for kv in shards if kv.key == KEYS.shard(4, shard_of(me.node_id, 4)))
        part = ResultShard.decode(shard.key, shard.value, header)
        alone = partial_result("job", Head.find(header, part, me.node_id), max_restarts=3)
        full = dataclasses.replace(whole, group_rank=me.group_rank)
        assert alone.me.role == me.role
        got = (alone.rank_offset, alone.role_rank_offset, alone.role_world_size)
        assert got == (full.rank_offset, full.role_rank_offset, full.role_world_size)
    sizes = {m.role: 0 for m in result.members}
    for m in result.members:
        sizes[m.role] += m.nproc
    last_t = whole.members[-1]
    last = dataclasses.replace(whole, group_rank=last_t.group_rank)
    assert last.role_world_size == sizes[last_t.role]
    assert last.role_rank_offset == sizes[last_t.role] - last_t.nproc


def _edit_members(kv: KeyValue, edit: Callable[[dict[str, Any]], None]) -> KeyValue:
    """The shard ``kv`` with ``edit`` applied to each member's JSON object."""
    raw = dict(K.decode(kv.key, kv.value, version=RESULT_VERSION))
    raw.pop("v")
    members = [dict(m) for m in cast(list[dict[str, Any]], raw["members"])]
    for m in members:
        edit(m)
    return dataclasses.replace(kv, value=K.encode({**raw, "members": members}, RESULT_VERSION))


def test_a_result_of_a_version_with_one_role_a_job_reads_as_one_role() -> None:
    result = _result(29500, n=3, nproc=(2, 1, 3))
    head, (only,) = _kvs(result, 1)

    def older(m: dict[str, Any]) -> None:
        for name in ("role", "role_base", "role_size"):
            del m[name]

    old = _edit_members(only, older)
    assert b"role" not in old.value
    header = ResultHeader.decode(head.key, head.value)
    part = ResultShard.decode(old.key, old.value, header)
    rr = partial_result("job", Head.find(header, part, "n1"), max_restarts=3)
    assert (rr.rank_offset, rr.role_rank_offset, rr.role_world_size, rr.world_size) == (2, 2, 6, 6)
    assert _whole(head, [old]) == result


def test_role_ranks_that_do_not_add_up_are_refused() -> None:
    head, (only,) = _kvs(_roles_result("mtt"), 1)

    def edit(name: str, value: object) -> Callable[[dict[str, Any]], None]:
        def apply(m: dict[str, Any]) -> None:
            if m["node_id"] == "n2":
                m[name] = value

        return apply

    assert _whole(head, [_edit_members(only, edit("role", "t"))]) == _roles_result("mtt")
    with pytest.raises(ProtocolError, match="role ranks that do not add up"):
        _whole(head, [_edit_members(only, edit("role_base", 0))])  # n1's place in role t
    with pytest.raises(ProtocolError, match="role ranks that do not add up"):
        _whole(head, [_edit_members(only, edit("role", "m"))])  # the role's sizes change
    with pytest.raises(ProtocolError, match="outside its role's size"):
        _whole(head, [_edit_members(only, edit("role_size", 99))])
