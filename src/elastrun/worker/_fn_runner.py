"""Runs a Python function as a worker for :func:`elastrun.launch` (no pickle).

``python -m elastrun.worker._fn_runner SPEC.json``. The spec (JSON, written by
the launcher) names the function by module and qualified name (or by the
file of the launching ``__main__`` script, loaded as ``__mp_main__`` like
multiprocessing's spawn does) and carries JSON arguments. The function's
return value is written by :mod:`._fn_results` (JSON data, or tensors). A
process group the function left up is shut down before the interpreter exits
(``_settle.py``), so a finished worker cannot abort in its teardown.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Mapping
from typing import Any

from elastrun.fields import Fields
from elastrun.untrusted import ascii_int
from elastrun.worker._fn_results import write_result
from elastrun.worker._settle import after_success

SPEC_VERSION = 1


def _resolve(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def load_function(spec: Mapping[str, Any]) -> Any:
    qualname = str(spec["qualname"])
    if spec.get("file"):
        namespace = runpy.run_path(str(spec["file"]), run_name="__mp_main__")
        head, _, rest = qualname.partition(".")
        obj = namespace[head]
        return _resolve(obj, rest) if rest else obj
    module = importlib.import_module(str(spec["module"]))
    return _resolve(module, qualname)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m elastrun.worker._fn_runner SPEC.json\n")
        return 2
    rank = ascii_int(os.environ.get("RANK", "") or "0")  # ASCII only: not int('٣')
    if rank is None:
        sys.stderr.write(f"elastrun: RANK={os.environ['RANK'][:64]!r} is not an integer\n")
        return 2
    with open(argv[0], encoding="utf-8") as f:
        try:
            spec = Fields.versioned(json.load(f), SPEC_VERSION, "the function spec").raw
        except ValueError as exc:
            sys.stderr.write(f"elastrun: {exc}\n")
            return 2
    for entry in reversed(spec.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    fn = load_function(spec)
    with after_success():  # then torch.distributed is shut down before exit
        result = fn(*spec.get("args", []), **spec.get("kwargs", {}))
    local_rank = os.environ.get("LOCAL_RANK", "0")
    problem = write_result(str(spec["results"]), local_rank, rank, result)
    if problem:
        sys.stderr.write(
            f"elastrun: the return value of {spec['qualname']} on rank {rank} {problem}\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)
