"""A worker forked from the warm interpreter ends without the interpreter's
finalization (stdlib only).

This file imports only the standard library, so a runner that runs as a
script (not from the ``elastrun`` package) can load it by path.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref
from typing import Any

__all__ = ["QuickExit", "skip_bookkeeping_finalizers"]

# ``weakref.finalize`` callbacks (run at exit, before the quick exit's) that only
# undo an in-memory registration of the interpreter's own, which its end undoes
# anyway: torch.library's, one per operator library torch and its modules made
# (174 with the example's imports). Measured in a rank that raised
# (examples/train.py, warm-forked, loaded 2-core machine): 48 ms of its 90 ms
# from the exception to its exit, which the group's restart waits for.
BOOKKEEPING_FINALIZERS = frozenset({("torch.library", "_del_library")})


def open_files() -> list[Any]:
    """Every file object alive (``io``'s, whatever their class), found among
    the interpreter's objects without one Python-level step per object (there
    are some 300,000 with torch loaded: a loop of ``isinstance`` over them took
    0.3-0.9 s on a loaded 2-core machine, a failed rank's exit that its
    group's restart waits for): their types are sorted out once, then the
    objects of the file types are picked at C speed."""
    import gc
    import io
    import itertools

    objects = gc.get_objects()
    file_types = {t for t in set(map(type, objects)) if _is_file_type(t, io.IOBase)}
    return list(itertools.compress(objects, map(file_types.__contains__, map(type, objects))))


def skip_bookkeeping_finalizers() -> int:
    """Tell the exit not to run the finalizers of :data:`BOOKKEEPING_FINALIZERS`
    (each stays callable; the process ends without them). Others (a
    temporary folder's removal, a script's own) run as before. Returns how
    many were skipped."""
    registry = getattr(weakref.finalize, "_registry", None)  # CPython's, since 3.4
    if not isinstance(registry, dict):
        return 0
    skipped = 0
    for finalizer, info in list(registry.items()):
        func = getattr(info, "func", None)
        name = (getattr(func, "__module__", None), getattr(func, "__qualname__", None))
        if name in BOOKKEEPING_FINALIZERS and isinstance(finalizer, weakref.finalize):
            finalizer.atexit = False
            skipped += 1
    return skipped


def _is_file_type(t: type, base: type) -> bool:
    try:
        return issubclass(t, base)
    except Exception:  # a type whose metaclass refuses the question
        return False


class QuickExit:
    """A worker forked from the warm interpreter ends once its exit work is
    done, without the interpreter's finalization, whether its script failed
    or succeeded.

    That finalization is most of its exit: tearing down the modules it
    shares with the warm interpreter writes to every one of their objects
    (reference counts), a copy-on-write fault per page: 0.3-1.5 s of CPU with
    torch loaded, and some 120 MB of memory copied per worker, for a process
    about to end. A failed rank's group restart waits for it; a job that
    succeeded waits for its last rank. Registered by the warm interpreter
    before it imports anything, :meth:`_end` is the last ``atexit``
    function, after those of the script and of every module (its non-daemon
    threads were joined before them; after a success, the process group's
    shutdown too: _settle.py): it flushes every file still open (what
    finalization would have done by closing them; nothing is lost), then
    ends the process with the script's exit status. A standby process
    (agent/standby.py) ends so too: finalizing a process group whose peers
    still wait in its collectives can take until the agent stops it. A
    worker started cold and an exit status that is not a number are left to
    the normal exit. The exit work it skips besides the finalization:
    :data:`BOOKKEEPING_FINALIZERS`, and the ``__del__`` of the objects still
    alive at the end (as ``os._exit`` does; files are flushed first)."""

    def __init__(self, forked: bool) -> None:
        self.code: int | None = None
        self.forked = forked
        if forked:
            atexit.register(self._end)

    def failed(self, code: object) -> None:
        if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256:
            self.code = code
            if self.forked:
                skip_bookkeeping_finalizers()

    def succeeded(self) -> None:
        """The script ended well (or with ``sys.exit(0)``): the same end, status 0."""
        self.code = 0
        if self.forked:
            skip_bookkeeping_finalizers()

    def _end(self) -> None:
        if self.code is None:
            return
        for obj in open_files():
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.code)
