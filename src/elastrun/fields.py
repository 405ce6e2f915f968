"""Reading the fields of a JSON object from outside, each checked as it is read.

Every JSON object elastrun reads from another process (a store frame, a store
record, a job note, a worker's message, a snapshot's header, a progress file,
a revoke spec) is read through one :class:`Fields`: ``Fields(obj, where,
error)``, then one call per field. The caller names its own exception class
(``ProtocolError``, ``NoteInvalid``, ``BadMessage``, ...), so each boundary
keeps its place in the exception tree; every message has one shape,
``"{where}: {name} is {what}"`` (``"{name} is {what}"`` without ``where``).

* Strict readers (:meth:`~Fields.integer`, :meth:`~Fields.number`,
  :meth:`~Fields.text`, :meth:`~Fields.flag`, :meth:`~Fields.items`,
  :meth:`~Fields.strings`, and their ``optional_`` forms, for which absent
  or null is None): a field a program decides on holds its type and range,
  else ``error``. A boolean is never an integer; a number is finite.
* Lenient readers (:meth:`~Fields.maybe_int`, :meth:`~Fields.maybe_number`,
  :meth:`~Fields.maybe_text`): a field kept for people, or written by another
  version, reads as None when it is absent or of another type.
* The envelope (:meth:`~Fields.versioned`): every versioned JSON elastrun
  reads (a store frame, a record, a job note, a worker's message, a snapshot's
  header and notes, a checkpoint's checksum record, a replica offer, a cache
  file, a function spec, torch's timer requests) is an object whose ``"v"``
  is the version this side reads, else one line:
  ``"{where} is not a JSON object"`` or ``"{where} has version {found};
  this elastrun reads version {version}"``. Decoding within bounds comes
  first, by :func:`elastrun.untrusted.loads` (the caller's bounds).

Standard library only, and importing nothing of elastrun: the worker's
programs and the orphan guard, which run by path outside the package, load
this file by its path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

TYPE_CHECKING = False  # not typing's: the orphan guard starts without importing typing
if TYPE_CHECKING:
    from typing import Any, Self, TypeGuard

__all__ = ["MAX_COUNT", "Fields", "is_int", "is_number"]

MAX_COUNT = 2**53  # what a JSON number holds exactly


def is_int(value: object) -> TypeGuard[int]:
    """An integer, not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite number, not a boolean."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _show(bound: float | None) -> str:
    if bound is None:
        return "any"
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


class Fields:
    """The fields of the JSON object ``raw``; ``error`` (raised with one line
    naming ``where`` and the field) when ``raw`` is not an object or a strict
    read finds its field missing, mistyped or out of range."""

    __slots__ = ("error", "raw", "where")

    INT_HIGH = MAX_COUNT  # an integer's bound unless a read names one

    def __init__(self, raw: object, where: str = "", error: type[Exception] = ValueError) -> None:
        if type(raw) is not dict and not isinstance(raw, Mapping):
            raise error(f"{where or 'the value'} is not a JSON object")
        self.raw: Mapping[str, Any] = raw
        self.where = where
        self.error = error

    @classmethod
    def versioned(
        cls,
        raw: object,
        version: int,
        where: str,
        error: type[Exception] = ValueError,
        *,
        what: str = "version",
        hint: str = "",
        key: str = "v",
    ) -> Self:
        """The fields of ``raw``, a JSON object whose ``key`` is the integer
        ``version``; else ``error``, naming ``where`` and the version found
        (``what``: which version it is, e.g. ``"protocol version"``; ``hint``:
        what to do, in parentheses after it)."""
        fields = cls(raw, where, error)
        found = fields.raw.get(key)
        if type(found) is not int or found != version:
            about = f" ({hint})" if hint else ""
            raise error(
                f"{where or 'the value'} has {what} {found!r}; "
                f"this elastrun reads version {version}{about}"
            )
        return fields

    def bad(self, name: str, what: str) -> Exception:
        """The error for field ``name``, which is ``what``."""
        return self.error(f"{self.where}: {name} is {what}" if self.where else f"{name} is {what}")

    def absent(self, name: str) -> bool:
        """True when ``name`` is absent or null."""
        return self.raw.get(name) is None

    # -- strict -------------------------------------------------------------------
    def integer(self, name: str, *, low: int = 0, high: int | None = None) -> int:
        """An integer within [low, high] (``high`` by default: :attr:`INT_HIGH`)."""
        value = self.raw.get(name)
        if high is None:
            high = self.INT_HIGH
        if type(value) is not int or not low <= value <= high:  # JSON's ints: bool is not one
            raise self.bad(
                name, "missing" if value is None else f"not an integer from {low} to {high}"
            )
        return value

    def optional_integer(self, name: str, *, low: int = 0, high: int | None = None) -> int | None:
        return None if self.absent(name) else self.integer(name, low=low, high=high)

    def number(self, name: str, *, low: float | None = 0, high: float | None = MAX_COUNT) -> float:
        """A finite number within [low, high] (None: no bound)."""
        value = self.raw.get(name)
        if value is None:
            raise self.bad(name, "missing")
        if (
            not is_number(value)
            or (low is not None and value < low)
            or (high is not None and value > high)
        ):
            if low is None and high is None:
                raise self.bad(name, "not a finite number")
            raise self.bad(name, f"not a number from {_show(low)} to {_show(high)}")
        return float(value)

    def optional_number(
        self, name: str, *, low: float | None = 0, high: float | None = MAX_COUNT
    ) -> float | None:
        return None if self.absent(name) else self.number(name, low=low, high=high)

    def text(self, name: str, limit: int | None = None) -> str:
        """A string of at most ``limit`` characters (None: any length)."""
        value = self.raw.get(name)
        if value is None:
            raise self.bad(name, "missing")
        if not isinstance(value, str) or (limit is not None and len(value) > limit):
            raise self.bad(
                name,
                "not a string" if limit is None else f"not a string of at most {limit} characters",
            )
        return value

    def optional_text(self, name: str, limit: int | None = None) -> str | None:
        return None if self.absent(name) else self.text(name, limit)

    def flag(self, name: str, default: bool | None = False) -> bool:
        """True or false; absent reads as ``default`` (None: required)."""
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise self.bad(name, "not true or false")
        return value

    def items(self, name: str, limit: int | None = None, *, required: bool = False) -> list[Any]:
        """A list of at most ``limit`` items; absent reads as empty unless ``required``."""
        value = self.raw.get(name)
        if value is None and not required:
            return []
        if not isinstance(value, list) or (limit is not None and len(value) > limit):
            raise self.bad(
                name, "not a list" if limit is None else f"not a list of at most {limit} items"
            )
        return value

    def strings(
        self, name: str, limit: int | None = None, *, required: bool = False
    ) -> tuple[str, ...]:
        """A list of strings (of at most ``limit`` items)."""
        value = self.items(name, limit, required=required)
        if not all(isinstance(x, str) for x in value):
            raise self.bad(name, "not a list of strings")
        return tuple(value)

    # -- lenient: absent or of another type reads as None ---------------------------
    def maybe_int(self, name: str) -> int | None:
        value = self.raw.get(name)
        return value if is_int(value) else None

    def maybe_number(self, name: str) -> float | None:
        value = self.raw.get(name)
        return float(value) if is_number(value) else None

    def maybe_text(self, name: str) -> str | None:
        value = self.raw.get(name)
        return value if isinstance(value, str) else None
