"""``--health-check CMD``: the node checks itself before it joins each round, and while it trains.

A user's command (``nvidia-smi -L``, ``dcgmi diag -r 1``, a storage probe,
or the documented GPU set: docs/reliability.md, *Health checks*) runs:

* before the node joins each round (the first, and every restart): a node
  whose check fails does not join; its agent says why and exits 1
  (``NodeUnhealthy``), so the job goes on without it: a waiting spare takes
  its place (docs/spares.md), else the job goes on at a smaller allowed size;
* every ``--health-check-interval`` seconds while its workers train (0: not
  at all): a failure is said and reported at once, and the node leaves at
  the next round boundary (it does not join the next round).

The command is an argv (the flag's text split as a shell would, without a
shell: ``sh -c '...'`` for one), run with no stdin, in a session of its own
(the orphan guard kills its process group if the agent dies), its output
kept to its last :data:`MAX_OUTPUT` bytes. It passes when it exits 0 within
``--health-check-timeout`` seconds; one that runs longer (a hung driver
call) has its process group killed and counts as failed, as does one that
cannot be started. Each failure is a ``node_health_failed`` event, and is
kept in the job's fault history in the store (rendezvous/fault_history.py:
the node, when, the round, why, the output's tail), which ``elastrun
status`` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.workers import WorkerGroup
from elastrun.errors import NodeUnhealthy
from elastrun.event_kinds import NodeHealthFailed
from elastrun.procs import signal_name
from elastrun.rendezvous.fault_history import MAX_HOST, MAX_MESSAGE, HealthFailure
from elastrun.rendezvous.fault_history import MAX_OUTPUT as H_OUTPUT
from elastrun.untrusted import printable

__all__ = ["MAX_OUTPUT", "NodeHealth", "features", "run_check"]

MAX_OUTPUT = 2048  # bytes of the command's output kept (its last)
KILL_WAIT = 5.0  # s to wait for a killed check to be reaped


async def run_check(argv: tuple[str, ...], timeout: float) -> tuple[str | None, str]:
    """Run ``argv``: (None, output) when it passed, else (why, output)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        return f"cannot run {printable(argv[0])}: {e.strerror or e}", ""
    tail = bytearray()
    try:
        async with asyncio.timeout(timeout):
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                tail += chunk
                del tail[:-MAX_OUTPUT]
            code = await proc.wait()
    except TimeoutError:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), KILL_WAIT)
        return f"timed out after {timeout:g} s (killed)", _text(tail)
    finally:
        with contextlib.suppress(OSError):  # what it left behind in its session
            os.killpg(proc.pid, signal.SIGKILL)
    if code == 0:
        return None, _text(tail)
    how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    return how, _text(tail)


def _text(raw: bytes | bytearray) -> str:
    return printable(raw.decode("utf-8", "replace").strip(), lines=True)


def _last_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return f": {printable(lines[-1], limit=200)}" if lines else ""


class NodeHealth(Feature):
    """The node's health check (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.settings = core.spec.node_health
        self.shown = printable(" ".join(self.settings.command), limit=200)
        self.failed: str | None = None  # a failure while training: leave at the boundary

    async def check(self, when: str) -> str | None:
        """Run the check; the line that says why it failed (None: it passed)."""
        why, output = await run_check(self.settings.command, self.settings.timeout)
        if why is None:
            return None
        self.core.events.emit(
            NodeHealthFailed(command=self.shown, when=when, reason=why, output=output[-MAX_OUTPUT:])
        )
        # Kept in the job's fault history too, for `elastrun status`.
        await self.core.rendezvous.record_health(
            HealthFailure(
                host=self.core.spec.host[:MAX_HOST],
                when=when,
                round=None,
                at=time.time(),
                reason=why[:MAX_MESSAGE],
                output=output[-H_OUTPUT:],
            )
        )
        return f"the health check `{self.shown}` {why}{_last_line(output)}"

    async def before_round(self) -> None:
        if self.failed is None:
            self.failed = await self.check("before_round")
        if self.failed is not None:
            raise NodeUnhealthy(f"{self.failed}; this node does not join the job")

    def round(self, group: WorkerGroup) -> RoundHooks | None:
        return _Periodic(self) if self.settings.interval > 0 else None


class _Periodic(RoundHooks):
    """The check every interval while this round's workers train."""

    def __init__(self, feature: NodeHealth) -> None:
        self.feature = feature
        self.task: asyncio.Task[None] | None = None

    def started(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        f = self.feature
        while f.failed is None:
            await asyncio.sleep(f.settings.interval)
            why = await f.check("training")
            if why is not None:
                f.failed = why
                f.core.say(
                    f"elastrun: {why}; this node leaves the job when this round ends "
                    "(it does not join the next)"
                )

    async def ended(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


def features(core: Core) -> list[Feature]:
    """The check, when ``--health-check`` gave a command."""
    return [NodeHealth(core)] if core.spec.node_health.command else []
