"""``elastrun.launch()``: launch workers from Python (torch's ``elastic_launch``).

Two kinds of entrypoint:

* a command (``str``): a ``.py`` path runs as ``python -u script *args`` (like
  the CLI); anything else is executed as a program with ``*args`` (torch's
  semantics for a str entrypoint, e.g. ``launch(cfg, "/bin/bash", "job.sh")``).
  Returns the agent's exit code.
* a function: a module-level function importable by name, with JSON
  arguments. Each worker runs ``python -m elastrun.worker._fn_runner`` (no
  pickle of arbitrary objects anywhere); returns ``{global_rank: return
  value}`` for this node's workers (JSON data, or tensors and
  ``state_dict``-shaped trees of them, read back with torch's
  ``weights_only`` load: ``worker/_fn_results.py``), or raises
  :class:`~elastrun.errors.WorkerError` when they failed.

Functions defined in the launching script are fine (the script is loaded as
``__mp_main__`` in workers, as multiprocessing does): guard the ``launch()``
call with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from elastrun.agent.command import Executable, PythonModule, PythonScript, WorkerCommand
from elastrun.errors import ConfigError, WorkerError
from elastrun.launcher.config import LaunchConfig
from elastrun.worker._fn_results import read_results

if TYPE_CHECKING:  # imported when launching: ``import elastrun`` stays light
    from elastrun.launcher.plan import Plan

__all__ = ["LaunchConfig", "launch"]

FN_SPEC_VERSION = 1
FN_WORKER_ENV = "ELASTRUN_FN_WORKER"
FN_RUNNER = "elastrun.worker._fn_runner"  # the module each function worker runs

# The checks are shared with the command line, whose messages start with the
# flag; from Python they name the LaunchConfig field instead.
_FIELD_OF_FLAG = {
    "--nnodes": "min_nodes/max_nodes",
    "--nproc-per-node": "nproc_per_node",
    "--rdzv-id": "run_id",
    "--rdzv-backend": "rdzv_backend",
    "--rdzv-endpoint": "rdzv_endpoint",
    "--rdzv-conf": "rdzv_configs",
    "--standalone": "standalone",
    "--max-restarts": "max_restarts",
    "--node-unit": "node_unit",
    "--monitor-interval": "monitor_interval",
    "--start-method": "start_method",
    "--node-rank": "node_rank",
    "--master-addr": "master_addr",
    "--master-port": "master_port",
    "--local-addr": "local_addr",
    "--log-dir": "log_dir",
    "--redirects": "redirects",
    "--tee": "tee",
    "--local-ranks-filter": "local_ranks_filter",
    "--signals-to-handle": "signals_to_handle",
    "--shutdown-timeout": "shutdown_timeout",
    "--log-template": "log_template",
    "--events-file": "events_file",
    "--hang-timeout": "hang_timeout",
    "--stack-signal": "stack_signal",
    "--exit-barrier-timeout": "exit_barrier_timeout",
    "--role": "role",
    "--warm-modules": "warm_modules",
    "--warm-join-timeout": "warm_join_timeout",
    "--numa-binding": "numa_options",
    "--virtual-local-rank": "virtual_local_rank",
    "--duplicate-stdout-filters": "duplicate_stdout_filters",
    "--duplicate-stderr-filters": "duplicate_stderr_filters",
    "--logs-specs": "logs_specs",
}


def _resolve(config: LaunchConfig, command: WorkerCommand) -> Plan:
    """plan.resolve, with errors naming the LaunchConfig field, not the flag."""
    from elastrun.launcher.plan import resolve

    try:
        return resolve(config, command)
    except ConfigError as exc:
        message = str(exc)
        flag, sep, rest = message.partition(": ")
        field = _FIELD_OF_FLAG.get(flag)
        if not sep or field is None:
            raise
        raise ConfigError(f"LaunchConfig.{field}: {rest}") from None


def _function_spec(fn: Callable[..., Any]) -> dict[str, Any]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ConfigError(
            f"launch(): entrypoint {fn!r} must be a module-level function importable by name "
            "(not a lambda, a nested function or a callable object)"
        )
    spec: dict[str, Any] = {"module": module, "qualname": qualname}
    if module == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main_file:
            raise ConfigError(
                f"launch(): {qualname} is defined in an interactive session; define it in a "
                "module or a script file"
            )
        spec["file"] = os.path.abspath(main_file)
    else:
        target: Any = sys.modules.get(module)
        for part in qualname.split("."):
            target = getattr(target, part, None)
        if target is not fn:
            raise ConfigError(
                f"launch(): {module}:{qualname} does not name {fn!r}; pass a module-level function"
            )
    return spec


def _source(fn: Callable[..., Any]) -> str | None:
    """The file of ``fn``'s module (its imports are what the workers import:
    the warm interpreter's head start, agent/warm.py), when it has one."""
    path = getattr(sys.modules.get(getattr(fn, "__module__", "")), "__file__", None)
    return os.path.abspath(path) if isinstance(path, str) and path.endswith(".py") else None


def _json_args(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    for i, arg in enumerate(args):
        try:
            json.dumps(arg, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"launch(): argument {i} ({type(arg).__name__}) is not JSON-serializable: {exc}; "
                "pass JSON data (workers receive it decoded, tuples as lists)"
            ) from None
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"launch(): keyword arguments are not JSON-serializable: {exc}") from None


def _command(entrypoint: str, args: Sequence[Any]) -> WorkerCommand:
    if not entrypoint:
        raise ConfigError("launch(): empty entrypoint")
    str_args = tuple(str(a) for a in args)
    if entrypoint.endswith(".py"):
        if not os.path.isfile(entrypoint):
            raise ConfigError(f"launch(): script {entrypoint!r} not found")
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        return PythonScript(entrypoint, str_args, python=python)
    return Executable((entrypoint, *str_args))


def launch(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> int | dict[int, Any]:
    """Run ``entrypoint`` on ``config.nproc_per_node`` workers of this node, as
    one node of the job ``config`` describes. Blocks until the job ends."""
    from elastrun.launcher.run import run_plan

    if os.environ.get(FN_WORKER_ENV):
        raise ConfigError(
            "launch(): called inside a worker that launch() started; guard the call with "
            "'if __name__ == \"__main__\":'"
        )
    if isinstance(entrypoint, str):
        if kwargs:
            raise ConfigError("launch(): keyword arguments need a function entrypoint")
        command = _command(entrypoint, args)
        if isinstance(command, Executable):
            config = dataclasses.replace(config, warm=False)  # a program, not Python
        return run_plan(_resolve(config, command))
    if not callable(entrypoint):
        raise ConfigError(f"launch(): entrypoint must be a str or a function, got {entrypoint!r}")
    import tempfile

    spec = _function_spec(entrypoint)
    _json_args(args, kwargs)
    with tempfile.TemporaryDirectory(prefix="elastrun-fn-") as tmp:
        results = os.path.join(tmp, "results")
        os.mkdir(results)
        spec.update(
            v=FN_SPEC_VERSION,
            args=list(args),
            kwargs=kwargs,
            results=results,
            sys_path=[p for p in sys.path if p],
        )
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        env = {**config.env, FN_WORKER_ENV: "1"}
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        plan = _resolve(
            dataclasses.replace(config, env=env),
            PythonModule(FN_RUNNER, (spec_path,), python=python, source=_source(entrypoint)),
        )
        code = run_plan(plan)
        if code != 0:
            raise WorkerError(
                f"launch(): the workers of {spec['qualname']} failed (agent exit code {code}); "
                "see the failure summary above"
            )
        return read_results(results)
