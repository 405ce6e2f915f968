"""Reading a store record's fields, each checked as it is read.

The rules (see :mod:`.records`): a field the protocol decides on must hold
its type and range (:meth:`Fields.integer`, :meth:`~Fields.text`,
:meth:`~Fields.node_id`, ...), else :class:`~elastrun.errors.ProtocolError`
names the record and the field; a field kept for people reads as absent when
it is absent or of another type (:meth:`~Fields.note`, :meth:`~Fields.wall`,
:meth:`~Fields.failure`, :meth:`~Fields.maybe_count`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import TypeGuard, TypeVar

from elastrun.errors import ProtocolError
from elastrun.failure import FailureRecord
from elastrun.rendezvous import keys as K
from elastrun.untrusted import printable

__all__ = ["MAX_ADDRESS", "MAX_COUNT", "Fields"]

MAX_COUNT = 2**53  # what a JSON number holds exactly
MAX_ADDRESS = 1024  # a host name or an address, in characters

E = TypeVar("E", bound=enum.Enum)


class Fields:
    """The fields of one record, each checked as it is read (see the module
    doc); every problem is a ProtocolError naming ``where`` and the field."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"{where} is not a JSON object")
        self.raw: Mapping[str, object] = raw
        self.where = where

    def bad(self, name: str, what: str) -> ProtocolError:
        return ProtocolError(f"{self.where}: {name} is {what}")

    def _present(self, name: str) -> object:
        value = self.raw.get(name)
        if value is None:
            raise self.bad(name, "missing")
        return value

    def integer(self, name: str, *, low: int = 0, high: int = MAX_COUNT) -> int:
        value = self._present(name)
        if not _is_int(value) or not low <= value <= high:
            raise self.bad(name, f"not an integer from {low} to {high}")
        return value

    def optional_integer(self, name: str, *, low: int = -MAX_COUNT) -> int | None:
        return None if self.raw.get(name) is None else self.integer(name, low=low)

    def count(self, name: str, default: int) -> int:
        """A count that older records may lack (``default``)."""
        return default if self.raw.get(name) is None else self.integer(name)

    def port(self, name: str) -> int:
        return self.integer(name, low=1, high=65535)

    def number(self, name: str) -> float:
        value = self._present(name)
        if not _is_number(value) or not 0 <= value <= MAX_COUNT:
            raise self.bad(name, f"not a number from 0 to {MAX_COUNT}")
        return value

    def text(self, name: str, limit: int = MAX_ADDRESS) -> str:
        value = self._present(name)
        if not isinstance(value, str) or len(value) > limit:
            raise self.bad(name, f"not a string of at most {limit} characters")
        return value

    def node_id(self, name: str = "node_id") -> str:
        value = self._present(name)
        if not isinstance(value, str) or not K.valid_node_id(value):
            raise self.bad(name, f"not a node id ({K.NODE_ID.pattern})")
        return value

    def flag(self, name: str) -> bool:
        value = self.raw.get(name, False)
        if not isinstance(value, bool):
            raise self.bad(name, "not true or false")
        return value

    def items(self, name: str) -> list[object]:
        value = self.raw.get(name, [])
        if not isinstance(value, list):
            raise self.bad(name, "not a list")
        return value

    def choice(self, name: str, kind: type[E]) -> E:
        """One of the values of the enumeration ``kind``."""
        value = self.raw.get(name)
        try:
            return kind(value)
        except ValueError:
            values = ", ".join(str(e.value) for e in kind)
            raise self.bad(
                name, f"{printable(repr(value), limit=80)}, not one of {values}"
            ) from None

    # For people: absent, null or of another type reads as absent.
    def note(self, name: str) -> str:
        value = self.raw.get(name)
        return value if isinstance(value, str) else ""

    def wall(self, name: str) -> float | None:
        value = self.raw.get(name)
        return float(value) if _is_number(value) and math.isfinite(value) else None

    def failure(self, name: str) -> FailureRecord | None:
        return FailureRecord.from_json(self.raw.get(name))

    def maybe_count(self, name: str) -> int | None:
        value = self.raw.get(name)
        return value if _is_int(value) and 0 <= value <= MAX_COUNT else None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
