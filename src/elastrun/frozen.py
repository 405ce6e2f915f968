"""``@frozen``: a frozen dataclass that is cheap to build.

``@dataclass(frozen=True)`` writes six methods for each class (``__init__``,
``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``) as
source text and compiles each one: about 0.6 ms of CPU per class on Python
3.11. Every agent start builds some 300 value classes (events, the rendezvous'
events and actions, records, notes, the store's values), so this was half of
its import.

``@frozen`` (and ``@frozen(slots=True)``) is ``@dataclass(frozen=True)``, typed
as one (``dataclass_transform``). dataclass reads the fields (and makes the
slots); the six methods are made here without compiling anything, and do what
dataclass's do: ``__init__`` takes the fields that ``init`` says, in order
(keyword-only ones last), fills defaults and default factories, sets every
field and calls ``__post_init__``, with dataclass's signature; ``__eq__``,
``__hash__`` and ``__repr__`` use the fields whose ``compare``, ``hash`` and
``repr`` say so, in order (equal only to an instance of the same class); a
field can be neither assigned nor deleted. A class that defines its own
``__eq__``, ``__hash__`` or ``__repr__`` keeps it, as with dataclass. Built
by a loop over its fields, such an ``__init__`` costs a few microseconds more
per instance than dataclass's: these are values sent and logged, not built in
inner loops. (``InitVar`` pseudo-fields are not supported: none is used.)
"""

from __future__ import annotations

import dataclasses
import inspect
import reprlib
from collections.abc import Callable, Sequence
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
        for name in ("__setattr__", "__delattr__"):
            if name in own:  # as dataclass says it
                raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
        made = cast(_T, dataclasses.dataclass(init=False, eq=False, repr=False, slots=slots)(cls))
        fields = dataclasses.fields(made)
        if "__init__" not in own:
            _add(made, "__init__", _init(made, fields))
        names = frozenset(f.name for f in fields)
        # The class as written (dataclass's slotted copy is another), as dataclass checks it.
        _add(made, "__setattr__", _setattr(cls, names))
        _add(made, "__delattr__", _delattr(cls, names))
        if slots:  # a copy or pickle sets the fields as __init__ does
            setattr(made, "__getstate__", _getstate)  # noqa: B010
            setattr(made, "__setstate__", _setstate)  # noqa: B010
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


class _Factory:
    def __repr__(self) -> str:
        return "<factory>"  # as dataclass's signature shows a default factory


_FACTORY = _Factory()
_MISSING: Any = dataclasses.MISSING


def _init(cls: type, fields: Sequence[dataclasses.Field[Any]]) -> Callable[..., None]:
    """dataclass's ``__init__`` for ``fields``, as a loop over them."""
    taken = [f for f in fields if f.init]
    ordered = [f for f in taken if not f.kw_only] + [f for f in taken if f.kw_only]
    positional = tuple(f.name for f in ordered if not f.kw_only)
    known = frozenset(f.name for f in taken)
    # Each field: (name, taken as an argument, default, default factory).
    plan: tuple[tuple[str, bool, Any, Any], ...] = tuple(
        (f.name, f.init, f.default, f.default_factory) for f in fields
    )
    post_init = getattr(cls, "__post_init__", None)
    title = f"{cls.__qualname__}.__init__()"
    setter = object.__setattr__

    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        if args or not known.issuperset(kwargs):
            _bind(title, positional, known, args, kwargs)
        missing = []
        for name, init, default, factory in plan:
            if init and name in kwargs:
                value = kwargs[name]
            elif default is not _MISSING:
                value = default
            elif factory is not _MISSING:
                value = factory()
            else:
                if init:
                    missing.append(repr(name))
                continue  # no value, as with dataclass
            setter(self, name, value)
        if missing:
            shown = " and ".join(", ".join(missing).rsplit(", ", 1))
            raise TypeError(f"{title} missing {len(missing)} required argument(s): {shown}")
        if post_init is not None:
            post_init(self)

    __init__.__signature__ = _signature(ordered)  # type: ignore[attr-defined]
    return __init__


def _bind(
    title: str,
    positional: tuple[str, ...],
    known: frozenset[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Put ``args`` into ``kwargs`` by name, refusing what a signature refuses."""
    if len(args) > len(positional):
        raise TypeError(
            f"{title} takes {len(positional) + 1} positional arguments "
            f"but {len(args) + 1} were given"
        )
    for name in kwargs:
        if name not in known:
            raise TypeError(f"{title} got an unexpected keyword argument {name!r}")
        if name in positional[: len(args)]:
            raise TypeError(f"{title} got multiple values for argument {name!r}")
    kwargs.update(zip(positional, args, strict=False))


def _signature(ordered: Sequence[dataclasses.Field[Any]]) -> inspect.Signature:
    """The signature dataclass's ``__init__`` would have."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in ordered:
        default: Any = inspect.Parameter.empty
        if f.default is not _MISSING:
            default = f.default
        elif f.default_factory is not _MISSING:
            default = _FACTORY
        kind = (
            inspect.Parameter.KEYWORD_ONLY if f.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(params, return_annotation=None)


def _setattr(cls: type, names: frozenset[str]) -> Callable[[object, str, object], None]:
    def __setattr__(self: object, name: str, value: object) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)  # type: ignore[arg-type]

    return __setattr__


def _delattr(cls: type, names: frozenset[str]) -> Callable[[object, str], None]:
    def __delattr__(self: object, name: str) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)  # type: ignore[arg-type]

    return __delattr__


def _getstate(self: object) -> list[object]:
    return [getattr(self, f.name) for f in dataclasses.fields(self)]  # type: ignore[arg-type]


def _setstate(self: object, state: list[object]) -> None:
    for f, value in zip(dataclasses.fields(self), state, strict=True):  # type: ignore[arg-type]
        object.__setattr__(self, f.name, value)


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
