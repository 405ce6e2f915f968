"""Checkpoint helpers: atomic, checksummed saves; at start, agreement on the newest intact one.

:func:`save_checkpoint` writes ``ckpt-<step>.pt`` and its checksum record
``ckpt-<step>.pt.json`` (size and SHA-256) so that a kill at any moment leaves
the previous checkpoints intact (see :mod:`elastrun.worker.checkpoint_files`
for the layout and the order of writes), points ``latest`` at it and deletes
all but the newest ``keep``.

:func:`load_checkpoint` is called by every rank at start. Each rank first
finds its own newest *intact* checkpoint: newest first, a checkpoint whose
bytes do not match its record, whose record is unreadable, or which has no
record (an older elastrun wrote it) and does not load, is moved into
``corrupt/`` with one line saying which file, why and where it went, and the
next older one is tried. Then, with one collective (an all-gather of
``(step, rank, size, sha256)``), the ranks agree on the newest checkpoint any
of them holds intact; if some rank lacks it, the holder broadcasts its bytes
(a uint8 tensor), the others check them against the holder's SHA-256 and save
them with a record. So a node that joins an elastic job needs no shared
filesystem, and one rank's damaged copy is replaced by another's good one.

torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrun.errors import ConfigError
from elastrun.safefs import UnsafePath, open_regular
from elastrun.train.heartbeat import phase
from elastrun.train.log import Log, say
from elastrun.train.sharded import disk_state, first_shard, with_layouts
from elastrun.train.state_codec import decode
from elastrun.train.transfer_device import transfer_device
from elastrun.worker.checkpoint_files import (
    CheckpointInfo,
    check,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    move_aside,
    publish,
    write_checkpoint,
)
from elastrun.worker.snapshot import header_of
from elastrun.worker.torch_file import header_record

__all__ = [
    "CheckpointInfo",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "save_checkpoint_bytes",
]


def save_checkpoint_bytes(
    data: bytes | bytearray, directory: str | os.PathLike[str], *, step: int, keep: int = 3
) -> Path:
    """Atomically store already-serialised checkpoint bytes as ``step`` (see save_checkpoint)."""
    if step < 0:
        raise ConfigError(f"checkpoint step must be >= 0, got {step}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final, _ = write_checkpoint(d, step, lambda f: f.write(data))
    publish(d, final, keep)
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
    A checksum record (size, SHA-256) is written beside it.
    """
    import torch

    if step < 0:
        raise ConfigError(f"checkpoint step must be >= 0, got {step}")
    d = Path(directory)
    with phase("checkpoint"):  # --hang-timeout auto allows it longer than a step
        d.mkdir(parents=True, exist_ok=True)
        final, _ = write_checkpoint(d, step, lambda f: torch.save(dict(state), f))
        publish(d, final, keep)
    return final


# ------------------------------------------------------------------ loading


@dataclass
class _Local:
    """This rank's newest intact checkpoint."""

    info: CheckpointInfo
    data: bytearray
    sha256: str
    state: dict[str, Any] | None = None  # already loaded (an unverified one is loaded to check)


def _first_line(e: BaseException) -> str:
    """One short line for torch's (often many-paragraph) load errors."""
    text = str(e)
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", text, re.S)
    if m:  # the cause, without torch's advice on weights_only
        text = m.group(1)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if len(line) > 120 and ". " in line:
        line = line.split(". ", 1)[0] + "."
    line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _read(path: Path) -> bytearray:
    """The bytes of a checkpoint file. A link, a FIFO or another special file
    named like one is UnsafePath (never followed, never waited on)."""
    with os.fdopen(open_regular(str(path)), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        n = f.readinto(data) or 0
    if n < size:
        del data[n:]  # it shrank while being read: the check will say so
    return data


def _torch_load(data: bytes | bytearray, map_location: Any) -> dict[str, Any]:
    """The state in a checkpoint file's bytes: a ``torch.save`` file, or a
    memory checkpoint's snapshot that the agent wrote to disk."""
    import torch

    snap = header_of(data)
    if snap is not None:
        header, start = snap
        view = memoryview(data)[start : start + header.data_size]
        try:
            state = decode(header, view, map_location)
        finally:
            view.release()
        if not isinstance(state, dict):
            raise ValueError(f"it holds a {type(state).__name__}, expected a dict")
        return state
    state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    written = header_record(data)  # a memory checkpoint the agent wrote: its DTensors' layouts
    if written is not None and first_shard(written) is not None:
        state = with_layouts(state, written)
    if not isinstance(state, dict):
        raise ValueError(f"it holds a {type(state).__name__}, expected a dict")
    return state


def _load(data: bytes | bytearray, map_location: Any, what: str) -> dict[str, Any]:
    """Load bytes that passed their checksum: a failure is the content, not damage."""
    try:
        return _torch_load(data, map_location)
    except Exception as e:
        raise ConfigError(
            f"{what} is intact (its SHA-256 matches) but cannot be loaded: {_first_line(e)}; "
            "checkpoints must load with torch.load(weights_only=True): tensors, dicts, lists, "
            "numbers, strings"
        ) from e


def _set_aside(info: CheckpointInfo, why: str, log: Log) -> None:
    try:
        dest = move_aside(info)
    except FileNotFoundError:
        return  # gone: another rank sharing this directory moved it (and said so)
    except OSError as e:
        say(
            log,
            f"=> checkpoint {info.path} is damaged ({why}) and cannot be moved aside "
            f"({e.strerror or e}): skipping it",
        )
        return
    say(log, f"=> checkpoint {info.path} is damaged ({why}): moved to {dest}; trying older ones")


def _find_local(directory: str | os.PathLike[str], map_location: Any, log: Log) -> _Local | None:
    """The newest intact checkpoint in ``directory``; damaged ones are moved aside."""
    for info in reversed(list_checkpoints(directory)):
        try:
            data = _read(info.path)
        except FileNotFoundError:
            continue  # pruned or moved aside by another process meanwhile
        except UnsafePath as e:  # a link, a FIFO, a folder: not a checkpoint
            _set_aside(info, e.problem, log)
            continue
        except PermissionError as e:
            raise ConfigError(f"checkpoint {info.path} cannot be read: {e.strerror or e}") from e
        except OSError as e:  # an I/O error: the medium is damaged
            _set_aside(info, f"cannot be read: {e.strerror or e}", log)
            continue
        verdict = check(info, data)
        if verdict.status == "verified":
            return _Local(info, data, verdict.sha256)
        if verdict.status == "unverified" and not info.path.exists():
            # Another rank sharing the directory found it damaged and moved it
            # aside between our read and our look at its record (the data
            # moves first, then its record): it is not ours to use.
            continue
        if verdict.status == "unverified":
            try:
                state = _torch_load(data, map_location)
            except Exception as e:
                why = f"no checksum record, and its {len(data)} bytes do not load: {_first_line(e)}"
            else:
                say(
                    log,
                    f"=> checkpoint {info.path} has no checksum record (saved by an older "
                    "elastrun?); it loads, so it is used unverified",
                )
                return _Local(info, data, verdict.sha256, state)
        else:
            why = verdict.why
        _set_aside(info, why, log)
    return None


def _state_of(local: _Local, map_location: Any) -> dict[str, Any]:
    if local.state is not None:
        return local.state
    return _load(local.data, map_location, f"checkpoint {local.info.path}")


def _digest_words(hexdigest: str | None) -> list[int]:
    raw = bytes.fromhex(hexdigest) if hexdigest else bytes(32)
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _words_digest(words: tuple[int, ...]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).hex()


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    group: Any = None,
    map_location: Any = "cpu",
    keep: int = 3,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any] | None:
    """Agree with the other ranks on the newest intact checkpoint and return its state.

    Every rank of ``group`` (default: the default process group) must call it.
    Each rank looks into its own ``directory`` for its newest intact
    checkpoint (damaged ones are moved into ``directory/corrupt/``, one line
    each); the ranks all-gather ``(step, rank, size, sha256)`` and pick the
    highest step (lowest rank on ties). If every rank holds that step, each
    loads its own file. Otherwise the holder broadcasts the file's bytes and
    the ranks that lacked it check them against the holder's SHA-256 and save
    them (byte-identical, with a record) into their ``directory``. Returns the
    state on every rank, or None on every rank when nobody has a checkpoint.
    Without an initialised process group it loads the local newest intact one.

    ``log`` (default ``print``) receives, on the group's rank 0,
    ``=> using checkpoint from rank: R, step: S`` and, when bytes are sent,
    ``=> checkpoint broadcast size is: N bytes``; receivers log where they
    saved the copy; any rank logs the checkpoints it moved aside or uses
    unverified. Pass ``log=None`` for silence. Raises ConfigError when the
    chosen checkpoint is intact but its contents cannot be loaded.
    """
    with phase("checkpoint"):  # --hang-timeout auto allows it longer than a step
        state = _agree_and_load(directory, group, map_location, keep, log)
        if state is None:
            return None
        back: dict[str, Any] = disk_state(state, directory=str(directory))
        return back  # its DTensors' shards on their mesh again


def _agree_and_load(
    directory: str | os.PathLike[str], group: Any, map_location: Any, keep: int, log: Log
) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    local = _find_local(directory, map_location, log)
    if not (dist.is_available() and dist.is_initialized()):
        if local is None:
            return None
        say(log, f"=> using checkpoint from rank: 0, step: {local.info.step} ({local.info.path})")
        return _state_of(local, map_location)

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    device = transfer_device(group)

    mine = torch.tensor(
        [
            local.info.step if local else -1,
            rank,
            len(local.data) if local else 0,
            *_digest_words(local.sha256 if local else None),
        ],
        dtype=torch.int64,
        device=device,
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(int(v) for v in t.cpu().tolist()) for t in gathered]
    best_step = max(r[0] for r in rows)
    quiet = log is None or rank != 0
    if best_step < 0:
        if not quiet:
            say(log, "=> no checkpoint on any rank: starting from scratch")
        return None
    src_group_rank = min(r[1] for r in rows if r[0] == best_step)
    src_row = next(r for r in rows if r[1] == src_group_rank)
    size = src_row[2]
    if not quiet:
        say(log, f"=> using checkpoint from rank: {src_group_rank}, step: {best_step}")

    if all(r[0] == best_step for r in rows):
        assert local is not None
        return _state_of(local, map_location)

    if not quiet:
        say(log, f"=> checkpoint broadcast size is: {size} bytes")
    received = b""
    if size > 0:
        if rank == src_group_rank:
            assert local is not None
            buf = torch.frombuffer(local.data, dtype=torch.uint8).to(device)
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=device)
        src_global = (
            src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
        )
        dist.broadcast(buf, src=src_global, group=group)
        received = bytes(buf.cpu().untyped_storage())
        del buf
    if local is None or local.info.step < best_step:
        expected = _words_digest(src_row[3:7])
        if hashlib.sha256(received).hexdigest() != expected:
            raise ConfigError(
                f"checkpoint step {best_step} received from rank {src_group_rank} does not "
                f"match the SHA-256 that rank sent ({expected[:16]}...): damaged in transit"
            )
        path = save_checkpoint_bytes(received, directory, step=best_step, keep=keep)
        say(
            log,
            f"=> rank {rank}: received checkpoint step {best_step} from rank "
            f"{src_group_rank} ({size} bytes), saved to {path}",
        )
        what = f"checkpoint step {best_step} received from rank {src_group_rank}"
        return _load(received, map_location, what)
    return _state_of(local, map_location)
