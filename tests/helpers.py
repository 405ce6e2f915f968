"""What many tests need, written once: free ports, bounded waits, liveness of
a process, and cleaning up the process groups a test started.

Ports. A port found free and closed again (bind, close, hand out the number)
can be given to anyone by the OS before the program under test binds it: to
an outgoing connection, to another test's "free" port, on a machine where
several test sessions run at once. :func:`free_port` instead keeps a socket
bound to the port (with ``SO_REUSEADDR``, not listening) for the rest of the
session: the kernel then hands that port to no other ``bind(0)`` nor outgoing
connection, while a server that binds it with ``SO_REUSEADDR`` (asyncio
servers, so elastrun's store; etcd; torch's TCPStore) still can. Nothing
connecting to it gets an answer until such a server listens.

Environment. :func:`without_pet` drops the torchrun ``PET_*`` defaults a
user's shell may hold from the environment of the agents a test starts, but
keeps the suite's knobs (:data:`SUITE_KNOBS`): ``PET_WARM=0 make test``
runs every agent without a warm interpreter, except in the tests of warm
starts, which ask for one (``--warm`` or :data:`WARM_ENV`). By default the
agents run as elastrun does, warm, which is also faster: on 2 cores (4 test
processes) the suite took 384 s and 644 s of CPU warm, 433 s and 745 s cold.
An agent's warm interpreter imports torch once for all its workers, and most
test workers import torch. :func:`plant_modules` leaves the module list of a
script in a cache folder, as an earlier run on the machine would have: a job
of more workers than CPUs then forks them once its warm interpreter imported
the list (one import of ``OPTIMIZER_MODULES``, not one per worker).

Optional packages. :func:`needs` skips a test (or, as ``pytestmark``, a
module) that needs a package that is not installed (torch, Lightning,
accelerate), without importing it in the test process: a module-level
``pytest.importorskip`` costs every test process the package's import
(seconds for Lightning) when it collects.

Length. ``make soak`` sets ``ELASTRUN_SOAK=1``: a test that ``make test``
runs short (fewer stalls, seeds or cases) runs at full length there
(:func:`soak_or`). Such a test is marked ``slow``, so that ``make soak``
selects it.

The etcd helpers (a real cluster, auth, TLS files) are in
:mod:`tests.store.etcd_fixture`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from elastrun.procs import pid_alive

if TYPE_CHECKING:  # pytest itself is imported by needs() alone: scripts import this module too
    import pytest

__all__ = [
    "OPTIMIZER_MODULES",
    "SUITE_KNOBS",
    "WARM_ENV",
    "free_port",
    "free_ports",
    "kill_group",
    "needs",
    "pid_alive",
    "plant_modules",
    "port_on_every",
    "soak_or",
    "stop_groups",
    "wait_for",
    "without_pet",
]

T = TypeVar("T")

_held: list[socket.socket] = []  # bound for the session: see the module docstring
_held_lock = threading.Lock()
MAX_HELD = 4096  # a session that asks for more has a leak


# Environment settings for all the agents of a test session (see the module docstring).
SUITE_KNOBS = ("PET_WARM",)
# For the agents of tests about warm starts (a flag on the command line still wins).
WARM_ENV = {"PET_WARM": "1"}
# What a torch optimizer imports (torch._dynamo on its first use: some 1.5 s of
# CPU per process): most of what a training script imports after torch.
OPTIMIZER_MODULES = ["torch.optim", "torch._dynamo"]


def plant_modules(
    cache_dir: Path, cwd: Path | str, script: str, args: Sequence[str], modules: list[str]
) -> None:
    """The module list of ``python script args`` run in ``cwd`` (the agent's
    working directory), in the warm-start cache folder ``cache_dir``
    (``ELASTRUN_CACHE_DIR``), as if an earlier run had recorded it."""
    from elastrun.agent.command import PythonScript  # not for the scripts that import this module
    from elastrun.agent.modcache import ModuleCache, ModuleList, cache_key

    key = cache_key(PythonScript(script, tuple(args), python=sys.executable), str(cwd))
    assert ModuleCache(str(cache_dir), key).save(ModuleList(modules=modules))


def without_pet(env: Mapping[str, str] | None = None, *drop: str) -> dict[str, str]:
    """``env`` (default: the environment) without the ``PET_*`` flag defaults
    (and the variables starting with any of ``drop``), but with the suite's
    knobs the environment sets (:data:`SUITE_KNOBS`)."""
    source = os.environ if env is None else env
    out = {k: v for k, v in source.items() if not k.startswith(("PET_", *drop))}
    out.update({k: os.environ[k] for k in SUITE_KNOBS if k in os.environ})
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that this session holds (see the module docstring)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    with _held_lock:
        if len(_held) >= MAX_HELD:
            s.close()
            raise AssertionError(f"this test session asked for over {MAX_HELD} ports")
        _held.append(s)
    return int(s.getsockname()[1])


def port_on_every(hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2", "127.0.0.3")) -> int:
    """One port held, as :func:`free_port` holds it, on every one of ``hosts``
    (candidate store hosts listen on one port, each on its own loopback
    address: a port held on the first alone may be another test's on the
    others)."""
    for _ in range(100):
        port = free_port(hosts[0])
        held = []
        try:
            for host in hosts[1:]:
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                held.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
        except OSError:
            for s in held:
                s.close()
            continue
        with _held_lock:
            _held.extend(held)
        return port
    raise AssertionError(f"no port free on every one of {hosts}")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports, each held as :func:`free_port` does."""
    return [free_port(host) for _ in range(count)]


def needs(package: str) -> pytest.MarkDecorator:
    """A mark that skips the test when ``package`` is not installed (found, not
    imported: see the module docstring)."""
    import pytest

    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None,
        reason=f"{package} is not installed (pip install -e '.[dev]')",
    )


def soak_or(short: T, full: T) -> T:
    """``full`` under ``make soak`` (``ELASTRUN_SOAK=1``), else ``short``."""
    return full if os.environ.get("ELASTRUN_SOAK") == "1" else short


def wait_for(
    predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1
) -> T:
    """Poll ``predicate`` until it returns something true (returned), for at
    most ``timeout`` seconds; then fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to process group ``pgid`` (a process started with
    ``start_new_session=True`` leads its own); a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_groups(*procs: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Clean-up: SIGKILL the group of each of ``procs`` still running (each
    leads its own group), then reap each, waiting at most ``timeout`` seconds
    for each."""
    for proc in procs:
        if proc.poll() is None:
            kill_group(proc.pid)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)


def finished(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The output of ``proc`` (started with stdout piped, stderr to it, in a
    session of its own) once it ends successfully within ``timeout``; its
    group is stopped in any case."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stop_groups(proc)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


# The ranks of run_ranks: one interpreter imports torch, then forks each rank
# with it loaded (as an agent's warm interpreter does), its output in a file
# of its own; it prints each rank's exit code.
_FORKED_RANKS = """
import atexit, json, os, sys, traceback
import torch, torch.distributed
code, world, outdir, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
children = {}
for rank in range(world):
    pid = os.fork()
    if pid == 0:
        out = os.open(os.path.join(outdir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
        sys.argv = ["-c", *args]
        status = 0
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (e.code is not None)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    children[pid] = rank
codes = {}
while children:
    pid, status = os.wait()
    codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(codes), flush=True)
"""


def run_ranks(code: str, world: int, *args: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Run the Python ``code`` (with ``args``) as ranks 0..world-1 of one
    torch.distributed job on loopback (``env://``: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` set), forked from one interpreter that imported torch (one
    import for all: the ranks' CPU is their own work); their outputs, once
    every rank exited 0 (within 180 s)."""
    import json
    import sys
    import tempfile

    port = free_port()
    rank_env = {
        **os.environ,
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
    }
    with tempfile.TemporaryDirectory(prefix="ranks-") as outdir:
        proc = subprocess.Popen(
            [sys.executable, "-c", _FORKED_RANKS, code, str(world), outdir, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=rank_env,
            start_new_session=True,
        )
        try:
            parent, _ = proc.communicate(timeout=180)
        finally:
            stop_groups(proc, timeout=30)
        outs = []
        for rank in range(world):
            path = Path(outdir, f"rank{rank}.out")
            outs.append(path.read_text(errors="replace") if path.exists() else "")
    assert proc.returncode == 0, parent + "".join(outs)
    codes = json.loads(parent.strip().splitlines()[-1])
    for rank, out in enumerate(outs):
        assert codes[str(rank)] == 0, f"rank {rank} exited {codes[str(rank)]}:\n{out}"
    return outs
