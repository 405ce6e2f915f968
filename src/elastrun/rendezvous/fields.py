"""Reading a store record's fields, each checked as it is read
(:class:`elastrun.fields.Fields`, with the records' own kinds of field).

The rules (see :mod:`.records`): a field the protocol decides on must hold
its type and range (:meth:`Fields.integer`, :meth:`~Fields.text`,
:meth:`~Fields.node_id`, ...), else :class:`~elastrun.errors.ProtocolError`
names the record and the field; a field kept for people reads as absent when
it is absent or of another type (:meth:`~Fields.note`, :meth:`~Fields.wall`,
:meth:`~Fields.failure`, :meth:`~Fields.maybe_count`).
"""

from __future__ import annotations

import enum
from typing import TypeVar

from elastrun.errors import ProtocolError
from elastrun.failure import FailureRecord
from elastrun.fields import MAX_COUNT
from elastrun.fields import Fields as Checked
from elastrun.rendezvous import keys as K
from elastrun.untrusted import printable

__all__ = ["MAX_ADDRESS", "MAX_COUNT", "Fields"]

MAX_ADDRESS = 1024  # a host name or an address, in characters

E = TypeVar("E", bound=enum.Enum)


class Fields(Checked):
    """The fields of one record, each checked as it is read (see the module
    doc); every problem is a ProtocolError naming ``where`` and the field."""

    __slots__ = ()

    def __init__(self, raw: object, where: str) -> None:
        super().__init__(raw, where, ProtocolError)

    def optional_integer(
        self, name: str, *, low: int = -MAX_COUNT, high: int | None = None
    ) -> int | None:
        return super().optional_integer(name, low=low, high=high)

    def count(self, name: str, default: int) -> int:
        """A count that older records may lack (``default``)."""
        return default if self.absent(name) else self.integer(name)

    def port(self, name: str) -> int:
        return self.integer(name, low=1, high=65535)

    def text(self, name: str, limit: int | None = MAX_ADDRESS) -> str:
        return super().text(name, limit)

    def node_id(self, name: str = "node_id") -> str:
        value = self.raw.get(name)
        if value is None:
            raise self.bad(name, "missing")
        if not isinstance(value, str) or not K.valid_node_id(value):
            raise self.bad(name, f"not a node id ({K.NODE_ID.pattern})")
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
        return self.maybe_text(name) or ""

    def wall(self, name: str) -> float | None:
        return self.maybe_number(name)

    def failure(self, name: str) -> FailureRecord | None:
        return FailureRecord.from_json(self.raw.get(name))

    def maybe_count(self, name: str) -> int | None:
        value = self.maybe_int(name)
        return value if value is not None and 0 <= value <= MAX_COUNT else None
