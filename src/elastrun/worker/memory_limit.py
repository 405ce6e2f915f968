"""How much more memory this process' cgroup may use (standard library only).

Pages of a tmpfs such as ``/dev/shm`` are charged to the memory cgroup of
the process that touches them. A memory checkpoint's slot that the tmpfs has
room for (a pod's ``/dev/shm`` of 16 GiB) can still take the container past
its memory limit, and then the kernel's OOM killer ends a process of the
container (the agent, a worker) instead of the save failing. So before a
slot grows, :func:`refusal` compares its size with the cgroup's headroom:
its limit less its usage, at its own level and every level above it (cgroup
v2: ``memory.max`` and ``memory.current``; v1: ``memory.limit_in_bytes`` and
``memory.usage_in_bytes``), the inactive page cache (``memory.stat``'s
``inactive_file``, which the kernel reclaims first) not counted as used, as
the kubelet counts a container's working set; ``MARGIN`` bytes are kept for
the processes themselves. A slot that does not fit is refused with a line naming the limit
(train/memory.py then falls back to the disk with its one warning). No limit
found (none set, no cgroup files): no refusal.
"""

from __future__ import annotations

import os

__all__ = ["MARGIN", "headroom", "refusal"]

CGROUP = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
MARGIN = 256 << 20  # bytes left for the processes' own memory
UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)
MAX_LEVELS = 64  # levels of the hierarchy looked at


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as fp:
            text = fp.read(64).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(folder: str, key: str) -> int:
    """The reclaimable page cache of the cgroup at ``folder`` (0 if unknown)."""
    try:
        with open(os.path.join(folder, "memory.stat"), "rb") as fp:
            lines = fp.read(1 << 16).decode("ascii", errors="replace").splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value.strip())
    return 0


def _paths(self_cgroup: str) -> tuple[str | None, str | None]:
    """This process' cgroup v2 path and v1 memory path (``/`` in a cgroup namespace)."""
    v2 = v1 = None
    try:
        with open(self_cgroup, encoding="utf-8", errors="replace") as fp:
            lines = fp.read(1 << 16).splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _levels(base: str, path: str) -> list[str]:
    """``base/path`` and each folder above it, up to ``base``."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")][:MAX_LEVELS]
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


def headroom(root: str | None = None, self_cgroup: str | None = None) -> tuple[int, str] | None:
    """The bytes this process' memory cgroup may still grow by, with the limit
    file that bounds it; None when no limit is found. ``root``, ``self_cgroup``:
    the cgroup file system and this process' cgroup file (``CGROUP``,
    ``SELF_CGROUP``)."""
    root = CGROUP if root is None else root
    v2, v1 = _paths(SELF_CGROUP if self_cgroup is None else self_cgroup)
    candidates: list[tuple[str, str, str, str]] = []
    if v2 is not None:
        candidates += [
            (d, "memory.max", "memory.current", "inactive_file") for d in _levels(root, v2)
        ]
    if v1 is not None:
        base = os.path.join(root, "memory")
        candidates += [
            (d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            for d in _levels(base, v1)
        ]
    best: tuple[int, str] | None = None
    for folder, limit_name, usage_name, cache_key in candidates:
        limit = _read_int(os.path.join(folder, limit_name))
        if limit is None or limit >= UNLIMITED:
            continue  # "max", or no such file at this level
        usage = _read_int(os.path.join(folder, usage_name)) or 0
        usage = max(0, usage - _inactive_file(folder, cache_key))
        room = max(0, limit - usage)
        if best is None or room < best[0]:
            best = (room, os.path.join(folder, limit_name))
    return best


def refusal(size: int, root: str | None = None, self_cgroup: str | None = None) -> str | None:
    """Why ``size`` more bytes of shared memory would take this process' cgroup
    past its memory limit (None: they fit, or no limit is known)."""
    if size <= 0:
        return None
    found = headroom(root, self_cgroup)
    if found is None:
        return None
    room, limit_file = found
    if size + MARGIN <= room:
        return None
    return (
        f"the memory limit ({limit_file}) leaves {room / 2**20:.0f} MiB and shared memory "
        f"counts against it: {size / 2**20:.1f} MiB more (and {MARGIN >> 20} MiB kept for the "
        "processes) would get a process OOM-killed"
    )
