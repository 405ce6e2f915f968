"""Decoding once: the same key and the same bytes give the value decoded before.

Every node decodes the round record and its round's result; where many nodes
share one process (the simulated agents of bench/rdzv_bench.py) each is
decoded once, not once per node. Decoding is a function of the keys and the
bytes and the values decoded are immutable, so reusing one changes nothing; a
value that does not decode raises every time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from elastrun.store.base import KeyValue

__all__ = ["KeysMemo", "Memo"]

R = TypeVar("R")
T = TypeVar("T")


class Memo(Generic[R]):
    """``decode(key, value)``, reused for the same key and the same bytes.
    Holds the last ``size`` keys' values."""

    def __init__(self, decode: Callable[[str, bytes], R], size: int = 8) -> None:
        self._decode = decode
        self._size = size
        self._last: dict[str, tuple[bytes, R]] = {}

    def __call__(self, key: str, value: bytes) -> R:
        found = self._last.get(key)
        if found is not None and found[0] == value:
            return found[1]
        decoded = self._decode(key, value)
        self._last.pop(key, None)
        if len(self._last) >= self._size:
            del self._last[next(iter(self._last))]
        self._last[key] = (value, decoded)
        return decoded


class KeysMemo(Generic[T]):
    """``decode(kvs)`` of several keys read together, reused for the same
    keys and bytes (as :class:`Memo` for one key): the last ``size``."""

    def __init__(self, decode: Callable[[tuple[KeyValue, ...]], T], size: int = 8) -> None:
        self._decode = decode
        self._size = size
        self._last: dict[tuple[str, ...], tuple[tuple[bytes, ...], T]] = {}

    def __call__(self, kvs: tuple[KeyValue, ...]) -> T:
        keys, values = tuple(kv.key for kv in kvs), tuple(kv.value for kv in kvs)
        found = self._last.get(keys)
        if found is not None and found[0] == values:
            return found[1]
        decoded = self._decode(kvs)
        self._last.pop(keys, None)
        if len(self._last) >= self._size:
            del self._last[next(iter(self._last))]
        self._last[keys] = (values, decoded)
        return decoded
