"""The warm interpreter workers are forked from (stdlib only).

Loaded by ``_runner.py`` when ``ELASTRUN_RUNNER=zygote``: the agent starts one
per node with the worker's interpreter, flags, command line and environment
(less the per-round and per-rank variables), fd 0 a ``SOCK_SEQPACKET`` socket
to the agent. It imports modules ahead of time (torch, then what the script
imported when it last ran: ``ELASTRUN_PRELOAD``), one at a time, at idle CPU
priority where it may return to normal priority afterwards (root or
``CAP_SYS_NICE``; otherwise after ``ELASTRUN_WARM_DELAY`` seconds), and
forks workers when told to. Once the first ``base`` modules (torch) are
imported, it reads the agent's orders between two imports, so a fork waits
for torch but never for the rest of the list.

Protocol: the typed messages of ``_messages.py`` (loaded from beside this
file), one per packet: the agent sends ``Preload`` (import these too) and
``Fork`` (one worker of a batch, with its stdout, stderr, channel socket and
stdin fds); the zygote answers ``Ready`` once its imports are done,
``Forked`` (the pids) once a whole batch is forked, and ``Unsafe`` before
it exits when a module started a thread (Python's or a native one: OpenMP,
NVML; counted in ``/proc/self/task``; a pool that stops itself before a fork,
as OpenBLAS's does, is allowed), tried to initialise CUDA, initialised
it or loaded the CUDA driver (not fork-safe), read a per-rank variable
(RANK, ...) when imported, or did not finish importing within
``ELASTRUN_PRELOAD_IMPORT_TIMEOUT`` s. These checks run after every import,
whether it succeeded or raised, and again before each fork: a zygote that
fails one never forks. A variable read ends it at once, in the middle of
the import (as the bound on a hanging import does): a fork waiting for it
starts cold without waiting for the rest of the import. Once torch is
imported, CUDA initialisation is refused in the zygote
(``torch.cuda._lazy_init`` raises there, in the zygote's pid only): a
module imported while workers train cannot put a context on a GPU.
While it imports, ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless set):
``torch.cuda.is_available()`` asks NVML, not the driver. A message
it cannot read is ignored (its fds closed). End of file from the agent:
exit 0.

Each worker is forked twice (zygote -> intermediate -> worker) and the
intermediate exits at once, so the worker is re-parented to the agent (a
child subreaper): the agent waits for it as for any child. The worker starts
a session of its own at once (before the zygote answers: a signal to the
zygote's process group must not reach it), and once it is the agent's child
sets its parent-death signal (tied to its parent at the time) and waits for
the agent's ``Go`` on the channel socket (sent once the agent has registered
it): an agent that dies or gives up before that leaves nothing running.

Before it forks, every object it holds is frozen (``gc.freeze``): the
workers' cyclic collections never walk them, so the pages they share with
the zygote are not copied by a collection nor at a worker's exit.

Bounds: the preload stops after ``ELASTRUN_PRELOAD_BUDGET`` seconds or once
the resident memory passes ``ELASTRUN_PRELOAD_MAX_RSS`` MiB; a module that
fails to import is skipped and named in the next ``ready``; every name is
checked again here as the agent checked it (``_modnames.refusal``: never a
``__main__``, the script itself or a module that acts when imported), and a
refused one is named in ``failed`` too; with the ``installed`` scope a module
is imported only if it is found in the standard library or in installed
packages (never the script's own folder).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

# _runner.py is the program's __main__; its helpers are shared.
_runner = sys.modules["__main__"]
M = _runner._load_sibling("_messages")  # the messages (stdlib only)

PRELOAD_ENV = "ELASTRUN_PRELOAD"  # _messages.PreloadPlan, as JSON
DELAY_ENV = "ELASTRUN_WARM_DELAY"
AGENT_ENV = "ELASTRUN_AGENT_PID"
BUDGET_ENV = "ELASTRUN_PRELOAD_BUDGET"  # s
RSS_ENV = "ELASTRUN_PRELOAD_MAX_RSS"  # MiB
IMPORT_TIMEOUT_ENV = "ELASTRUN_PRELOAD_IMPORT_TIMEOUT"  # s one import may take
OWN_ENV = (PRELOAD_ENV, DELAY_ENV, AGENT_ENV, BUDGET_ENV, RSS_ENV, IMPORT_TIMEOUT_ENV)
MAX_MESSAGE = 4 << 20
FDS_PER_WORKER = 4  # stdout, stderr, channel, stdin
MAX_FAILED = 50
ADOPT_WAIT = 5.0  # s for the re-parenting to the agent
GO_WAIT = 60.0  # s for the agent's go
MAX_GO = 4096  # bytes of the go line
PR_SET_PDEATHSIG = 1
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
DRIVER = b"/libcuda.so"  # the CUDA driver library, as it appears in /proc/self/maps
SETTLE_TRIES = 20  # re-counts of the threads (a joined thread may linger a moment)
SETTLE_WAIT = 0.005  # s between two
REFUSED = (
    "elastrun: CUDA initialisation refused in the warm interpreter "
    "(the GPU is the workers'; a worker forked from it initialises CUDA itself)"
)


def _load_prctl() -> Any:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


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


def _set_policy(policy: int) -> None:
    """Every thread of this process to ``policy`` (best effort)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def _rss_kb() -> int:
    path = "/proc/self/status"
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, encoding="ascii") as fp:
        for line in fp:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped into this process (it is
    loaded by the first CUDA call, never by ``import torch``)."""
    try:
        with open("/proc/self/maps", "rb") as fp:
            return DRIVER in fp.read()
    except OSError:
        return False


def _tasks() -> int:
    """This process' threads, native ones too (OpenMP, NVML: the threading
    module does not know them)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _settled_threads() -> int:
    """The threads at the start, once a thread just joined is gone (bounded)."""
    for _ in range(SETTLE_TRIES):
        if _tasks() <= 1:
            break
        time.sleep(SETTLE_WAIT)
    return max(1, _tasks())


def _version(name: str) -> str | None:
    mod = sys.modules.get(name)
    return getattr(mod, "__version__", None) if mod is not None else None


class _EnvWatch(os._Environ):  # type: ignore[type-arg]
    """``os.environ`` while the zygote imports a module: the same variables,
    but reading one of ``watched`` (the per-round and per-rank variables,
    which the zygote does not have) is noted with the module that read it,
    and ``on_read(variable, module)`` is called at once (the zygote quits
    there: the rest of the import could only delay a start)."""

    def __init__(self, real: Any, watched: frozenset[str], on_read: Any = None) -> None:
        super().__init__(
            real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue
        )
        self.watched = watched
        self.on_read = on_read
        self.seen: tuple[str, str] | None = None  # (variable, module)

    def __getitem__(self, key: str) -> str:
        if key in self.watched:
            self._note(key)
        return str(super().__getitem__(key))

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and key in self.watched:
            self._note(key)
        return super().__contains__(key)

    def _note(self, key: str) -> None:
        if self.seen is None:
            self.seen = (key, _reader())
            if self.on_read is not None:
                self.on_read(*self.seen)


def _reader() -> str:
    """The module whose code is reading the environment (outside os, the
    import machinery and this file)."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name and name not in _PLUMBING and not name.startswith(("importlib", "_elastrun")):
            return name
        frame = frame.f_back
    return ""


_PLUMBING = frozenset(
    ("os", "_collections_abc", "collections.abc", "collections", "__main__", "typing")
)


class _Become(Exception):
    """Raised in a freshly forked worker: unwinds the zygote's loop."""

    def __init__(self, order: Any, fds: list[int], others: list[int]) -> None:
        super().__init__()
        self.order = order
        self.fds = fds
        self.others = others


class Zygote:
    def __init__(self, script: str | None = None) -> None:
        env = os.environ
        self.script = script  # the module name that would run the script: never imported
        self.ctl = socket.socket(fileno=0)
        self.agent_pid = _int(env.get(AGENT_ENV), 0)
        plan = M.PreloadPlan.from_text(env.get(PRELOAD_ENV, ""))
        self.scope = env.get(_runner.SCOPE_ENV, "installed")
        self.delay = _float(env.get(DELAY_ENV), 0.0)
        self.budget = _float(env.get(BUDGET_ENV), 120.0)
        self.max_rss_kb = int(_float(env.get(RSS_ENV), 4096.0) * 1024)
        self.import_timeout = _float(env.get(IMPORT_TIMEOUT_ENV), 60.0)
        for name in OWN_ENV:
            env.pop(name, None)
        self.roots = _runner.installed_roots()
        self.queue: deque[str] = deque()
        self.queued: set[str] = set()
        self.checked: dict[str, bool] = {}  # top-level package -> installed
        self.failed: list[tuple[str, str]] = []  # (name, why): for the next Ready
        self.expect_torch: str | None = plan.torch
        self.watched = frozenset(plan.watch)
        python = ".".join(map(str, sys.version_info[:3]))
        modules = list(plan.modules)
        if plan.python not in (None, python):
            modules = [m for m in modules if m == "torch"]  # recorded by another Python
        self._enqueue(modules)
        # The first ``base`` names (torch) are imported before any order is
        # read: a fork never comes before them.
        self.base = min(len(self.queue), plan.base)
        self.loaded = 0
        self.stopped: str | None = None
        self.started = time.monotonic()
        self.idle = _can_return_from_idle()
        self.prctl = _load_prctl()
        self.batch: list[tuple[Any, list[int]]] = []  # (Fork, its fds)
        self.pid = os.getpid()
        self.threads = _settled_threads()  # its own: the main thread (the probe's is joined)
        self.importing: str | None = None
        self.cuda_tried: str | None = None  # the module that tried to initialise CUDA
        self.cuda_init: Any = None  # torch.cuda's own _lazy_init, once refused here
        self.cuda_hooked: list[Any] = []  # the modules whose _lazy_init is the refusal

    # ------------------------------------------------------------ preload
    def _enqueue(self, names: list[str]) -> None:
        """Queue ``names`` (bounded): the agent checked them, and they are
        checked again here (``_modnames.refusal``); a refused name is named
        in the next ``Ready`` and never imported."""
        for name in names:
            if len(self.queued) >= _runner.MAX_MODULES:
                break
            why = _runner._names.refusal(name, self.script)
            if why is not None:
                self._fail(str(name)[: _runner.MAX_NAME], f"refused: {why}")
                continue
            if name in self.queued:
                continue
            self.queued.add(name)
            self.queue.append(name)

    def _fail(self, name: str, why: object) -> None:
        if len(self.failed) < MAX_FAILED:
            self.failed.append((name, str(why)[:200] or type(why).__name__))

    def _import_next(self) -> None:
        name = self.queue.popleft()
        self.base = max(0, self.base - 1)
        if name in sys.modules:
            return
        if time.monotonic() - self.started > self.budget:
            self.stopped = f"time budget of {self.budget:g} s spent"
        elif _rss_kb() > self.max_rss_kb:
            self.stopped = f"memory budget of {self.max_rss_kb // 1024} MiB reached"
        if self.stopped is not None:
            self.queue.clear()
            return
        top = name.split(".", 1)[0]
        if self.scope != "all" and not self._installed(top):
            self._fail(name, "not from the standard library or an installed package")
            return
        real = os.environ
        watch = _EnvWatch(real, self.watched, lambda key, reader: self._read(name, key, reader))
        os.environ = watch  # noqa: B003 - swapped for this import only, same variables
        nvml = real.get(NVML_CHECK_ENV)
        if nvml is None:
            # torch.cuda.is_available() called by an import asks NVML, not the
            # driver (which would leave the GPU unusable after a fork).
            real[NVML_CHECK_ENV] = "1"
        self.importing = name
        alarm = self._arm(name)
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as e:
            self._fail(name, f"{type(e).__name__}: {e}")
        else:
            self.loaded += 1
        finally:
            self._disarm(alarm)
            self.importing = None
            os.environ = real  # noqa: B003
            if nvml is None:
                real.pop(NVML_CHECK_ENV, None)
        # Whether it succeeded or raised: what it did before it raised stays.
        self._check(name)
        self._refuse_cuda()
        if watch.seen is not None:  # on_read quits: never a fork after such a read
            self._read(name, *watch.seen)
        if name == "torch" and self.expect_torch not in (None, _version("torch")):
            self.queue.clear()  # recorded with another torch: only torch itself is sure
            self.stopped = f"the module list was recorded with torch {self.expect_torch}"

    def _read(self, name: str, key: str, reader: str) -> None:
        """Quit (``Unsafe``): the import of ``name`` read ``key``, by
        ``reader``'s code. Its state now holds what a worker of another rank
        would not see: not safe ahead of time (nor anything of its package,
        nor of the package whose import brought it in). Said as soon as it
        is read, not once the import is done: a start waiting for this
        zygote would wait for the rest of the import (most of Lightning's
        seconds: its rank is read in its first 2%) to start cold anyway."""
        packages = sorted({name.partition(".")[0], (reader or name).partition(".")[0]})
        self._unsafe(packages, f"{reader or name} reads {key} when it is imported", key)

    # ------------------------------------------------------------ fork safety
    def _check(self, name: str | None) -> None:
        """Quit (``Unsafe``) if a fork would no longer be safe: after the
        import of ``name``, or (None) before a fork."""
        names = [name] if name else []
        late = "" if name else " (found before a fork, after every import had passed)"
        if self.cuda_tried is not None:
            self._unsafe(
                [self.cuda_tried], "it tried to initialise CUDA (refused: the GPU is the workers')"
            )
        if self._extra_threads():
            self._unsafe(names, f"it started a thread (a fork would copy it half-way){late}")
        cuda = sys.modules.get("torch.cuda")
        if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
            self._unsafe(names, f"it initialised CUDA (the device must stay free){late}")
        if _driver_loaded():
            # torch.cuda.is_available() and friends initialise the driver
            # without marking torch's CUDA initialised: a forked worker would
            # then fail its first CUDA call.
            why = "it loaded the CUDA driver (a forked worker could not use it)"
            self._unsafe(names, why + late)

    def _extra_threads(self) -> bool:
        """Whether more threads run than the zygote's own. A thread just
        joined may still be listed for a moment (bounded re-counts); a pool
        that stops itself before a fork (OpenBLAS's ``pthread_atfork``
        handler: numpy, torch) is safe, which a throwaway fork shows."""
        if self._settled():
            return False
        try:
            pid = os.fork()
        except OSError:
            return True
        if pid == 0:
            os._exit(0)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        return not self._settled()

    def _settled(self) -> bool:
        for _ in range(SETTLE_TRIES):
            if _tasks() <= self.threads:
                return True
            time.sleep(SETTLE_WAIT)
        return False

    def _refuse_cuda(self) -> None:
        """Once torch.cuda is loaded: its lazy initialisation (every CUDA
        tensor, ``torch.cuda.init()``, ``set_device``... goes through it)
        raises in the zygote and notes the module importing. A forked worker
        gets torch's own back (``_restore_cuda``); a copy bound by name in a
        module imported later calls it too, outside the zygote's pid."""
        cuda = sys.modules.get("torch.cuda")
        original = getattr(cuda, "_lazy_init", None)
        if cuda is None or self.cuda_init is not None or not callable(original):
            return
        zygote = self

        def _lazy_init() -> None:
            if os.getpid() != zygote.pid:
                original()
                return
            if zygote.cuda_tried is None:
                zygote.cuda_tried = zygote.importing or "?"
            raise RuntimeError(REFUSED)

        self.cuda_init = original
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("torch") and getattr(mod, "_lazy_init", None) is original:
                mod._lazy_init = _lazy_init  # type: ignore[attr-defined]
                self.cuda_hooked.append(mod)

    def _restore_cuda(self) -> None:
        for mod in self.cuda_hooked:
            with contextlib.suppress(AttributeError, TypeError):
                mod._lazy_init = self.cuda_init

    def _arm(self, name: str) -> Any:
        """A bound on the import of ``name``: past ``import_timeout`` s the
        zygote says the module is unsafe and quits (an import blocked in
        native code that never returns to Python is the agent's fork
        timeout's)."""
        if self.import_timeout <= 0:
            return None

        def _hung(signum: int, frame: Any) -> None:
            self._unsafe([name], f"its import did not finish within {self.import_timeout:g} s")

        previous = signal.signal(signal.SIGALRM, _hung)
        signal.setitimer(signal.ITIMER_REAL, self.import_timeout)
        return previous

    def _disarm(self, previous: Any) -> None:
        if previous is None:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    def _installed(self, top: str) -> bool:
        """Whether top-level package ``top`` is found in the standard library or
        an installed package (not the script's folder or the working
        directory). Looking a top-level name up imports nothing; its modules
        live in its folder."""
        if top not in self.checked:
            loaded = sys.modules.get(top)
            self.checked[top] = _runner._names.top_installed(top, self.roots, loaded)
        return self.checked[top]

    def _unsafe(self, names: list[str], why: str, variable: str | None = None) -> None:
        self._send(M.Unsafe(tuple(names), why, variable))
        os._exit(4)

    def _report(self) -> None:
        # Its imports done, while nothing waits: collect once, then freeze
        # what is left (see _fork_batch).
        gc.collect()
        gc.freeze()
        self._send(
            M.Ready(
                loaded=self.loaded,
                failed=tuple(self.failed),
                rss_kb=_rss_kb(),
                preload_s=round(time.monotonic() - self.started, 3),
                stopped=self.stopped,
                python=".".join(map(str, sys.version_info[:3])),
                torch=_version("torch"),
            )
        )
        self.failed = []

    # ------------------------------------------------------------ messages
    def _send(self, message: Any) -> None:
        with contextlib.suppress(OSError):
            self.ctl.send(M.encode(message))

    def _recv(self) -> tuple[Any, list[int]] | None:
        """One message (None: unreadable) and its fds; None at end of file."""
        try:
            data, fds, flags, _ = socket.recv_fds(self.ctl, MAX_MESSAGE, FDS_PER_WORKER)
        except OSError:
            return None
        if not data and not fds:
            return None
        if flags & socket.MSG_TRUNC:
            return None, fds
        try:
            return M.from_json(json.loads(data)), fds
        except ValueError:  # not JSON, or M.BadMessage
            return None, fds

    def _handle(self, message: Any, fds: list[int]) -> None:
        """Act on one message; raises _Become in a forked worker."""
        if isinstance(message, M.Preload):
            self._enqueue(list(message.modules))
        if isinstance(message, M.Fork) and len(fds) in (3, 4):
            self.batch.append((message, fds))
            fds = []
            if len(self.batch) >= message.count:
                batch, self.batch = self.batch, []
                self._check(None)  # the same checks again: never a tainted fork
                self._fork_batch(batch)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _next(self) -> bool:
        """Read and act on the next message; False at end of file."""
        got = self._recv()
        if got is None:
            return False
        self._handle(*got)
        return True

    def _readable(self, timeout: float) -> bool:
        with contextlib.suppress(OSError, ValueError):
            return bool(select.select([self.ctl], [], [], timeout)[0])
        return False

    # ------------------------------------------------------------ forking
    def _fork_batch(self, batch: list[tuple[Any, list[int]]]) -> None:
        if self.idle:
            _set_policy(os.SCHED_OTHER)  # the workers inherit it
        # Every object so far out of the cyclic collector's reach: a worker's
        # collections (and its exit's) never walk them, so they never copy
        # the pages it shares with the zygote. A forked worker's exit took
        # 1-2 s of copy-on-write faults with torch and Lightning loaded,
        # 0.25-0.35 s frozen (2 cores, loaded): the restart waits for it.
        gc.freeze()
        every_fd = [fd for _, fds in batch for fd in fds]
        kids: list[tuple[int, int] | None] = []
        for order, fds in batch:
            r, w = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(r)
                os.close(w)
                kids.append(None)
                continue
            if pid == 0:  # the intermediate
                os.close(r)
                if _fork_or_exit():
                    os._exit(0)  # the worker is re-parented to the agent
                # The worker: a session of its own before anyone may signal
                # the zygote's process group, then its pid to the zygote.
                os.setsid()
                _report(w, os.getpid())
                raise _Become(order, fds, [fd for fd in every_fd if fd not in fds])
            os.close(w)
            kids.append((pid, r))
        pids: list[int | None] = []
        for kid in kids:
            if kid is None:
                pids.append(None)
                continue
            pid, r = kid
            data = _read_all(r)  # the worker's pid, once it leads a session
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # the intermediate is gone: the worker is the agent's
            pids.append(int(data) if data.isdigit() else None)
        for fd in every_fd:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._send(M.Forked(tuple(pids)))
        if self.idle and self.queue:
            _set_policy(os.SCHED_IDLE)

    def adopted(self, become: _Become) -> Any:
        """In the worker: wait to be the agent's child, then become its worker."""
        deadline = time.monotonic() + ADOPT_WAIT
        while os.getppid() != self.agent_pid:
            if time.monotonic() > deadline:
                os._exit(70)
            time.sleep(0.0005)
        if self.prctl is not None:
            self.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != self.agent_pid:
            os._exit(70)  # the agent died in between
        _set_policy(os.SCHED_OTHER)
        self._restore_cuda()
        with contextlib.suppress(OSError):
            os.close(self.ctl.detach())  # the agent's socket is the zygote's, not ours
        for fd in become.others:
            with contextlib.suppress(OSError):
                os.close(fd)
        out, err, channel = become.fds[:3]
        if not _wait_go(channel, GO_WAIT):
            os._exit(71)
        # The worker's stdin, as the agent gives cold workers: the agent's own
        # (the launcher's, as torchrun gives it), passed with this order only:
        # the zygote holds it no longer than the fork. fd 0 is free: the socket is gone.
        stdin = become.fds[3] if len(become.fds) > 3 else os.open(os.devnull, os.O_RDONLY)
        if stdin != 0:
            os.dup2(stdin, 0)
            os.close(stdin)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.environ.clear()
        os.environ.update(become.order.env)
        os.environ[_runner.CHANNEL_ENV] = str(channel)
        return become.order

    # ------------------------------------------------------------ the loop
    def serve(self) -> Any:
        """Preload and fork until the agent closes the socket (None), or, in a
        forked worker, return its order (a ``Fork``)."""
        try:
            self._loop()
        except _Become as become:
            return self.adopted(become)
        return None

    def _loop(self) -> None:
        if self.idle:
            _set_policy(os.SCHED_IDLE)
        elif self.delay > 0 and self.queue and self._readable(self.delay):
            pass  # the agent needs us already: no more waiting
        reported = False
        while True:
            if self.queue:
                reported = False
                if self.base == 0 and self._readable(0):
                    if not self._next():
                        return
                else:
                    self._import_next()
                continue
            if not reported and self._readable(0):
                # Orders that came while it imported its base (more modules,
                # perhaps) are read before it says it is ready.
                if not self._next():
                    return
                continue
            if not reported:
                if self.idle:
                    _set_policy(os.SCHED_OTHER)
                self._report()
                reported = True
            if not self._next():
                return
            if self.queue and self.idle:
                _set_policy(os.SCHED_IDLE)


def _fork_or_exit() -> int:
    try:
        return os.fork()
    except OSError:
        os._exit(1)


def _report(fd: int, pid: int) -> None:
    try:
        os.write(fd, str(pid).encode())
        os.close(fd)
    except OSError:
        os._exit(72)


def _read_all(fd: int) -> str:
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 64):
            data += chunk
    os.close(fd)
    return data.decode(errors="replace").strip()


def _wait_go(fd: int, timeout: float) -> bool:
    """Whether the agent's ``Go`` came on the channel ``fd`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) > MAX_GO:
            return False
        try:
            ready = select.select([fd], [], [], left)[0]
            # One byte at a time: never past the line (what follows is the runner's).
            chunk = os.read(fd, 1) if ready else b""
        except OSError:
            return False
        if ready and not chunk:
            return False  # the agent closed it: not wanted
        buf += chunk
    try:
        return isinstance(M.from_json(json.loads(buf)), M.Go)
    except ValueError:
        return False


def _float(text: str | None, default: float) -> float:
    """An ASCII number from the agent's variables (not ``float('٣')``)."""
    value = _runner._load_sibling("_progress").numbers().ascii_decimal(text or "")
    return default if value is None else float(value)


def _int(text: str | None, default: int) -> int:
    value = _runner._load_sibling("_progress").numbers().ascii_int(text or "")
    return default if value is None else int(value)


def serve(script: str | None = None) -> Any:
    """Serve the agent; ``script``: the module name that would run the
    worker's script (never imported here)."""
    return Zygote(script).serve()
