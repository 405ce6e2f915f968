"""``@frozen``: a frozen dataclass that is cheap to build.

``@dataclass(frozen=True)`` writes six methods for each class (``__init__``,
``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``) as
source text and compiles each one: about 0.7 ms of CPU per class on Python
3.11. Every agent start builds some 300 value classes (events, the rendezvous'
events and actions, records, notes, the store's values), so this was a third
of its import.

``@frozen`` (and ``@frozen(slots=True)``) is ``@dataclass(frozen=True)``, typed
as one (``dataclass_transform``): dataclass writes ``__init__`` and the frozen
``__setattr__`` and ``__delattr__``; ``__eq__``, ``__hash__`` and ``__repr__``
are made here without compiling anything, and do what dataclass's do (the
fields whose ``compare``, ``hash`` and ``repr`` say so, in order; equal only
to an instance of the same class). A class that defines its own keeps it, as
with dataclass.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar, cast, dataclass_transform, overload

__all__ = ["frozen"]

_T = TypeVar("_T", bound=type)


@overload
def frozen(cls: _T, /) -> _T: ...
@overload
def frozen(*, slots: bool = False) -> Callable[[_T], _T]: ...


@dataclass_transform(frozen_default=True)
def frozen(cls: Any = None, /, *, slots: bool = False) -> Any:
    """``@dataclass(frozen=True)`` (``slots``: ``@dataclass(frozen=True, slots=True)``)."""

    def wrap(cls: _T) -> _T:
        own = vars(cls)
        keeps_hash = own.get("__hash__") is not None  # None: set by an __eq__ of the class
        made = cast(_T, dataclasses.dataclass(frozen=True, eq=False, repr=False, slots=slots)(cls))
        fields = dataclasses.fields(made)
        if "__eq__" not in own:
            _add(made, "__eq__", _eq(_values(f.name for f in fields if f.compare)))
        if not keeps_hash:
            hashed = (f.name for f in fields if (f.compare if f.hash is None else f.hash))
            _add(made, "__hash__", _hash(_values(hashed)))
        if "__repr__" not in own:
            _add(made, "__repr__", _repr([f.name for f in fields if f.repr]))
        return made

    return wrap if cls is None else wrap(cls)


def _add(cls: type, name: str, fn: Callable[..., Any]) -> None:
    fn.__qualname__ = f"{cls.__qualname__}.{name}"
    setattr(cls, name, fn)


def _values(names: Any) -> Callable[[object], tuple[object, ...]]:
    """The instance's values of ``names``, as a tuple (as dataclass compares them)."""
    names = tuple(names)
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    if not names:
        return lambda obj: ()
    return attrgetter(*names)  # a tuple for two or more


def _eq(values: Callable[[object], tuple[object, ...]]) -> Callable[[object, object], Any]:
    def __eq__(self: object, other: object) -> Any:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return values(self) == values(other)

    return __eq__


def _hash(values: Callable[[object], tuple[object, ...]]) -> Callable[[object], int]:
    def __hash__(self: object) -> int:
        return hash(values(self))

    return __hash__


def _repr(names: list[str]) -> Callable[[object], str]:
    @reprlib.recursive_repr()
    def __repr__(self: object) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{self.__class__.__qualname__}({shown})"

    return __repr__
