"""Shut torch.distributed down before the interpreter finalizes (stdlib only).

Why: a script that ends without ``destroy_process_group()`` can abort at exit
("terminate called without an active exception", SIGABRT) although it
finished its work. A gloo process group runs each collective on a worker
thread of its own, and that thread drops its reference to the collective's
tensors a moment after the script's call returned. Releasing a tensor that a
Python object still refers to takes the GIL. If the interpreter has begun to
finalize by then (the script's last line was the collective, or a print after
it), Python ends the thread that asks for the GIL with ``pthread_exit``, which
unwinds through a C++ destructor that must not throw: ``std::terminate``.
Whether it happens is a race on the worker's own exit; with two ranks on a
loaded 2-core machine, about one run in four aborted (torchrun's plain
scripts too). ``destroy_process_group()`` waits for that thread (torch's
process-group destructor joins its worker threads, with the GIL released),
which is why torch recommends calling it.

What: :func:`after_success` wraps the code that runs the user's entry point::

    with after_success():
        run_the_script()

When the wrapped code ends normally (or with ``SystemExit`` 0), then at exit,
after the script's own ``atexit`` functions, the default process group (and
every other) is destroyed if the script left it initialised, waiting at most
``SETTLE_TIMEOUT`` seconds. Nothing happens when the script failed (the agent
must see the failure at once), when torch.distributed was never imported
(it is not imported here), or when the script destroyed its groups itself.

This file imports only the standard library, so a runner that runs as a
script (not from the ``elastrun`` package) can load it by path.
"""

from __future__ import annotations

import atexit
import sys
import threading
from types import TracebackType
from typing import Any

__all__ = ["SETTLE_TIMEOUT", "after_success", "settle"]

SETTLE_TIMEOUT = 10.0  # s: how long exit waits for torch.distributed to shut down


def settle(timeout: float = SETTLE_TIMEOUT) -> bool:
    """Destroy torch.distributed's process groups if a default one is still
    up; True when that finished within ``timeout`` (or there was nothing)."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None:
        return True
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return True
    except Exception:
        return True
    done = threading.Event()
    errors: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    # A thread: a group whose shutdown hangs must not hold the exit forever.
    threading.Thread(target=destroy, name="elastrun-settle", daemon=True).start()
    if not done.wait(timeout):
        sys.stderr.write(
            f"elastrun: torch.distributed did not shut down within {timeout:g} s after the "
            "script ended; exiting without waiting for it\n"
        )
        return False
    if errors:
        sys.stderr.write(
            f"elastrun: destroying the process group the script left at exit failed: "
            f"{type(errors[0]).__name__}: {errors[0]}\n"
        )
    return True


def _succeeded(exc_type: type[BaseException] | None, exc: BaseException | None) -> bool:
    if exc_type is None:
        return True
    if isinstance(exc, SystemExit):
        return exc.code is None or exc.code == 0
    return False


class after_success:
    """Arm :func:`settle` for exit if the wrapped code ends successfully."""

    def __init__(self, timeout: float = SETTLE_TIMEOUT) -> None:
        self.timeout = timeout
        self.ok = False

    def __enter__(self) -> after_success:
        # Registered before the script runs: atexit runs it after the script's own.
        atexit.register(self._at_exit)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.ok = _succeeded(exc_type, exc)

    def _at_exit(self) -> None:
        if self.ok:
            settle(self.timeout)
