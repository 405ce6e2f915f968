"""``@frozen`` (elastrun/frozen.py) is ``@dataclass(frozen=True)`` to its users:
the same equality, hash, repr, read-only fields, signature, copies and
``dataclasses.replace``, for every shape of class the sources use; and it
builds a class for less CPU than dataclass does."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from elastrun.frozen import frozen


def shapes(deco: Any, deco_slots: Any) -> dict[str, tuple[type, dict[str, Any]]]:
    """The same classes, built by ``deco`` (``deco_slots``: with slots), with
    the arguments of one instance."""

    @deco
    class Plain:
        KIND: ClassVar[str] = "k"
        a: int
        b: str = "x"
        c: list[int] = field(default_factory=list)

    @deco
    class Secret:
        user: str
        password: str | None = field(default=None, repr=False)
        note: str = field(default="", compare=False)
        tag: str = field(default="", hash=False)

    @deco_slots
    class Slotted:
        key: bytes
        value: int = 0

    @deco
    class Empty:
        pass

    @deco
    class One:
        only: int

    @deco
    class Base:
        x: int

    @deco
    class Child(Base):
        y: int = 2

    @deco
    class OwnEq:  # noqa: PLW1641  # the hash is made, as dataclass makes it
        v: int

        def __eq__(self, other: object) -> bool:
            return isinstance(other, OwnEq) and abs(self.v - other.v) < 2

    @deco
    class OwnHash:
        v: int

        def __hash__(self) -> int:
            return 7

    @deco
    class Checked:
        low: int
        high: int = 10
        span: int = field(init=False, default=0)
        tags: tuple[str, ...] = field(default=(), kw_only=True)

        def __post_init__(self) -> None:
            if self.low > self.high:
                raise ValueError(f"low {self.low} > high {self.high}")
            object.__setattr__(self, "span", self.high - self.low)

    return {
        "Plain": (Plain, {"a": 1, "c": [1, 2]}),
        "Checked": (Checked, {"low": 1, "tags": ("t",)}),
        "Secret": (Secret, {"user": "u", "password": "p", "note": "n", "tag": "t"}),
        "Slotted": (Slotted, {"key": b"k", "value": 3}),
        "Empty": (Empty, {}),
        "One": (One, {"only": 5}),
        "Child": (Child, {"x": 1}),
        "OwnEq": (OwnEq, {"v": 1}),
        "OwnHash": (OwnHash, {"v": 1}),
    }


DATACLASS = shapes(dataclass(frozen=True), dataclass(frozen=True, slots=True))
FROZEN = shapes(frozen, frozen(slots=True))


def outcome(fn: Any) -> object:
    try:
        return fn()
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("name", sorted(DATACLASS))
def test_a_frozen_class_behaves_as_a_frozen_dataclass(name: str) -> None:
    (ref_cls, kwargs), (cls, _) = DATACLASS[name], FROZEN[name]
    ref, new = ref_cls(**kwargs), cls(**kwargs)
    assert repr(new) == repr(ref)
    assert str(inspect.signature(cls)) == str(inspect.signature(ref_cls))
    assert getattr(cls, "__match_args__", None) == getattr(ref_cls, "__match_args__", None)
    assert dataclasses.astuple(new) == dataclasses.astuple(ref)
    assert (new == cls(**kwargs)) == (ref == ref_cls(**kwargs))
    assert (new == ref) is False and (new != object()) is True  # only its own class
    for other in ({}, {"a": 9}, {"note": "m"}, {"tag": "s"}, {"password": "q"}, {"v": 2}):
        changed = {**kwargs, **{k: v for k, v in other.items() if k in kwargs}}
        assert (new == cls(**changed)) == (ref == ref_cls(**changed)), other
        same_hash = outcome(lambda: hash(new) == hash(cls(**changed)))  # noqa: B023
        ref_same_hash = outcome(lambda: hash(ref) == hash(ref_cls(**changed)))  # noqa: B023
        assert same_hash == ref_same_hash, other
    assert type(outcome(lambda: hash(new))) is type(outcome(lambda: hash(ref)))
    for attr in (*kwargs, "not_a_field"):
        assert outcome(lambda: setattr(new, attr, 1)) == outcome(  # noqa: B023
            lambda: setattr(ref, attr, 1)  # noqa: B023
        )
        assert outcome(lambda: delattr(new, attr)) == outcome(lambda: delattr(ref, attr))  # noqa: B023
    for attr in kwargs:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(new, attr, 1)
    duplicate = copy.deepcopy(new)  # pickling's protocol (the slotted class's state too)
    assert duplicate == new and repr(duplicate) == repr(new)
    if kwargs:
        first = next(iter(kwargs))
        assert repr(dataclasses.replace(new, **{first: kwargs[first]})) == repr(new)


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    [
        ("Plain", (), {}),  # a required field missing
        ("Plain", (1, "y", [], 4), {}),  # too many positional arguments
        ("Plain", (1,), {"a": 2}),  # one field twice
        ("Plain", (), {"a": 1, "d": 2}),  # no such field
        ("Checked", (1, 2, 3), {}),  # a keyword-only field given by position
        ("Checked", (1,), {"span": 3}),  # a field that __init__ does not take
        ("Checked", (5, 1), {}),  # refused by __post_init__
        ("Empty", (1,), {}),
    ],
)
def test_a_bad_call_is_refused_as_by_dataclass(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    (ref_cls, _), (cls, _) = DATACLASS[name], FROZEN[name]
    ref, new = outcome(lambda: ref_cls(*args, **kwargs)), outcome(lambda: cls(*args, **kwargs))
    assert isinstance(ref, tuple) and isinstance(new, tuple), (ref, new)
    assert new[0] is ref[0], (ref, new)
    if ref[0] is ValueError:
        assert new == ref


def test_positional_and_default_arguments_fill_the_fields_as_with_dataclass() -> None:
    for name, args, kwargs in (("Plain", (1, "y"), {}), ("Checked", (2,), {"high": 4})):
        (ref_cls, _), (cls, _) = DATACLASS[name], FROZEN[name]
        assert repr(cls(*args, **kwargs)) == repr(ref_cls(*args, **kwargs))
    (cls, _), (ref_cls, _) = FROZEN["Checked"], DATACLASS["Checked"]
    assert cls(2, 4).span == ref_cls(2, 4).span == 2  # set by __post_init__, not an argument
    assert FROZEN["Plain"][0](1).c is not FROZEN["Plain"][0](1).c  # a new list each time


def test_the_hash_is_the_dataclass_hash_of_the_hashed_fields() -> None:
    (ref_cls, kwargs), (cls, _) = DATACLASS["Secret"], FROZEN["Secret"]
    assert hash(cls(**kwargs)) == hash(ref_cls(**kwargs)) == hash(("u", "p"))


def test_frozen_builds_a_class_for_less_cpu_than_dataclass() -> None:
    """What it is for: CPU time of building the same classes, the cheaper of
    three tries each (a count of work, not a window of time)."""

    def cost(deco: Any, deco_slots: Any) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            for _ in range(8):
                shapes(deco, deco_slots)
            best = min(best, time.process_time() - start)
        return best

    assert cost(frozen, frozen(slots=True)) < cost(
        dataclass(frozen=True), dataclass(frozen=True, slots=True)
    )
