"""The return values of the functions :func:`elastrun.launch` runs: written by
each worker, read by the launching process. No pickle of arbitrary objects.

A worker's value is written to ``{results}/local_{LOCAL_RANK}.json`` when it
is JSON data (dict, list, str, number, bool, None), as ``{"rank": R,
"result": value}``. A value holding tensors (a tensor, or a
``state_dict``-shaped tree: dicts, lists and tuples of tensors, numbers,
strings, bools and None) is written with ``torch.save`` to
``local_{LOCAL_RANK}.pt`` instead, and read back with ``torch.load(...,
weights_only=True)``: torch's restricted unpickler, which builds tensors and
those containers and refuses anything else, so a results file cannot run
code in the launching process. Any other value is refused in the worker, with
one line naming its type.

Standard library only: the worker uses the ``torch`` its function already
imported (a value cannot hold a tensor otherwise); the launching process
imports torch only when a worker wrote a ``.pt`` file.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

__all__ = ["MAX_TREE_DEPTH", "read_results", "tensor_tree_problem", "write_result"]

MAX_TREE_DEPTH = 64  # nesting of a returned tree of tensors
_SCALARS = (int, float, bool, str, type(None))


def _new_file(path: str) -> Any:
    """A new file (no link followed, never an existing name), binary."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), "wb")


def tensor_tree_problem(value: Any, tensor_type: type, depth: int = 0) -> str | None:
    """None when ``value`` is a tree of tensors torch's ``weights_only`` load
    reads back; else what is not (a type name, or the depth)."""
    if depth > MAX_TREE_DEPTH:
        return f"nested more than {MAX_TREE_DEPTH} levels deep"
    if isinstance(value, (tensor_type, *_SCALARS)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                return f"a dict key of type {type(key).__name__}"
            problem = tensor_tree_problem(item, tensor_type, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            problem = tensor_tree_problem(item, tensor_type, depth + 1)
            if problem:
                return problem
        return None
    return f"a value of type {type(value).__module__}.{type(value).__qualname__}"


def write_result(results: str, local_rank: str, rank: int, value: Any) -> str | None:
    """Write ``value``; returns None, or why it cannot be returned (one line)."""
    payload = {"rank": rank, "result": value}
    path = os.path.join(results, f"local_{local_rank}")
    torch: Any = None
    try:
        data = json.dumps(payload).encode("utf-8")
        path += ".json"
    except (TypeError, ValueError) as exc:
        torch = sys.modules.get("torch")  # a tensor in it means torch is loaded
        problem = str(exc) if torch is None else tensor_tree_problem(value, torch.Tensor)
        if problem:
            return (
                f"is neither JSON data nor a tree of tensors ({problem}); return JSON data "
                "(dict, list, str, number, bool, None), tensors, or dicts and lists of them"
            )
        data = b""
        path += ".pt"
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    with _new_file(tmp) as f:
        if torch is not None:
            torch.save(payload, f)
        else:
            f.write(data)
    os.replace(tmp, path)
    return None


def read_results(results: str) -> dict[int, Any]:
    """``{global rank: value}`` of the files the workers wrote in ``results``."""
    out: dict[int, Any] = {}
    for name in sorted(os.listdir(results)):
        path = os.path.join(results, name)
        if name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        elif name.endswith(".pt"):
            import torch  # only for tensors a worker returned

            record = torch.load(path, weights_only=True)
        else:
            continue
        out[int(record["rank"])] = record["result"]
    return out
