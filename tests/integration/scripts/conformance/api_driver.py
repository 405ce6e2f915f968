"""Runs ``elastrun.launch()`` conformance cases in their own process.

    python -m tests.integration.scripts.conformance.api_driver CASE CONFIG_JSON [DIR]
    python -m tests.integration.scripts.conformance.api_driver --cases CASES_JSON

CONFIG_JSON holds LaunchConfig fields. For one case: prints one JSON line
``{"result": ...}`` (an exit code, or the per-rank results of a function) and
exits 0, or prints ``{"error": type, "message": ...}`` and exits 3.

With ``--cases`` (a JSON list of ``[CASE, CONFIG, DIR]``) the cases run one
after the other, each a launch of its own (one interpreter start and one
``import torch`` for all of them): before each, a line with the
case's index on stdout and on stderr (batch.mark), then its JSON line as above; exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import elastrun
from tests.integration.scripts.conformance.batch import mark
from tests.integration.scripts.conformance.functions import (
    dummy_compute,
    rank_sum,
    returns_an_object,
    state_dict_tree,
)
from tests.integration.scripts.conformance.plain_functions import rank_plus_ten

HERE = Path(__file__).resolve().parent


def run(case: str, config: elastrun.LaunchConfig, folder: str) -> Any:
    if case == "script":
        script = str(HERE / "touch_rank.py")
        return elastrun.launch(config, sys.executable, "-u", script, f"--touch-file-dir={folder}")
    if case == "fail":
        return elastrun.launch(config, sys.executable, "-u", str(HERE / "touch_rank.py"), "--fail")
    if case == "bash":
        return elastrun.launch(config, str(HERE / "touch_rank.sh"), folder)
    if case == "function":
        return elastrun.launch(config, rank_plus_ten)
    if case == "rank_sum":
        return elastrun.launch(config, rank_sum)
    if case == "tensors":
        return shown(elastrun.launch(config, dummy_compute))
    if case == "state_dict":
        return shown(elastrun.launch(config, state_dict_tree))
    if case == "object":
        return elastrun.launch(config, returns_an_object)
    if case == "env":  # folder: the variables to show, comma-separated
        script = str(HERE / "show_env.py")
        return elastrun.launch(
            config, sys.executable, "-u", script, *folder.split(","), "--say", "apple pie"
        )
    raise SystemExit(f"unknown case {case!r}")


def shown(value: Any) -> Any:
    """Returned tensors as JSON: ``{"tensor": type, "dtype", "values"}``;
    tuples as ``{"tuple": [...]}`` (what came back, as it came)."""
    if isinstance(value, dict):
        return {str(k): shown(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"tuple": [shown(v) for v in value]}
    if isinstance(value, list):
        return [shown(v) for v in value]
    if type(value).__module__.startswith("torch"):
        return {"tensor": type(value).__name__, "dtype": str(value.dtype), "values": value.tolist()}
    return value


def torch_objects(fields: dict[str, Any]) -> dict[str, Any]:
    """torch's own types for the fields that take them: ``logs_specs`` as
    DefaultLogsSpecs(log_dir, redirects, tee), ``numa_options`` as NumaOptions."""
    if "logs_specs" in fields:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        raw = fields["logs_specs"]
        fields["logs_specs"] = DefaultLogsSpecs(
            log_dir=raw["log_dir"], redirects=Std(raw["redirects"]), tee=Std(raw["tee"])
        )
    if "numa_options" in fields:
        from torch.numa.binding import AffinityMode, NumaOptions

        fields["numa_options"] = NumaOptions(affinity_mode=AffinityMode(fields["numa_options"]))
    return fields


def one(case: str, fields: dict[str, Any], folder: str) -> int:
    """Runs one case and prints its JSON line; 0, or 3 for an elastrun error."""
    try:
        result = run(case, elastrun.LaunchConfig(**torch_objects(fields)), folder)
    except elastrun.ElastrunError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 3
    signals = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    print(json.dumps({"result": result, "signals_to_handle": signals}), flush=True)
    return 0


def main() -> int:
    if sys.argv[1] == "--cases":
        for index, (case, fields, folder) in enumerate(json.loads(sys.argv[2])):
            mark(index)
            one(case, fields, folder)
        return 0
    folder = sys.argv[3] if len(sys.argv) > 3 else ""
    return one(sys.argv[1], json.loads(sys.argv[2]), folder)


if __name__ == "__main__":
    raise SystemExit(main())
