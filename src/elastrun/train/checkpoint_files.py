"""The files of a checkpoint directory (see :mod:`elastrun.worker.checkpoint_files`,
where they live so that the agent, which never imports torch, writes them too)."""

from __future__ import annotations

from elastrun.worker.checkpoint_files import (
    CORRUPT_DIR,
    LATEST,
    RECORD_SUFFIX,
    CheckpointInfo,
    Record,
    RecordError,
    Verdict,
    check,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    move_aside,
    publish,
    read_record,
    record_path,
    write_checkpoint,
)

__all__ = [
    "CORRUPT_DIR",
    "LATEST",
    "RECORD_SUFFIX",
    "CheckpointInfo",
    "Record",
    "RecordError",
    "Verdict",
    "check",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "move_aside",
    "publish",
    "read_record",
    "record_path",
    "write_checkpoint",
]
