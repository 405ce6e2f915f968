"""A warm spare worker: a Python interpreter that already imported torch.

The agent starts one spare per local rank while the workers run (see
``elastrun/agent/spares.py``). When the workers must be restarted, the agent
hands each spare its worker's environment and it becomes that worker: it
runs the training script (or ``-m`` module) exactly as ``python -u script``
would, minus the seconds of interpreter start and ``import torch``.

Run as ``python -u _spare.py script args`` or ``python -u _spare.py -m module
args`` (the worker's own command line, with ``_spare.py`` in front), with the
environment the worker would get (the per-round variables aside) plus
``ELASTRUN_SPARE_PRELOAD`` and ``ELASTRUN_SPARE_DELAY``, fd 0 a socket to the
agent. Protocol on that socket, one JSON line each way:

    spare -> agent   {"v": 1, "ready": true}           preload done
    agent -> spare   {"v": 1, "env": {...}, "args": [...]}   become the worker

EOF from the agent before that: exit 0 quietly (the spare was not needed).

Priority: the preload runs under ``SCHED_IDLE`` when the spare may return to
normal scheduling afterwards (root or ``CAP_SYS_NICE``), so it only uses CPU
the workers leave idle; every thread is returned to ``SCHED_OTHER`` before the
spare says ready (the agent raises a spare it needs before that). Otherwise it
waits ``--delay`` seconds (less if the agent needs it) and preloads at normal
priority. Only the standard library is imported here.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import os
import select
import sys
import threading
import types
from importlib.machinery import SourceFileLoader

PROTOCOL = 1
PRELOAD_ENV = "ELASTRUN_SPARE_PRELOAD"  # modules to import, comma-separated
DELAY_ENV = "ELASTRUN_SPARE_DELAY"  # s to wait first when idle priority is not possible
_SELF = os.path.abspath(__file__)


def _can_return_from_idle() -> bool:
    """Whether this process may leave SCHED_IDLE again (tried on a throwaway thread)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            ok.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return bool(ok and ok[0])


def _restore_priority() -> bool:
    """Every thread back to SCHED_OTHER; False if one could not be."""
    good = True
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that just ended
        except OSError:
            good = False
    return good


def _preload(modules: list[str], delay: float) -> None:
    idle = _can_return_from_idle()
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif delay > 0:
        # Let the workers import first, unless the agent already needs us.
        select.select([0], [], [], delay)
    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if idle and not _restore_priority():
        # A thread stuck at idle priority would make a slow worker: give up.
        sys.exit(3)


def _read_line(fd: int) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        buf += chunk
    return buf


def _fresh_main(file: str | None) -> dict[str, object]:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if file is not None:
        main.__file__ = file
        main.__loader__ = SourceFileLoader("__main__", file)
        main.__dict__["__cached__"] = None
    sys.modules["__main__"] = main
    return main.__dict__


def _run_script(script: str, args: list[str]) -> None:
    """As ``python script args``: argv as given, sys.path[0] the script's real
    directory, ``__file__`` absolute, a fresh ``__main__``."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    path = os.path.abspath(script)
    with open(path, "rb") as fp:
        code = compile(fp.read(), path, "exec", dont_inherit=True)
    exec(code, _fresh_main(path))  # noqa: S102 - running the user's script is the point


def _run_module(module: str, args: list[str]) -> None:
    """As ``python -m module args`` (the same runpy entry point)."""
    import runpy

    sys.argv = ["-m", *args]
    sys.path[0] = os.getcwd()
    _fresh_main(None)
    runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]


def _strip_own_frames(exc: BaseException) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == _SELF:
        tb = tb.tb_next
    exc.__traceback__ = tb


def main(argv: list[str]) -> None:
    # argv as the worker's own, after the interpreter: "script args" or "-m module args".
    kind, target = ("module", argv[1]) if argv[0] == "-m" else ("script", argv[0])
    modules = [m for m in os.environ.pop(PRELOAD_ENV, "").split(",") if m]
    delay = float(os.environ.pop(DELAY_ENV, "0") or 0)
    # Imports resolve as they will for the worker: its sys.path[0].
    sys.path[0] = os.path.dirname(os.path.realpath(target)) if kind == "script" else os.getcwd()
    _preload(modules, delay)
    with contextlib.suppress(OSError):  # the order may already be here, the agent gone
        os.write(0, json.dumps({"v": PROTOCOL, "ready": True}).encode() + b"\n")
    line = _read_line(0)
    if not line:
        sys.exit(0)
    order = json.loads(line)
    if order.get("v") != PROTOCOL:
        sys.exit(f"elastrun spare: unknown protocol version {order.get('v')!r}")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the worker's stdin, as the agent gives cold workers
    os.close(devnull)
    os.environ.clear()
    os.environ.update(order["env"])
    args = [str(a) for a in order["args"]]
    try:
        if kind == "module":
            _run_module(target, args)
        else:
            _run_script(target, args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        _strip_own_frames(e)  # the traceback reads as the script's own
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
