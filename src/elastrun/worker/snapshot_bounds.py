"""The checks a snapshot's header passes before anything it says is used
(:mod:`elastrun.worker.snapshot`): a slot is written by the worker, but read
back after a crash, a bit flip, a truncation or a stranger's edit, so every
field is bounded before memory is allocated for it, and the whole header is
covered by a hash of its own.

* **Size.** At most ``MAX_HEADER`` bytes and ``MAX_VALUES`` JSON values
  (counted before decoding: decoding costs at most ~70 bytes of memory per
  value, so a header's parse takes at most ~150 MB whatever it holds),
  nested at most ``MAX_DEPTH`` levels. A real header costs ~150-250 bytes and ~13
  values per tensor: the bounds fit ~70,000-100,000 tensors in one rank's
  state.
  The writer refuses a larger state before a byte is written.
* **Seal.** The header begins ``{"hsha":"<64 hex>",``: the SHA-256 of the
  header's bytes with those 64 characters as zeros. It covers everything the
  header says (step, rank, world, generation, each tensor's place, the tree,
  the data's digest and its algorithm, which cover the data), so a header
  changed after it was written (a bit flip, a step, shape or rank edited) is
  refused.
* **Digest** (:mod:`elastrun.worker.snapshot_digest`): one of a fixed list
  of algorithms, and chunks of a fixed size, never read from the header: the
  work a header can ask for is one pass over data that lies in the file.
* **Layout** (:func:`check_layout`): the tensors in offset order, 64-byte
  aligned, none overlapping, and the data exactly as long as they need.
* **Tree** (:func:`check_tree`): every node of a known kind (a sharded
  tensor's layout read by :class:`~elastrun.worker.shard_layout.ShardLayout`), and every
  tensor named exactly once, so that a header that passes is decoded
  without an error.

Standard library only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from elastrun.untrusted import outside_strings
from elastrun.worker.shard_layout import LayoutError, ShardLayout

__all__ = [
    "MAX_HEADER",
    "MAX_VALUES",
    "SEAL",
    "check_layout",
    "check_tree",
    "count_values",
    "seal",
    "sealed_digest",
]

MAX_HEADER = 16 << 20
MAX_VALUES = 1 << 21
SEAL = b'{"hsha":"'
_DIGEST = slice(len(SEAL), len(SEAL) + 64)
_ZEROS = b"0" * 64
_AFTER = b'",'


class _Entry(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


def count_values(raw: bytes, bound: int = MAX_VALUES) -> int:
    """How many JSON values (and object keys) the text ``raw`` holds: its
    commas and opening brackets outside strings, plus one. Exact when over
    ``bound``; at most ``bound``, it may count more (cheaper: its length,
    then the marks inside strings too, ~1 ms per MB; without them, only
    when that is over ``bound``: ~10 ms per MB)."""
    if len(raw) < bound:
        return len(raw)  # a value takes at least one byte
    marks = _marks(raw)
    if marks <= bound:
        return marks
    return _marks(outside_strings(raw))


def _marks(text: bytes) -> int:
    return text.count(b",") + text.count(b"[") + text.count(b"{") + 1


def seal(body: bytes) -> bytes:
    """The header ``body`` (a JSON object's bytes, ``{...}``) with its seal first."""
    unsealed = SEAL + _ZEROS + _AFTER + body[1:]
    digest = hashlib.sha256(unsealed).hexdigest().encode()
    return SEAL + digest + unsealed[_DIGEST.stop :]


def sealed_digest(raw: Any) -> tuple[str, str] | None:
    """(the seal a header's bytes state, the one they have); None when they
    have no seal (a snapshot written before seals: a disk copy)."""
    view = memoryview(raw)
    if bytes(view[: len(SEAL)]) != SEAL or bytes(view[_DIGEST.stop : _DIGEST.stop + 2]) != _AFTER:
        return None
    h = hashlib.sha256()
    h.update(SEAL)
    h.update(_ZEROS)
    h.update(view[_DIGEST.stop :])
    return bytes(view[_DIGEST]).decode("ascii", "replace"), h.hexdigest()


def check_layout(entries: Sequence[_Entry], data_size: int) -> str | None:
    """Why the tensors' places do not fit the data (None: they do): in
    order, aligned, not overlapping, and the data as long as they need."""
    end = 0
    for e in entries:
        if e.offset % 64:
            return f"tensor {e.key}: its offset {e.offset} is not 64-byte aligned"
        if e.offset < end:
            return f"tensor {e.key}: its bytes overlap the tensor before it"
        end = e.offset + e.nbytes
        if end > data_size:
            return f"tensor {e.key}: its bytes lie outside the data"
    need = -(-end // 64) * 64
    if data_size != need:
        return f"its data size {data_size} is not the {need} bytes its tensors take"
    return None


def check_tree(tree: Any, tensors: int) -> str | None:
    """Why ``tree`` is not a state tree naming each of ``tensors`` tensors
    exactly once (None: it is). Iterative: the depth was bounded when read."""
    used = bytearray(tensors)
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or len(node) != 1:
            return "its tree holds a node that is not a one-key object"
        ((kind, value),) = node.items()
        check = _NODES.get(kind)
        if check is None:
            return f"its tree holds a node of an unknown kind ({str(kind)[:20]!r})"
        why = check(value, used, stack)
        if why is not None:
            return why
    if not all(used):
        return "its header lists tensors that its tree does not use"
    return None


def _tensor(value: Any, used: bytearray, _stack: list[Any]) -> str | None:
    if type(value) is not int or not 0 <= value < len(used):
        return "its tree names a tensor that is not in its header"
    if used[value]:
        return f"its tree names tensor {value} twice"
    used[value] = 1
    return None


def _sharded(value: Any, used: bytearray, stack: list[Any]) -> str | None:
    """A DTensor's local shard: ``[tensor index, layout]``."""
    if not isinstance(value, list) or len(value) != 2:
        return "its tree holds a sharded tensor that is not [tensor, layout]"
    try:
        ShardLayout.from_json(value[1])
    except LayoutError as e:
        return f"its tree holds a sharded tensor whose layout is damaged: {e}"
    return _tensor(value[0], used, stack)


def _value(value: Any, *_: Any) -> str | None:
    if value is not None and type(value) not in (bool, int, str):
        return "its tree holds a value of an unknown type"
    return None


def _float(value: Any, *_: Any) -> str | None:
    try:
        float.fromhex(value)
    except (TypeError, ValueError):
        return "its tree holds a float that is not one"
    return None


def _dict(value: Any, _used: bytearray, stack: list[Any]) -> str | None:
    if not isinstance(value, list):
        return "its tree holds a dict that is not a list of pairs"
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) not in (str, int):
            return "its tree holds a dict entry that is not a [key, value] pair"
        stack.append(pair[1])
    return None


def _list(value: Any, _used: bytearray, stack: list[Any]) -> str | None:
    if not isinstance(value, list):
        return "its tree holds a list that is not one"
    stack.extend(value)
    return None


_NODES: dict[Any, Callable[[Any, bytearray, list[Any]], str | None]] = {
    "t": _tensor,
    "s": _sharded,
    "v": _value,
    "f": _float,
    "d": _dict,
    "l": _list,
    "u": _list,
}
