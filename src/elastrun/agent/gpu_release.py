"""Restarts never race a dead worker's GPU memory.

A worker that dies holding GPU memory gives it back only once the driver has
torn its CUDA context down, which can come after the process is reaped (the
driver frees it asynchronously), and its children (DataLoader workers, a
stray helper) may hold some of it too. New workers started on the same GPU
meanwhile can fail with an out-of-memory error in their first step, and the
job burns a restart on it.

So before a round's workers start, when the last round's workers of this node
ran, the agent asks the driver which processes hold GPU memory
(``nvidia-smi --query-compute-apps=pid,used_memory``) and, while any of them
is one of those workers or in one of their sessions (their children), waits,
polling every ``POLL`` s, at most ``ELASTRUN_GPU_RELEASE_TIMEOUT`` seconds
(default ``DEFAULT_TIMEOUT``; 0 turns the wait off; read by the launcher:
:class:`~elastrun.agent.spec.GpuReleaseSettings`). It says so on the console
and in a ``gpu_memory_wait`` event (the pids, their MiB, how long it waited,
whether the memory was released). Each ``nvidia-smi`` call is bounded
(``QUERY_TIMEOUT`` s, then killed; its output read up to ``MAX_OUTPUT``
bytes).

``nvidia-smi`` names processes by their pid in the driver's PID namespace: in
a container that does not share it (a pod without ``hostPID``) no listed pid
is one of the workers'. So the agent also looks, in its own ``/proc``, for
the workers and the members of their sessions that still have a
``/dev/nvidia*`` file open (``device_holders``; bounded: ``MAX_PIDS``
processes, ``MAX_FDS`` fds each), which it can see in any PID namespace and
without ``nvidia-smi``. The wait runs where ``nvidia-smi`` is on the agent's
``PATH`` or a ``/dev/nvidia*`` device exists; otherwise (no NVIDIA GPU)
nothing is waited for.

After the bound, a holder that is still alive (a leftover process of the old
workers) is killed (``SIGKILL``); one that survives that too for ``KILL_WAIT``
s (stuck in the driver or the kernel) makes the node unhealthy: the agent
raises a ``WorkerError`` naming the pids and leaves the job instead of
starting new workers onto a GPU it cannot free. Memory held with no live
holder (the driver freeing it late) only gets a warning, and the workers
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable

from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.spec import DEFAULT_GPU_RELEASE_TIMEOUT as DEFAULT_TIMEOUT
from elastrun.agent.workers import WorkerGroup
from elastrun.errors import WorkerError
from elastrun.event_kinds import GpuMemoryWait

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "GpuRelease",
    "device_holders",
    "features",
    "held_by",
    "parse_compute_apps",
    "query_compute_apps",
]

TIMEOUT_ENV = "ELASTRUN_GPU_RELEASE_TIMEOUT"
MAX_TIMEOUT = 3600.0  # the most the launcher accepts
POLL = 0.25  # s between two queries
QUERY_TIMEOUT = 5.0  # s one nvidia-smi call may take
MAX_OUTPUT = 1 << 20  # bytes of its output read
QUERY = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
PROC = "/proc"
DEVICES = "/dev"
DEVICE_PREFIX = "/dev/nvidia"  # nvidia0..N, nvidiactl, nvidia-uvm: the driver's files
MAX_PIDS = 1 << 16  # processes looked at in one scan of /proc
MAX_FDS = 1 << 14  # open files looked at per process
KILL_WAIT = 5.0  # s for a killed holder to die before the node is unhealthy


def features(core: Core) -> list[Feature]:
    """The wait, where ``nvidia-smi`` is found or an NVIDIA device exists,
    and the wait is not turned off."""
    timeout = core.spec.gpu_release.timeout
    smi = shutil.which("nvidia-smi")
    if timeout <= 0 or (smi is None and not _has_devices(DEVICES)):
        return []
    return [GpuRelease(core, smi, timeout)]


def _has_devices(dev: str) -> bool:
    try:
        return any(name.startswith("nvidia") for name in os.listdir(dev))
    except OSError:
        return False


def parse_compute_apps(text: str) -> dict[int, int]:
    """``pid -> MiB`` from ``nvidia-smi``'s CSV lines (``pid, used_memory``);
    lines it cannot read (``[N/A]``, a message) are left out."""
    apps: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        mib = int(parts[1]) if parts[1].isdigit() else 0
        apps[int(parts[0])] = apps.get(int(parts[0]), 0) + mib
    return apps


def query_compute_apps(smi: str, timeout: float = QUERY_TIMEOUT) -> dict[int, int] | None:
    """The processes holding GPU memory (``pid -> MiB``); None when
    ``nvidia-smi`` cannot tell (it fails, or takes longer than ``timeout``)."""
    try:
        proc = subprocess.Popen(
            [smi, *QUERY],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    if proc.returncode != 0:
        return None
    return parse_compute_apps(out[:MAX_OUTPUT].decode("ascii", errors="replace"))


def _stat(pid: int, proc: str) -> list[str]:
    """The fields of ``proc/PID/stat`` after the command name ([] if gone)."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as fp:
            return fp.read(4096).rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _session(pid: int, proc: str = PROC) -> int | None:
    fields = _stat(pid, proc)
    return int(fields[3]) if len(fields) > 3 and fields[3].isdigit() else None


def _alive(pid: int, proc: str = PROC) -> bool:
    """Whether ``pid`` exists and is not a zombie (by its stat in ``proc``)."""
    fields = _stat(pid, proc)
    return bool(fields) and fields[0] not in ("Z", "X")


def held_by(apps: dict[int, int], workers: set[int], proc: str = PROC) -> dict[int, int]:
    """The entries of ``apps`` that are one of ``workers`` or in one of their
    sessions (each worker leads its own)."""
    return {
        pid: mib for pid, mib in apps.items() if pid in workers or _session(pid, proc) in workers
    }


def device_holders(workers: set[int], proc: str = PROC) -> set[int]:
    """The processes among ``workers`` and the members of their sessions that
    have an NVIDIA device file (``/dev/nvidia*``) open, as ``proc`` shows them
    (bounded: ``MAX_PIDS`` processes, ``MAX_FDS`` open files each)."""
    found: set[int] = set()
    if not workers:
        return found
    try:
        names = os.listdir(proc)
    except OSError:
        return found
    pids = [int(n) for n in names if n.isdigit()][:MAX_PIDS]
    for pid in pids:
        if (pid in workers or _session(pid, proc) in workers) and _opens_device(pid, proc):
            found.add(pid)
    return found


def _opens_device(pid: int, proc: str) -> bool:
    folder = f"{proc}/{pid}/fd"
    try:
        fds = os.listdir(folder)[:MAX_FDS]
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"{folder}/{fd}").startswith(DEVICE_PREFIX):
                return True
    return False


class GpuRelease(Feature):
    """The wait for the stopped workers' GPU memory (see the module doc)."""

    def __init__(
        self,
        core: Core,
        smi: str | None,
        timeout: float,
        *,
        proc: str = PROC,
        kill: Callable[[int, int], None] = os.kill,
        kill_wait: float = KILL_WAIT,
    ) -> None:
        self.core = core
        self.smi = smi  # None: no nvidia-smi, the device files only
        self.timeout = timeout
        self.proc = proc
        self.kill = kill
        self.kill_wait = kill_wait
        self.stopped: set[int] = set()  # the last round's workers

    def round(self, group: WorkerGroup) -> RoundHooks:
        return _Round(self, group)

    async def _held(self) -> dict[int, int] | None:
        """pid -> MiB of the stopped workers' holders (0 MiB: known only by an
        open device file); None when nothing can tell."""
        loop = asyncio.get_running_loop()
        apps = None
        if self.smi is not None:
            apps = await loop.run_in_executor(None, query_compute_apps, self.smi)
        holders = await loop.run_in_executor(None, device_holders, self.stopped, self.proc)
        if apps is None and not holders and self.smi is not None:
            return None
        held = {} if apps is None else held_by(apps, self.stopped, self.proc)
        for pid in holders:
            held.setdefault(pid, 0)
        return held

    async def wait_released(self) -> None:
        """Wait (bounded) until no stopped worker of the last round holds GPU memory."""
        if not self.stopped:
            return
        held = await self._held()
        if not held:
            self.stopped = set()
            return
        clock, say = self.core.clock, self.core.say
        first = dict(held)
        t0 = clock.monotonic()
        say(
            f"elastrun: waiting up to {self.timeout:g}s for the GPU memory of the stopped "
            f"workers to be released ({_shown(held)}) before the new workers start"
        )
        while held and clock.monotonic() - t0 < self.timeout:
            await clock.sleep_until(min(clock.monotonic() + POLL, t0 + self.timeout))
            now = await self._held()
            held = held if now is None else now
        waited = clock.monotonic() - t0
        self.core.events.emit(
            GpuMemoryWait(
                pids=sorted(first),
                mib=sum(first.values()),
                waited_s=round(waited, 3),
                released=not held,
                timeout=self.timeout,
            )
        )
        self.stopped = set()
        if not held:
            say(f"elastrun: GPU memory of the stopped workers released after {waited:.1f}s")
            return
        await self._kill_holders(held)
        say(
            f"elastrun: warning: GPU memory still held after {waited:.0f}s "
            f"({_shown(held)}); starting the new workers anyway"
        )

    async def _kill_holders(self, held: dict[int, int]) -> None:
        """Kill the holders still alive; raise WorkerError (the node is
        unhealthy) if one survives ``kill_wait`` s after its SIGKILL."""
        alive = sorted(pid for pid in held if _alive(pid, self.proc))
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(OSError):
                self.kill(pid, signal.SIGKILL)
        clock = self.core.clock
        deadline = clock.monotonic() + self.kill_wait
        while alive and clock.monotonic() < deadline:
            await clock.sleep_until(min(clock.monotonic() + POLL, deadline))
            alive = [pid for pid in alive if _alive(pid, self.proc)]
        if alive:
            raise WorkerError(
                f"this node is unhealthy: the old workers' processes "
                f"{_shown({p: held[p] for p in alive})} still hold the GPU and did not die "
                f"{self.kill_wait:g}s after SIGKILL; leaving the job rather than starting new "
                "workers onto that GPU"
            )


def _shown(held: dict[int, int]) -> str:
    pids = sorted(held)
    more = f" and {len(pids) - 8} more" if len(pids) > 8 else ""
    listed = ", ".join(str(p) for p in pids[:8])
    return f"pid{'s' if len(pids) > 1 else ''} {listed}{more}: {sum(held.values())} MiB"


class _Round(RoundHooks):
    def __init__(self, feature: GpuRelease, group: WorkerGroup) -> None:
        self.feature = feature
        self.group = group

    async def before_start(self) -> None:
        await self.feature.wait_released()

    async def ended(self) -> None:
        # The workers about to be stopped: the next start waits for their memory.
        self.feature.stopped = set(self.group.pids)
