"""One warm interpreter process, as the agent holds it (the other end:
worker/_zygote.py).

:class:`Zygote` starts the process (its own session, ``PR_SET_PDEATHSIG``,
fd 0 a ``SOCK_SEQPACKET`` socket to the agent), reads what it sends (typed
messages of worker/_messages.py, decoded within bounds: agent/channel.py)
and the tail of its stderr, tells it to import more (``Preload``) or to fork
a batch of workers (``Fork``, with each worker's fds), and kills it. When it
is started, used and let go is agent/warm.py's to decide; before deciding,
the agent reads what it sent and the event loop has not read yet
(:meth:`Zygote.catch_up`): a zygote found ended, or one a fork order cannot
be handed to, may have sent a refusal (``Unsafe``) just before it exited.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from elastrun.agent.channel import decode
from elastrun.agent.children import ForkedProcess
from elastrun.agent.spawn import preexec_for
from elastrun.frozen import frozen
from elastrun.worker._messages import Fork, Forked, Preload, PreloadPlan, Ready, Unsafe, encode

__all__ = ["FORK_TIMEOUT", "SCOPE_ENV", "Bounds", "Zygote", "promote"]

OnReady: TypeAlias = "Callable[[Zygote, Ready], None]"
OnUnsafe: TypeAlias = "Callable[[Zygote, Unsafe], None]"

FORK_TIMEOUT = 30.0  # s for a zygote to answer a fork order
MAX_MESSAGE = 1 << 20
STDERR_TAIL = 4096
SEND_TIMEOUT = 5.0  # s to hand the zygote one order

# What the runner and the zygote read (worker/_runner.py, worker/_zygote.py).
MODE_ENV = "ELASTRUN_RUNNER"
SCOPE_ENV = "ELASTRUN_MODULE_SCOPE"
PRELOAD_ENV = "ELASTRUN_PRELOAD"
DELAY_ENV = "ELASTRUN_WARM_DELAY"
AGENT_ENV = "ELASTRUN_AGENT_PID"
BUDGET_ENV = "ELASTRUN_PRELOAD_BUDGET"
RSS_ENV = "ELASTRUN_PRELOAD_MAX_RSS"
IMPORT_TIMEOUT_ENV = "ELASTRUN_PRELOAD_IMPORT_TIMEOUT"


@frozen
class Bounds:
    """How a zygote imports: ``delay`` s before it starts where it cannot
    import at idle priority, and it stops importing after ``budget`` s or at
    ``max_rss_mb`` MiB of resident memory; one import that takes longer than
    ``import_timeout`` s (0: unbounded) makes it quit, the module unsafe."""

    delay: float
    budget: float
    max_rss_mb: float
    import_timeout: float = 60.0


@dataclass
class Zygote:
    """A started warm interpreter; ``env``: the workers' environment it was
    started with (less the per-round and per-rank variables; a per-rank one's,
    ``local_rank`` set, has its rank's variables: agent/warm_ranks.py)."""

    popen: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: asyncio.Future[list[int | None]] | None = None
    stderr: bytearray = field(default_factory=bytearray)
    gone: str | None = None  # why it cannot be used any more
    local_rank: int | None = None  # a per-rank one's local rank
    handlers: tuple[OnReady, OnUnsafe] | None = field(default=None, repr=False)  # watch's

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        env: dict[str, str],
        plan: PreloadPlan,
        scope: str,
        bounds: Bounds,
        *,
        local_rank: int | None = None,
    ) -> Zygote:
        """Start one with ``env``, importing ``plan`` (``scope``: whether the
        script's own modules may be imported, ``all``, or only installed
        ones) within ``bounds``. Raises OSError when it cannot be started."""
        spawn_env = {
            **env,
            MODE_ENV: "zygote",
            SCOPE_ENV: scope,
            PRELOAD_ENV: json.dumps(plan.to_json()),
            DELAY_ENV: repr(bounds.delay),
            AGENT_ENV: str(os.getpid()),
            BUDGET_ENV: repr(bounds.budget),
            RSS_ENV: repr(bounds.max_rss_mb),
            IMPORT_TIMEOUT_ENV: repr(bounds.import_timeout),
        }
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            popen = subprocess.Popen(
                argv,
                env=spawn_env,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec_for(os.getpid()),  # noqa: PLW1509 - a pre-resolved prctl
                close_fds=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(popen, ours, env, local_rank=local_rank)

    # ------------------------------------------------------------ reading
    def watch(self, on_ready: OnReady, on_unsafe: OnUnsafe) -> None:
        """Read its messages and its stderr on the event loop."""
        self.handlers = (on_ready, on_unsafe)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._on_message, on_ready, on_unsafe)
        if self.popen.stderr is not None:
            fd = self.popen.stderr.fileno()
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_stderr, fd)

    def _on_stderr(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            return
        self.stderr += data
        del self.stderr[:-STDERR_TAIL]

    def catch_up(self) -> None:
        """Read now what it sent that the event loop has not read yet, as the
        loop would (a refusal goes to ``on_unsafe`` at once); once its process
        has ended, that is all it sent, and it is gone. The agent calls this
        before it decides anything about a zygote: one found ended by its exit
        code alone would be let go with its refusal unread (the module not
        remembered, the next zygote refusing it again)."""
        if self.gone is not None or self.handlers is None:
            return
        ended = self.popen.poll() is not None  # first: then all it sent is in the socket
        self._on_message(*self.handlers)
        if ended and self.gone is None:
            self._lost()

    def _on_message(self, on_ready: OnReady, on_unsafe: OnUnsafe) -> None:
        reset = False
        while self.gone is None:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except ConnectionResetError:
                # It quit with an order of ours unread (a refusal while a fork
                # order waited): Linux then reports the reset before the
                # messages it sent first, still queued. Read them (the reset
                # is said once): a refusal is never lost to it.
                if reset:
                    data = b""
                else:
                    reset = True
                    continue
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            message = decode(data, max_bytes=MAX_MESSAGE, what="a warm interpreter's message")
            match message:
                case Ready():
                    self.ready = True
                    self.ready_event.set()
                    on_ready(self, message)
                case Forked(pids=pids):
                    if self.pending is not None and not self.pending.done():
                        self.pending.set_result(list(pids))
                case Unsafe():
                    on_unsafe(self, message)

    def _lost(self) -> None:
        self.unwatch()
        if self.gone is None:
            self.gone = f"exited before it was needed: {self.tail()}"
        if self.pending is not None and not self.pending.done():
            self.pending.set_result([])
        self.ready_event.set()  # nobody waits for a zygote that is gone

    def unwatch(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.sock.fileno())
            if self.popen.stderr is not None:
                loop.remove_reader(self.popen.stderr.fileno())

    def tail(self) -> str:
        """How it ended: its exit code and its last line on stderr."""
        lines = self.stderr.decode(errors="replace").strip().splitlines()
        rc = self.popen.poll()
        head = f"exit code {rc}" if rc is not None else "still running"
        return f"{head}: {lines[-1][:300]}" if lines else head

    # ------------------------------------------------------------ orders
    def preload(self, names: Sequence[str]) -> None:
        """Import ``names`` too (it is not ready until it has)."""
        with contextlib.suppress(OSError):
            self.sock.send(encode(Preload(tuple(names))))
            self.ready = False
            self.ready_event.clear()

    async def fork_workers(
        self, orders: Mapping[int, tuple[Mapping[str, str], Sequence[str], int]], stdin: int | None
    ) -> dict[int, ForkedProcess]:
        """Workers forked, by local rank: ``orders[lr]`` is each one's
        environment, arguments and channel socket fd; ``stdin`` the fd every
        one reads (None: /dev/null), passed with each order (the zygote,
        shared across rounds, never keeps it). Those it could not fork are
        missing. Raises OSError or TimeoutError (nothing forked then)."""
        ranks = sorted(orders)
        pipes: dict[int, tuple[int, int, int, int]] = {}  # stdout's read, write; stderr's
        pids: list[int | None] = []
        try:
            batch = []
            for i, lr in enumerate(ranks):
                env, args, channel = orders[lr]
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                pipes[lr] = (out_r, out_w, err_r, err_w)
                fds = [out_w, err_w, channel, *([] if stdin is None else [stdin])]
                batch.append((Fork(dict(env), tuple(args), index=i, count=len(ranks)), fds))
            pids = await self._fork(batch)
        finally:
            for _, out_w, _, err_w in pipes.values():
                os.close(out_w)
                os.close(err_w)
            # The read ends of the ranks that got no process.
            for i, lr in enumerate(ranks):
                if lr in pipes and (i >= len(pids) or pids[i] is None):
                    os.close(pipes[lr][0])
                    os.close(pipes[lr][2])
        return {
            lr: ForkedProcess(pid, os.fdopen(pipes[lr][0], "rb"), os.fdopen(pipes[lr][2], "rb"))
            for i, lr in enumerate(ranks)
            if i < len(pids) and (pid := pids[i]) is not None
        }

    async def _fork(self, orders: Sequence[tuple[Fork, Sequence[int]]]) -> list[int | None]:
        """Hand the zygote every order (with its fds: stdout, stderr, channel
        and, if any, stdin), forked together once all came; their pids in
        order (None: not forked)."""
        self.pending = asyncio.get_running_loop().create_future()
        try:
            try:
                for order, fds in orders:
                    self.sock.setblocking(True)
                    self.sock.settimeout(SEND_TIMEOUT)
                    rights = array.array("i", fds)
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)]
                    self.sock.sendmsg([encode(order)], ancillary)
            except OSError:
                # It may have quit since it was found usable (a refusal sent,
                # then its exit): what it sent is read before it is let go.
                with contextlib.suppress(OSError):
                    self.sock.setblocking(False)
                self.catch_up()
                raise
            self.sock.setblocking(False)
            return await asyncio.wait_for(self.pending, FORK_TIMEOUT)
        finally:
            self.pending = None

    def kill(self, gone: str) -> None:
        """Let it go (``gone``: why): no more reading, its process group killed."""
        self.gone = gone
        self.unwatch()
        if self.pending is not None and not self.pending.done():
            self.pending.set_result([])  # a fork it was given: nothing forked, start cold
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.ready_event.set()


def promote(pid: int) -> None:
    """Every thread of a zygote importing at idle priority back to normal
    (it went idle only because it may come back; best effort)."""
    if not hasattr(os, "SCHED_IDLE"):
        return
    with contextlib.suppress(OSError):
        if os.sched_getscheduler(pid) != os.SCHED_IDLE:
            return
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
