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
whether the memory was released); after the bound it starts the workers
anyway, with a warning. Each ``nvidia-smi`` call is bounded (``QUERY_TIMEOUT``
s, then killed; its output read up to ``MAX_OUTPUT`` bytes). Without
``nvidia-smi`` on the agent's ``PATH`` (no NVIDIA GPU), or when it fails,
nothing is waited for.

Limits: ``nvidia-smi`` names processes by their pid in the driver's PID
namespace. In a container that does not share it (the host's pids are
listed), no listed pid is one of the workers' and nothing is waited for.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.spec import DEFAULT_GPU_RELEASE_TIMEOUT as DEFAULT_TIMEOUT
from elastrun.agent.workers import WorkerGroup
from elastrun.event_kinds import GpuMemoryWait

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "GpuRelease",
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


def features(core: Core) -> list[Feature]:
    """The wait, where ``nvidia-smi`` is found and the wait is not turned off."""
    timeout = core.spec.gpu_release.timeout
    smi = shutil.which("nvidia-smi")
    if smi is None or timeout <= 0:
        return []
    return [GpuRelease(core, smi, timeout)]


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


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fp:
            return int(fp.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def held_by(apps: dict[int, int], workers: set[int]) -> dict[int, int]:
    """The entries of ``apps`` that are one of ``workers`` or in one of their
    sessions (each worker leads its own)."""
    return {pid: mib for pid, mib in apps.items() if pid in workers or _session(pid) in workers}


class GpuRelease(Feature):
    """The wait for the stopped workers' GPU memory (see the module doc)."""

    def __init__(self, core: Core, smi: str, timeout: float) -> None:
        self.core = core
        self.smi = smi
        self.timeout = timeout
        self.stopped: set[int] = set()  # the last round's workers

    def round(self, group: WorkerGroup) -> RoundHooks:
        return _Round(self, group)

    async def _held(self) -> dict[int, int] | None:
        loop = asyncio.get_running_loop()
        apps = await loop.run_in_executor(None, query_compute_apps, self.smi)
        return None if apps is None else held_by(apps, self.stopped)

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
        if held:
            say(
                f"elastrun: warning: GPU memory still held after {waited:.0f}s "
                f"({_shown(held)}); starting the new workers anyway"
            )
        else:
            say(f"elastrun: GPU memory of the stopped workers released after {waited:.1f}s")
        self.stopped = set()


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
