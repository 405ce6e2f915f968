"""Checkpoint helpers: atomic save, and agreement on the newest checkpoint at start.

Files in a checkpoint directory::

    ckpt-000000000042.pt   one checkpoint per step key (torch.save of your state)
    latest                 the file name of the newest checkpoint, one line

:func:`save_checkpoint` writes a temporary file in the same directory, flushes
and fsyncs it, renames it into place with ``os.replace``, fsyncs the directory,
then updates ``latest`` the same way and deletes all but the newest ``keep``.
A crash at any moment leaves the previous checkpoints intact; the newest
complete file is found by its name even if ``latest`` was not updated yet.

:func:`load_checkpoint` is called by every rank at start. With one collective
(an all-gather of ``(step, rank, size)``) the ranks agree on the newest
checkpoint any of them holds; if some rank lacks it, the holder broadcasts its
bytes (a uint8 tensor) and those ranks save them locally. So a node that joins
an elastic job needs no shared filesystem.

torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import io
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrun.errors import ConfigError

__all__ = [
    "CheckpointInfo",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "save_checkpoint_bytes",
]

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{12,})\.pt$")
# Temp files of interrupted saves: of a checkpoint, or of the ``latest`` pointer.
_TMP = re.compile(r"^\.(?:ckpt-.*|latest)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.tmp$")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    path: Path


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint for ``step`` lives in ``directory``."""
    return Path(directory) / f"ckpt-{step:012d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Complete checkpoints in ``directory``, oldest first (none if it does not exist)."""
    d = Path(directory)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _NAME.match(name)
        if m:
            found.append(CheckpointInfo(int(m.group(1)), d / name))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(directory: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The newest complete checkpoint in ``directory``, or None.

    Every ``ckpt-*.pt`` name is complete (it only appears by an atomic rename
    after fsync), so the highest step wins even where ``latest`` lags behind.
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _atomic_write(final: Path, write: Callable[[io.BufferedWriter], object]) -> None:
    tmp = final.parent / f".{final.name}.{_host()}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune(d: Path, keep: int) -> None:
    if keep > 0:
        for old in list_checkpoints(d)[:-keep]:
            old.path.unlink(missing_ok=True)
    host = _host()
    for name in os.listdir(d):  # temp files of saves killed on this host
        m = _TMP.match(name)
        if m and m.group("host") == host and not _pid_alive(int(m.group("pid"))):
            (d / name).unlink(missing_ok=True)


def _publish(d: Path, final: Path, keep: int) -> None:
    newest = latest_checkpoint(d)
    if newest is not None and newest.path == final:
        _atomic_write(d / LATEST, lambda f: f.write(final.name.encode() + b"\n"))
    _prune(d, keep)


def save_checkpoint_bytes(
    data: bytes, directory: str | os.PathLike[str], *, step: int, keep: int = 3
) -> Path:
    """Atomically store already-serialised checkpoint bytes as ``step`` (see save_checkpoint)."""
    if step < 0:
        raise ConfigError(f"checkpoint step must be >= 0, got {step}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(d, step)
    _atomic_write(final, lambda f: f.write(data))
    _publish(d, final, keep)
    return final


def save_checkpoint(
    state: Mapping[str, Any], directory: str | os.PathLike[str], *, step: int, keep: int = 3
) -> Path:
    """Save ``state`` (``torch.save``) atomically as checkpoint ``step``; return its path.

    ``step`` is any non-negative integer that grows with progress (a global
    step counter, or an epoch number); the newest checkpoint is the one with
    the highest step. Keeps the newest ``keep`` checkpoints (0: keep all).
    Use ``torch.load(..., weights_only=True)``-compatible contents (tensors,
    dicts, lists, numbers, strings), which is what :func:`load_checkpoint` uses.
    """
    import torch

    if step < 0:
        raise ConfigError(f"checkpoint step must be >= 0, got {step}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(d, step)
    _atomic_write(final, lambda f: torch.save(dict(state), f))
    _publish(d, final, keep)
    return final


def _read_newest(directory: str | os.PathLike[str]) -> tuple[CheckpointInfo, bytearray] | None:
    for _ in range(5):  # another process may prune the file between listing and reading
        info = latest_checkpoint(directory)
        if info is None:
            return None
        try:
            with open(info.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size)
                if f.readinto(data) != size:
                    continue
            return info, data
        except FileNotFoundError:
            continue
    raise ConfigError(f"checkpoints in {directory} keep vanishing while being read")


def _deserialize(data: bytes | bytearray, map_location: Any) -> dict[str, Any]:
    import torch

    state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint holds a {type(state).__name__}, expected a dict")
    return state


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    group: Any = None,
    map_location: Any = "cpu",
    keep: int = 3,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any] | None:
    """Agree with the other ranks on the newest checkpoint and return its state.

    Every rank of ``group`` (default: the default process group) must call it.
    Each rank looks into its own ``directory``; the ranks all-gather
    ``(step, rank, size)`` and pick the highest step (lowest rank on ties).
    If every rank holds that step, each loads its own file. Otherwise the
    holder broadcasts the file's bytes and the ranks that lacked it save them
    into their ``directory`` (byte-identical). Returns the state on every rank,
    or None on every rank when nobody has a checkpoint. Without an initialised
    process group it just loads the local newest checkpoint.

    ``log`` (default ``print``) receives, on the group's rank 0,
    ``=> using checkpoint from rank: R, step: S`` and, when bytes are sent,
    ``=> checkpoint broadcast size is: N bytes``; receivers log where they
    saved the copy. Pass ``log=None`` for silence.
    """
    import torch
    import torch.distributed as dist

    found = _read_newest(directory)
    local, data = (None, None) if found is None else found
    if not (dist.is_available() and dist.is_initialized()):
        if local is None or data is None:
            return None
        if log is not None:
            log(f"=> using checkpoint from rank: 0, step: {local.step} ({local.path})")
        return _deserialize(data, map_location)

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())

    mine = torch.tensor(
        [local.step if local else -1, rank, len(data) if data is not None else 0],
        dtype=torch.int64,
        device=device,
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(int(v) for v in t.cpu().tolist()) for t in gathered]
    best_step = max(r[0] for r in rows)
    if best_step < 0:
        if log is not None and rank == 0:
            log("=> no checkpoint on any rank: starting from scratch")
        return None
    src_group_rank = min(r[1] for r in rows if r[0] == best_step)
    size = next(r[2] for r in rows if r[1] == src_group_rank)
    if log is not None and rank == 0:
        log(f"=> using checkpoint from rank: {src_group_rank}, step: {best_step}")

    if all(r[0] == best_step for r in rows):
        assert data is not None
        return _deserialize(data, map_location)

    if log is not None and rank == 0:
        log(f"=> checkpoint broadcast size is: {size} bytes")
    if rank == src_group_rank:
        assert data is not None
        buf = torch.frombuffer(data, dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    src_global = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
    dist.broadcast(buf, src=src_global, group=group)
    received = bytes(buf.cpu().untyped_storage())
    del buf
    if local is None or local.step < best_step:
        path = save_checkpoint_bytes(received, directory, step=best_step, keep=keep)
        if log is not None:
            log(
                f"=> rank {rank}: received checkpoint step {best_step} from rank "
                f"{src_group_rank} ({size} bytes), saved to {path}"
            )
        return _deserialize(received, map_location)
    assert data is not None
    return _deserialize(data, map_location)
