"""The first code of every Python worker elastrun starts (stdlib only).

The agent runs a worker's script or ``-m`` module through this program:
``python -u _runner.py script args`` (or ``... -m module args``), the worker's
own command line with this file in front. It runs the target exactly as
``python -u script args`` would (``sys.argv``, ``sys.path[0]``, a fresh
``__main__`` with ``__file__``, tracebacks without this file's frames, the
exit code), after setting up what elastrun observes from inside the worker:

* **the modules the worker imported** by the time it trains (its first
  ``torch.optim`` step, or ``ELASTRUN_MODULES_AFTER`` seconds after it
  started, whichever comes first), sent once to the agent over the *channel*
  socket, so that the next warm interpreter imports them ahead of time
  (``agent/modcache.py``). Only modules of the standard library and of
  installed packages are named (``ELASTRUN_MODULE_SCOPE=all`` also names the
  user's own modules); never the script itself, a program's entry point
  (``*.__main__``) nor a module that acts when imported (``_modnames.py``).

* **progress** (``_progress.py``): optimizer steps, DataLoader batches and
  checkpoint phases, counted through torch's process-wide hooks and written
  to ``ELASTRUN_HEARTBEAT_FILE`` for the hang watchdog and the step times;
* **in-process restarts**: the channel also carries the protocol of
  ``elastrun.train.in_process`` (``_restart.py``, given the round the
  worker starts in, ``ELASTRUN_ROUND``);
* **stacks**: with ``ELASTRUN_STACKS_FILE``, ``faulthandler`` writes every
  thread's Python stack there on the stack signal, ``ELASTRUN_STACK_SIGNAL``
  (its number; default ``SIGRTMIN+5``), which the agent sends when it
  declares a hang (``--stack-signal``).

With ``ELASTRUN_RUNNER=zygote`` the program is the agent's warm interpreter
instead (``_zygote.py``, loaded from beside this file): it imports modules
ahead of time, then forks the workers. A forked worker continues here, in
:func:`main`, as a worker.

The channel (fd ``ELASTRUN_CHANNEL_FD``, a stream socket to the agent)
carries the typed messages of ``_messages.py`` (loaded from beside this
file), one JSON line each: ``Modules`` once the worker trains; while the
progress file cannot be written (``_progress.py``), ``ProgressFailed`` once,
then ``Progress`` for each new record. Writes never block the worker: a
message that does not fit is dropped.

Variables this program reads are removed from ``os.environ`` before the
script runs, so the script and its children do not see them.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from importlib.machinery import SourceFileLoader
from typing import Any

MODE_ENV = "ELASTRUN_RUNNER"  # "zygote": serve forks (see _zygote.py)
CHANNEL_ENV = "ELASTRUN_CHANNEL_FD"  # the channel socket's fd
SCOPE_ENV = "ELASTRUN_MODULE_SCOPE"  # "installed" (default) or "all"
AFTER_ENV = "ELASTRUN_MODULES_AFTER"  # s after start to record without an optimizer step
STACKS_ENV = "ELASTRUN_STACKS_FILE"  # where faulthandler writes on the stack signal
STACK_SIGNAL_ENV = "ELASTRUN_STACK_SIGNAL"  # its number (--stack-signal)
PROGRESS_ENV = ("ELASTRUN_HEARTBEAT_FILE", "ELASTRUN_HEARTBEAT_INTERVAL")  # see _progress.py
ROUND_ENV = "ELASTRUN_ROUND"  # the round it starts in (in-process restarts: _restart.py)
STANDBY_ENV = "ELASTRUN_STANDBY"  # "1": a standby without a rank yet (_restart.py)
STANDBY_PRELOAD_ENV = "ELASTRUN_STANDBY_PRELOAD"  # what it imports while it waits (_restart.py)
PRIVATE_ENV = (
    MODE_ENV,
    CHANNEL_ENV,
    SCOPE_ENV,
    AFTER_ENV,
    STACKS_ENV,
    STACK_SIGNAL_ENV,
    ROUND_ENV,
    STANDBY_ENV,
    STANDBY_PRELOAD_ENV,
    *PROGRESS_ENV,
)
# The default signal on which a worker writes every thread's Python stack (the
# agent sends it when it declares a hang). A real-time signal: scripts and the
# libraries they use (SLURM's SIGUSR1, Lightning's requeue) do not take it.
STACK_SIGNAL_OFFSET = 5  # SIGRTMIN+5
DEFAULT_AFTER = 30.0
OPTIMIZER_MODULE = "torch.optim.optimizer"
_SELF = os.path.abspath(__file__)
_HERE = os.path.dirname(_SELF)


# --------------------------------------------------------------------------- modules


def _load_sibling(name: str) -> types.ModuleType:
    """``{name}.py`` from beside this file, as module ``_elastrun{name}`` (this
    program runs as a script, so its folder is not a package here)."""
    loaded = sys.modules.get(f"_elastrun{name}")
    if loaded is not None:
        return loaded
    path = os.path.join(_HERE, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_elastrun{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# Which modules may be named and imported ahead of time (_modnames.py).
_names = _load_sibling("_modnames")
# The messages to and from the agent (_messages.py).
M = _load_sibling("_messages")
MAX_MODULES: int = _names.MAX_MODULES
MAX_NAME: int = _names.MAX_NAME
installed_roots = _names.installed_roots
origin_installed = _names.origin_installed


def select_modules(
    modules: dict[str, Any],
    scope: str,
    roots: Sequence[str],
    limit: int = MAX_MODULES,
    script: str | None = None,
) -> list[str]:
    """The names of ``modules`` (``sys.modules``, in import order) a warm
    interpreter may import ahead of time: real modules under their own name
    that pass ``_modnames.refusal`` (never the script, ``script`` included),
    and (scope ``installed``) from ``roots`` only."""
    out: list[str] = []
    for name, mod in list(modules.items()):
        if len(out) >= limit:
            break
        if not isinstance(mod, types.ModuleType) or getattr(mod, "__name__", "") != name:
            continue
        if _names.refusal(name, script) is not None:
            continue
        try:
            if scope != "all" and not _names.module_installed(mod, roots):
                continue
        except Exception:  # noqa: S112 - an exotic module object: not one to name
            continue
        out.append(name)
    return out


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once ``name`` has been imported (a post-import hook)."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        callback = self.callback

        class _Then(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                with contextlib.suppress(Exception):
                    callback(module)

        spec.loader = _Then()
        return spec


# s the script's end waits for the module list still being sent (then it is dropped).
MODULES_JOIN = 5.0


class ModuleRecorder:
    """Sends the worker's imported modules to the agent once it trains.

    The list is made in a thread of its own (``elastrun-modules``), from a
    copy of ``sys.modules`` taken at the first optimizer step: finding where
    each of a thousand modules lives (their real paths) takes a few tenths of
    a second, which would otherwise lengthen the first step of every start
    and restart (and the goodput accounting would count it as training).
    """

    def __init__(
        self, channel: Channel, scope: str, after: float, script: str | None = None
    ) -> None:
        self.channel = channel
        self.scope = scope
        self.script = script  # the module name that would run the script
        self.after = after
        self._sent = False
        self._lock = threading.Lock()
        self._hook: Any = None
        self._stepped = False  # the first optimizer step came (the hook then does nothing)
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        mod = sys.modules.get(OPTIMIZER_MODULE)
        if mod is not None:
            self._on_optimizer_module(mod)
        else:
            sys.meta_path.insert(0, _OnImport(OPTIMIZER_MODULE, self._on_optimizer_module))
        if self.after > 0:
            timer = threading.Timer(self.after, self.send, args=("timer",))
            timer.daemon = True
            timer.name = "elastrun-modules"
            timer.start()

    def _on_optimizer_module(self, mod: types.ModuleType) -> None:
        register = getattr(mod, "register_optimizer_step_post_hook", None)
        if register is not None:
            self._hook = register(self._on_step)

    def _on_step(self, *_: Any) -> None:
        """Inside the script's first optimizer step: a copy of the modules,
        sent from a thread. Never raises. Left registered, a no-op after the
        first step: removed here, inside the optimizer's loop over its hooks,
        it breaks that loop ("OrderedDict mutated during iteration") when a
        hook follows it (a standby's progress hook is registered after it:
        _restart.py)."""
        if self._stepped:
            return
        self._stepped = True
        with contextlib.suppress(Exception):
            modules = dict(sys.modules)
            thread = threading.Thread(
                target=self.send, args=("optimizer_step", modules), name="elastrun-modules"
            )
            thread.daemon = True
            self._thread = thread
            thread.start()

    def finish(self, timeout: float = MODULES_JOIN) -> None:
        """The script ended: let a list being sent go out (at most ``timeout`` s)."""
        thread = self._thread
        if thread is not None:
            with contextlib.suppress(Exception):
                thread.join(timeout)

    def send(self, why: str, modules: dict[str, Any] | None = None) -> None:
        """Never raises (it runs in the script's process)."""
        with self._lock:
            if self._sent:
                return
            self._sent = True
        with contextlib.suppress(Exception):
            self._send(why, dict(sys.modules) if modules is None else modules)

    def _send(self, why: str, modules: dict[str, Any]) -> None:
        names = select_modules(modules, self.scope, installed_roots(), script=self.script)
        torch = modules.get("torch")
        self.channel.send(
            M.Modules(
                why=why,
                modules=tuple(names),
                python=".".join(map(str, sys.version_info[:3])),
                torch=getattr(torch, "__version__", None) if torch is not None else None,
            )
        )


# -------------------------------------------------------------- teardown

C10D_MODULE = "torch.distributed.distributed_c10d"
# s the script's destroy_process_group() waits first, the GIL released.
DESTROY_PAUSE = 0.05


def pause_before_destroy(c10d: types.ModuleType) -> None:
    """Make ``destroy_process_group()`` wait ``DESTROY_PAUSE`` first.

    A gloo process group's worker threads release a finished collective's
    tensors a moment after the script's call returned; freeing one whose
    Python object is gone takes the GIL. When the script then drops the last
    reference to the group (a DDP model going out of scope after
    ``destroy_process_group()``), torch joins those threads while holding the
    GIL: if one is still releasing, both wait forever and the job never ends.
    Measured with the benchmark's DDP worker on 2 cores: 4-5 hangs in 20-24
    runs when torch._dynamo is imported before the process group (as a warm
    interpreter does), none with this pause (also none in 65 runs with it
    imported later). Torch's teardown, not the script's, so it is done here.
    """
    real = getattr(c10d, "destroy_process_group", None)
    if real is None or getattr(real, "_elastrun_pause", False):
        return

    @functools.wraps(real)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        time.sleep(DESTROY_PAUSE)  # the gloo threads finish their releases
        return real(*args, **kwargs)

    destroy_process_group._elastrun_pause = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is real:
        dist.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


def on_import(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """``callback(module)`` once ``name`` is imported (now, if it is)."""
    mod = sys.modules.get(name)
    if mod is not None:
        with contextlib.suppress(Exception):
            callback(mod)
    else:
        sys.meta_path.insert(0, _OnImport(name, callback))


_stacks_file: Any = None  # kept open: faulthandler writes to its fd


def stack_signal(text: str | None) -> int | None:
    """The stack signal's number from ``ELASTRUN_STACK_SIGNAL`` (default
    SIGRTMIN+5); None when it is not a signal this platform has."""
    import signal

    if not text:
        return int(signal.SIGRTMIN) + STACK_SIGNAL_OFFSET
    signum = _load_sibling("_progress").numbers().ascii_int(text)  # ASCII only: not int('٣')
    return signum if signum is not None and 0 < signum < signal.NSIG else None


def register_stacks(path: str, signum: int) -> None:
    """Dump every thread's stack into ``path`` on ``signum``. ``path``
    appears only once the handler is in place: the agent signals a worker
    only when it exists (the signal's default action would end the process).
    It is made as a new, randomly named file (``O_EXCL``, no link followed),
    then renamed."""
    global _stacks_file
    import faulthandler
    import secrets
    import signal

    fs = _load_sibling("_progress").safefs()
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        f = os.fdopen(fs.create_new(tmp), "w", encoding="utf-8")
    except OSError:
        return
    try:
        # faulthandler names threads by id: say which one runs the script.
        f.write(f"# elastrun: main thread 0x{threading.get_ident():x}\n")
        f.flush()
        # faulthandler restores the previous disposition when the interpreter
        # finalizes: "ignore", so a late signal cannot end an exiting worker.
        signal.signal(signum, signal.SIG_IGN)
        faulthandler.register(signum, file=f, all_threads=True, chain=False)
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError):
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return
    _stacks_file = f


def guard_teardown() -> None:
    """:func:`pause_before_destroy` now, or once torch.distributed is imported."""
    c10d = sys.modules.get(C10D_MODULE)
    if c10d is not None:
        pause_before_destroy(c10d)
    else:
        sys.meta_path.insert(0, _OnImport(C10D_MODULE, pause_before_destroy))


class Channel:
    """The worker's end of the channel socket (writes never block)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self._lock = threading.Lock()  # the script's thread and the progress thread
        if fd is not None:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)  # not for the script's own children

    def send(self, message: Any) -> None:
        """Send one of _messages.py's messages (never raises, never blocks)."""
        data = M.encode_line(message)
        with self._lock, contextlib.suppress(OSError):
            fd = self.fd  # another thread may have closed it meanwhile
            if fd is None:
                return
            os.set_blocking(fd, False)
            if os.write(fd, data) != len(data):
                # A short write would leave half a line: this channel is done.
                self.fd = None
                os.close(fd)


# --------------------------------------------------------------------------- running


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
    own = {_SELF, os.path.join(_HERE, "_zygote.py"), os.path.join(_HERE, "_settle.py")}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in own:
        tb = tb.tb_next
    exc.__traceback__ = tb


def target_path(kind: str, target: str) -> str:
    """sys.path[0] as the worker will have it."""
    return os.path.dirname(os.path.realpath(target)) if kind == "script" else os.getcwd()


def run_worker(kind: str, target: str, args: list[str], quick: Any = None) -> None:
    """Set up the observers, then run the target; exits as the target would
    (``quick``: in a worker forked from the warm interpreter, see
    :class:`QuickExit`)."""
    env = os.environ
    standby = env.get(STANDBY_ENV) == "1"  # read before the runner's variables are removed
    numbers = _load_sibling("_progress").numbers()  # ASCII only: '²'.isdigit() is True
    channel_fd = numbers.ascii_int(env.get(CHANNEL_ENV, ""))
    channel = Channel(channel_fd if channel_fd is not None and channel_fd >= 0 else None)
    scope = env.get(SCOPE_ENV, "installed")
    after = numbers.ascii_decimal(env.get(AFTER_ENV, ""))
    after = DEFAULT_AFTER if after is None else after

    def observe() -> Any:
        """What the rank's variables name for the runner itself: its stacks
        file and its progress (a standby's, once it has a rank)."""
        stacks = env.get(STACKS_ENV)
        signum = stack_signal(env.get(STACK_SIGNAL_ENV))
        if stacks and signum is not None:
            register_stacks(stacks, signum)
        # Reads its own variables; the channel carries progress when its file fails.
        progress = _load_sibling("_progress").install(
            on_import, channel.send if channel.fd is not None else None
        )
        for name in PRIVATE_ENV:
            env.pop(name, None)
        return progress

    # In-process restarts (train/in_process.py) talk to the agent over the channel.
    _load_sibling("_restart").install(
        channel,
        env.get(ROUND_ENV),
        numbers,
        standby_text=env.get(STANDBY_ENV),
        late=observe,
        preload=env.get(STANDBY_PRELOAD_ENV),
    )
    observe()
    recorder = None
    if channel.fd is not None:
        recorder = ModuleRecorder(channel, scope, after, _names.script_module(kind, target))
        recorder.install()
    guard_teardown()
    # Ranks other than 0 connect to rank 0's store as soon as it listens (_master.py,
    # loaded then: a script that does not use torch.distributed never needs it).
    on_import(
        "torch.distributed.rendezvous",
        lambda rendezvous: _load_sibling("_master").install(rendezvous),
    )
    # A standby that failed ends as a forked worker does: its finalization would
    # tear down a process group whose peers still wait in its collectives.
    quick = quick or _load_sibling("_quick_exit").QuickExit(forked=standby)
    # A script that succeeded has torch.distributed shut down before the
    # interpreter finalizes, so it cannot abort in its teardown (_settle.py).
    settle = _load_sibling("_settle")
    try:
        with settle.after_success():
            try:
                if kind == "module":
                    _run_module(target, args)
                else:
                    _run_script(target, args)
            finally:
                progress = _load_sibling("_progress").current()  # a standby's: late
                if progress is not None:
                    progress.exiting()  # the teardown is no hang of the training
                if recorder is not None:
                    recorder.finish()
    except SystemExit as e:
        if e.code not in (None, 0):
            channel.send(M.Failing())
            quick.failed(e.code)
        else:
            quick.succeeded()
        raise
    except KeyboardInterrupt:
        channel.send(M.Failing())
        raise
    except BaseException as e:
        # First: the agent times the failure now, not after the teardown.
        channel.send(M.Failing())
        _strip_own_frames(e)  # the traceback reads as the script's own
        sys.excepthook(type(e), e, e.__traceback__)
        quick.failed(1)
        sys.exit(1)
    quick.succeeded()


def main(argv: list[str]) -> None:
    # argv as the worker's own, after the interpreter: "script args" or "-m module args".
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("elastrun runner: usage: _runner.py script args | -m module args")
    kind, target = ("module", argv[1]) if argv[0] == "-m" else ("script", argv[0])
    args = argv[2:] if kind == "module" else argv[1:]
    if os.environ.get(MODE_ENV) == "zygote":
        quick = _load_sibling("_quick_exit").QuickExit(forked=True)  # first: runs last at exit
        # Imports resolve as they will for the worker: its sys.path[0].
        sys.path[0] = target_path(kind, target)
        order = _load_sibling("_zygote").serve(_names.script_module(kind, target))
        if order is None:
            sys.exit(0)  # the agent closed the socket: not needed any more
        args = list(order.args)
        run_worker(kind, target, args, quick)
        return
    run_worker(kind, target, args)


if __name__ == "__main__":
    main(sys.argv[1:])
