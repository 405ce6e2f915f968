"""Files and folders in places other users may reach, opened safely.

An agent often runs as root and writes under a ``--log-dir`` that other users
can reach (a shared file system, ``/tmp``), whose names (run id, host) are
predictable. Everything it creates there goes through this module:

* **No links followed.** The last component is opened with ``O_NOFOLLOW``;
  files that must be new are created with ``O_EXCL`` (a planted name makes the
  open fail rather than write through it).
* **Folders are ours.** :func:`private_dir` creates each missing folder with
  mode 0700 and refuses one that is a link, not a folder, owned by another
  user, or writable by group or others (:class:`UnsafePath`, naming the folder
  and what is wrong). :func:`check_parent` refuses a parent that another user
  could rearrange under us (writable by others without the sticky bit, as
  ``/tmp`` has).
* **Never blocked by a special file.** Opens are non-blocking and the result
  must be a regular file: a FIFO or a device planted at a name we read or
  write is refused at once (a plain ``open()`` of a FIFO blocks until a
  writer comes).
* **Bounded reads.** :func:`read_regular` reads at most ``limit`` bytes and
  refuses a larger file.

Standard library only: worker-side helpers use it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

__all__ = [
    "UnsafePath",
    "append_fd",
    "check_parent",
    "create_new",
    "nearest_existing",
    "open_regular",
    "private_dir",
    "read_regular",
    "write_atomic",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafePath(OSError):
    """A path we refuse to use: a link, a special file, or a folder another
    user controls. ``str()`` names the path and the problem. ``errno`` is
    ``EPERM`` for a refusal; a folder that could not be created or read keeps
    the system's error number (``ENOSPC`` on a full disk)."""

    def __init__(self, path: str, problem: str, code: int = errno.EPERM) -> None:
        super().__init__(code, problem, path)
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def _refuse_dir(path: str, st: os.stat_result) -> str | None:
    """Why the folder ``st`` is not safe to write in (None: it is ours)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"is {_kind(st.st_mode)}, not a folder"
    if st.st_uid != os.geteuid():
        return (
            f"is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); "
            "another user may have planted it: remove it or choose another folder"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):o}); make it private (chmod go-w) or "
            "choose another folder"
        )
    return None


def check_parent(path: str) -> None:
    """Refuse ``path`` (an existing folder we will create things in) when
    another user could swap what we create there: owned by someone other than
    us or root and writable by us only through group or others, or writable by
    group or others without the sticky bit. Links in ``path`` itself are the
    caller's choice and followed."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UnsafePath(path, f"cannot be read: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, f"is {_kind(st.st_mode)}, not a folder")
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if shared and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            path,
            f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o}) without the "
            "sticky bit, so they could replace what is created in it; use a folder only "
            "you can write, or a sticky one such as /tmp",
        )
    if st.st_uid not in (0, os.geteuid()) and shared:
        raise UnsafePath(path, f"is owned by uid {st.st_uid} and shared with other users")


def nearest_existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists (a ``below`` for
    :func:`private_dir` that creates every missing folder on the way)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def private_dir(path: str, *, below: str | None = None) -> str:
    """Create ``path`` (mode 0700) and every missing folder between ``below``
    (an existing folder, checked with :func:`check_parent`; default: the
    parent of ``path``) and it, refusing any component that exists but is a
    link, not a folder, another user's, or writable by group or others.
    Returns ``path``. Raises :class:`UnsafePath`."""
    path = os.path.abspath(path)
    base = os.path.abspath(below) if below is not None else os.path.dirname(path)
    rel = os.path.relpath(path, base)
    if rel == ".":
        return path
    if rel.startswith(os.pardir):
        raise UnsafePath(path, f"is not inside {base}")
    check_parent(base)
    current = base
    for part in rel.split(os.sep):
        current = os.path.join(current, part)
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            why = f"cannot be created: {e.strerror or e}"
            raise UnsafePath(current, why, e.errno or errno.EPERM) from None
        try:
            st = os.lstat(current)
        except OSError as e:
            why = f"cannot be read: {e.strerror or e}"
            raise UnsafePath(current, why, e.errno or errno.EPERM) from None
        problem = _refuse_dir(current, st)
        if problem is not None:
            raise UnsafePath(current, problem)
    return path


def _check_regular(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(path, f"is {_kind(st.st_mode)}, not a regular file")


def _planted(path: str) -> str | None:
    """Why a create-or-open was denied, when it is a name another user
    planted (a link, or their file, in a sticky folder); None otherwise."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this process"
    return None


def _open(path: str, flags: int, mode: int) -> int:
    """``os.open`` with no link followed and no blocking, then checked to be
    a regular file; the descriptor is made blocking again."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(path, "is a symbolic link") from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened to write
            raise UnsafePath(path, "is a FIFO, not a regular file") from None
        planted = _planted(path) if flags & os.O_CREAT and e.errno == errno.EACCES else None
        if planted is not None:  # the kernel's protected_symlinks / protected_regular
            raise UnsafePath(path, planted) from None
        raise
    try:
        _check_regular(fd, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path: str, mode: int = 0o600) -> int:
    """A new regular file at ``path``, open for writing (``O_EXCL``: an
    existing name, a link included, is ``FileExistsError``)."""
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


def append_fd(path: str, mode: int = 0o600, *, truncate: bool = False) -> int:
    """``path`` opened to append (created when missing), refusing a link, a
    special file, or a file owned by another user."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND)
    fd = _open(path, flags, mode)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePath(path, f"is owned by uid {st.st_uid}, not by this process")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str) -> int:
    """``path`` open for reading: a regular file, no link followed, never
    blocked by a FIFO (:class:`UnsafePath` otherwise). For files too large
    for :func:`read_regular`; the caller bounds what it reads."""
    return _open(path, os.O_RDONLY, 0)


def read_regular(path: str, limit: int, *, offset: int = 0, partial: bool = False) -> bytes:
    """The bytes of the regular file ``path``: no link followed, never
    blocked by a FIFO, at most ``limit`` bytes (a larger file is refused with
    :class:`UnsafePath`). Other errors (a missing file) are ``OSError``.

    ``offset``: read from there on (``limit`` bounds what is read from it).
    ``partial``: the first ``limit`` bytes of a larger file instead of a refusal."""
    fd = open_regular(path)
    try:
        if offset > 0:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if size > limit:
        if partial:
            return data[:limit]
        raise UnsafePath(path, f"is larger than {limit} bytes")
    return data


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, sync: bool = False) -> None:
    """Replace ``path`` with ``data``: written to a new, randomly named file
    beside it (``O_EXCL``, no link followed), then renamed over it. A link
    planted at ``path`` is replaced, never written through."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = create_new(tmp, mode)
    try:
        with os.fdopen(fd, "wb", closefd=True) as fp:
            fp.write(data)
            if sync:
                fp.flush()
                os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
