"""Data from outside this process, made safe to parse and to print.

Everything read from the store (another node's notes and records), from a
shared folder or from a cache file may have been written by someone else:

* :func:`loads` decodes JSON within bounds: at most ``max_bytes`` bytes and
  ``max_depth`` levels of nesting (counted before decoding, so ``[`` repeated
  100000 times is refused in linear time, never a ``RecursionError``).
  Anything else is :class:`UntrustedData`, a ``ValueError`` naming the problem.
* :func:`printable` makes a string safe for a terminal: control characters
  (C0, DEL, C1), and the bidirectional overrides that reorder what a reader
  sees, become visible escapes (``\\x1b``, ``\\u202e``); newlines and tabs are
  kept only where the caller allows several lines.
* :func:`ascii_int` and :func:`ascii_decimal` read a number given as text (a
  flag, an environment variable, a ``--rdzv-conf`` value): ASCII digits only,
  at most :data:`MAX_NUMBER_TEXT` characters, or None. Python's ``int()`` and
  ``float()`` take any Unicode digit (``int('٣') == 3``; ``'²'.isdigit()`` is
  True yet ``int('²')`` raises), ``'1_000'``, ``'nan'``, ``'inf'`` and
  thousands of digits (then ``ValueError``); these take none of them. Every
  number elastrun reads from text is parsed by them (the launcher's flags
  through :mod:`elastrun.launcher.limits`; the worker's programs load this
  file by its path, so it stays standard library only).

Standard library only.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_NUMBER_TEXT",
    "UntrustedData",
    "ascii_decimal",
    "ascii_int",
    "depth",
    "loads",
    "outside_strings",
    "printable",
]

MAX_DEPTH = 32
MAX_NUMBER_TEXT = 64  # characters: longer "numbers" are refused unread

_INT = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")

# A string (removed), or from a quote that no string ends to the end (kept: its
# brackets count). Each quote is scanned from once: linear time, whereas a
# pattern that fails at an unterminated quote is tried again from each quote
# after it (quadratic: a text of escaped quotes took seconds per 10 kB).
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|(?P<tail>".*)', re.DOTALL)
# bytes.translate tables: keep only the brackets, quotes and backslashes; and
# make every bracket a square one (the depth counts either kind alike).
_MARKS = bytes(sorted(set(range(256)) - set(b'[]{}"\\')))
_NON_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SQUARE = bytes.maketrans(b"{}", b"[]")
# Passes of dropping the innermost pairs tried before counting bracket by bracket.
_PASSES = 64
_OPEN = ord("[")
# C0 controls but \t and \n, DEL, C1 controls, and the bidirectional
# embeddings, overrides and isolates (they reorder text on screen).
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL_LINES = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}]")


class UntrustedData(ValueError):
    """Data from outside that is malformed or over a bound."""


def ascii_int(text: str) -> int | None:
    """``[+-]digits`` in ASCII (spaces around allowed), at most
    :data:`MAX_NUMBER_TEXT` characters; None for anything else."""
    raw = str(text).strip()
    if len(raw) > MAX_NUMBER_TEXT or _INT.fullmatch(raw) is None:
        return None
    return int(raw)


def ascii_decimal(text: str) -> float | None:
    """A finite decimal number in ASCII (``30``, ``-2.5``, ``1e3``; spaces
    around allowed), at most :data:`MAX_NUMBER_TEXT` characters; None for
    anything else (``nan``, ``inf``, ``1_000``, Unicode digits, ``1e999``)."""
    raw = str(text).strip()
    if len(raw) > MAX_NUMBER_TEXT or _DECIMAL.fullmatch(raw) is None:
        return None
    value = float(raw)
    return value if value - value == 0 else None  # finite (1e999 is inf)


def depth(data: bytes) -> int:
    """The deepest nesting of ``[`` and ``{`` in the JSON text ``data``
    (brackets inside strings not counted). Linear, and in C for records
    without escapes and with few levels (a round's result of thousands of
    members: well under a millisecond)."""
    brackets = _brackets(data)
    if not brackets:
        return 0
    # Balanced brackets nested d deep lose their innermost pairs in each of
    # d passes (each a C loop): a record's few levels are a few passes.
    rest = brackets
    for passes in range(_PASSES):
        inner = rest.replace(b"[]", b"")
        if not inner:
            return passes + 1
        if len(inner) == len(rest):
            break
        rest = inner
    # Unbalanced, or deeper than the passes tried: count every bracket.
    steps = (1 if b == _OPEN else -1 for b in brackets)
    return max(itertools.accumulate(steps))


def _brackets(data: bytes) -> bytes:
    """The brackets of ``data`` outside its strings, in order, all as ``[``/``]``."""
    marks = data.translate(None, _MARKS)
    if b"\\" not in marks:
        # Without escapes, quotes pair up in order; dropping two adjacent ones
        # only joins two strings with nothing but a quote pair between them.
        unquoted = marks.replace(b'""', b"")
        if b'"' not in unquoted:
            return unquoted.translate(_SQUARE)
    return outside_strings(data).translate(None, _NON_BRACKETS).translate(_SQUARE)


def outside_strings(data: bytes) -> bytes:
    """The JSON text ``data`` without its strings (what follows a quote that
    no string ends is kept). Linear time."""
    return _STRINGS.sub(rb"\g<tail>", data)


def loads(
    data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH, what: str = "data"
) -> Any:
    """``data`` decoded as JSON, refused (:class:`UntrustedData`) when larger
    than ``max_bytes``, nested deeper than ``max_depth``, or not JSON."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise UntrustedData(f"{what} is {len(raw)} bytes (at most {max_bytes})")
    if depth(raw) > max_depth:
        raise UntrustedData(f"{what} is nested more than {max_depth} levels deep")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise UntrustedData(f"{what} is not valid JSON: {e}") from None


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object, *, lines: bool = False, limit: int | None = None) -> str:
    """``str(value)`` with every control character shown as an escape; with
    ``lines``, newlines and tabs are kept. ``limit``: at most that many
    characters (then ``...``)."""
    text = value if isinstance(value, str) else str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    return (_CONTROL_LINES if lines else _CONTROL).sub(_escape, text)
