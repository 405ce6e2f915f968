"""elastrun.fields: the one reader of a JSON object's fields from outside."""

from __future__ import annotations

import math
import re

import pytest

from elastrun.errors import ProtocolError
from elastrun.fields import Fields


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
