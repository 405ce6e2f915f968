"""elastrun.fields: the one reader of a JSON object's fields from outside."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable

import pytest

from elastrun.agent import channel
from elastrun.agent.file_timers import MAX_LINE, parse_request
from elastrun.agent.replica import MAX_OFFER, Offer, ReplicaError
from elastrun.errors import ProtocolError
from elastrun.fields import Fields
from elastrun.rendezvous import keys
from elastrun.rendezvous.notes import NOTE_MAX_BYTES, ModuleReport, parse
from elastrun.store.codec import FrameDecoder


class Refused(ValueError):
    pass


def test_a_strict_read_raises_the_callers_error_naming_where_and_the_field() -> None:
    f = Fields({"n": True, "s": "x" * 9, "l": [1, 2, 3], "t": math.inf}, "a note", Refused)
    cases = [
        (lambda: f.integer("n"), "a note: n is not an integer from 0 to"),  # a bool is no int
        (lambda: f.integer("absent"), "a note: absent is missing"),
        (lambda: f.text("s", 8), "a note: s is not a string of at most 8 characters"),
        (lambda: f.items("l", 2), "a note: l is not a list of at most 2 items"),
        (lambda: f.strings("l"), "a note: l is not a list of strings"),
        (lambda: f.number("t", low=None, high=None), "a note: t is not a finite number"),
        (lambda: f.flag("s"), "a note: s is not true or false"),
    ]
    for read, message in cases:
        with pytest.raises(Refused, match=f"^{re.escape(message)}"):
            read()
    with pytest.raises(ProtocolError, match=r"^a frame is not a JSON object$"):
        Fields([1], "a frame", ProtocolError)


def test_what_fits_is_read_and_absent_optionals_are_none() -> None:
    f = Fields({"n": 3, "x": 1.5, "s": "a", "l": ["b"], "b": True, "z": None})
    assert (f.integer("n", low=1, high=3), f.number("x"), f.text("s", 1)) == (3, 1.5, "a")
    assert (f.strings("l"), f.flag("b"), f.items("absent")) == (("b",), True, [])
    assert [f.optional_integer("z"), f.optional_text("absent"), f.optional_number("z")] == [
        None
    ] * 3


def test_a_lenient_read_takes_another_type_as_absent() -> None:
    f = Fields({"n": "3", "x": math.nan, "s": 4, "b": False})
    assert [f.maybe_int("n"), f.maybe_number("x"), f.maybe_text("s")] == [None] * 3
    assert f.maybe_int("b") is None  # a bool is no int


# -- the envelope: a JSON object of version N ---------------------------------------
def test_a_versioned_object_of_the_version_read_gives_its_fields() -> None:
    f = Fields.versioned({"v": 2, "n": 5}, 2, "a record", Refused)
    assert f.integer("n") == 5 and f.where == "a record" and f.error is Refused

    class Frame(Fields):  # a subclass keeps its own bounds
        INT_HIGH = 9

    frame = Frame.versioned({"version": 1, "n": 10}, 1, "a frame", Refused, key="version")
    assert type(frame) is Frame
    with pytest.raises(Refused, match=r"^a frame: n is not an integer from 0 to 9$"):
        frame.integer("n")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{"v": 1}], "a record is not a JSON object"),
        ("{}", "a record is not a JSON object"),
        (None, "a record is not a JSON object"),
        ({}, "a record has version None; this elastrun reads version 1"),
        ({"v": 2}, "a record has version 2; this elastrun reads version 1"),
        ({"v": "1"}, "a record has version '1'; this elastrun reads version 1"),
        ({"v": True}, "a record has version True; this elastrun reads version 1"),  # no bool
        ({"v": 1.0}, "a record has version 1.0; this elastrun reads version 1"),
    ],
)
def test_anything_but_an_object_of_the_version_read_is_refused_in_one_line(
    raw: object, message: str
) -> None:
    with pytest.raises(Refused, match=f"^{re.escape(message)}$"):
        Fields.versioned(raw, 1, "a record", Refused)


def test_the_version_s_name_and_what_to_do_are_the_caller_s() -> None:
    with pytest.raises(ProtocolError) as got:
        Fields.versioned({"v": 7}, 1, "store frame", ProtocolError, what="protocol version",
                         hint="upgrade the older side")  # fmt: skip
    assert str(got.value) == (
        "store frame has protocol version 7; this elastrun reads version 1 (upgrade the older side)"
    )
    with pytest.raises(ValueError, match=r"^the value is not a JSON object$"):
        Fields.versioned([], 1, "")


def _none_refused(value: object) -> None:
    if value is None:  # these readers say "no such thing" rather than raise
        raise Refused("refused")


def _frame(body: bytes) -> None:
    FrameDecoder(max_frame=1 << 16).feed(struct.pack(">I", len(body)) + body)


# Each boundary that reads versioned JSON from outside: its read, what it
# raises, and its bound in bytes.
BOUNDARIES: dict[str, tuple[Callable[[bytes], object], type[Exception], int]] = {
    "record": (lambda b: keys.decode("/k", b), ProtocolError, keys.RECORD_MAX_BYTES),
    "note": (lambda b: _none_refused(parse(ModuleReport, b)), Refused, NOTE_MAX_BYTES),
    "frame": (_frame, ProtocolError, 1 << 16),
    "message": (
        lambda b: _none_refused(channel.decode(b, max_bytes=4096, what="m")),
        Refused,
        4096,
    ),
    "replica offer": (Offer.decode, ReplicaError, MAX_OFFER),
    "timer request": (lambda b: _none_refused(parse_request(b)), Refused, MAX_LINE),
}


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize(
    "bad",
    ["not an object", "another version", "no version", "too deep", "too big"],
)
def test_every_versioned_boundary_refuses_what_is_not_its_envelope(boundary: str, bad: str) -> None:
    read, error, max_bytes = BOUNDARIES[boundary]
    data = {
        "not an object": b'[{"v": 1, "version": 1}]',
        "another version": b'{"v": 99, "version": 99}',
        "no version": b'{"kind": "go", "modules": []}',
        "too deep": b'{"v": 1, "version": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "too big": b'{"v": 1, "version": 1, "x": "' + b"a" * max_bytes + b'"}',
    }[bad]
    with pytest.raises(error):
        read(data)


def test_a_timer_request_reads_as_torch_writes_it() -> None:
    # torch's FileTimerClient: {"version": 1, ...}; a release has a negative time.
    line = b'{"version": 1, "pid": 42, "scope_id": "step", "expiration_time": -1, "signal": 9}'
    got = parse_request(line)
    assert got is not None and (got.pid, got.scope_id, got.signal, got.release) == (
        42,
        "step",
        9,
        True,
    )
    for old, new in (
        (b'"pid": 42', b'"pid": 0'),
        (b'"pid": 42', b'"pid": true'),
        (b'"signal": 9', b'"signal": 65'),
        (b'"version": 1', b'"version": 2'),
    ):
        assert parse_request(line.replace(old, new)) is None, new
