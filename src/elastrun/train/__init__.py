"""Helpers for training scripts run by elastrun (or torchrun).

- :func:`context` / :class:`WorkerContext`: this worker's rank, world size,
  restart count, ... from the launcher's environment.
- :func:`heartbeat`: report progress to the hang watchdog (no-op without it);
  :func:`phase`: mark a long phase of the script (progress is otherwise
  recorded automatically in workers elastrun starts).
- :class:`ElasticSampler`: shards each epoch by the current world size and
  resumes mid-epoch by global sample offset.
- :func:`save_checkpoint` / :func:`load_checkpoint`: atomic, checksummed
  checkpoints; at start, damaged ones are moved aside, ranks agree on the
  newest intact one and the holder broadcasts it.
- :func:`in_process`: a training function elastrun may restart in this
  process after a group failure, keeping what the process built outside it
  (docs/in_process.md).
- :class:`MemoryCheckpoint`: a checkpoint every step, copied into shared
  memory that elastrun's agent holds across worker restarts and writes to
  disk in the background.

Importing this package does not import torch (the checkpoint functions import
it when called), so ``import elastrun.train`` is cheap.
"""

from __future__ import annotations

from elastrun.train.checkpoint import (
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from elastrun.train.context import WorkerContext, context
from elastrun.train.heartbeat import heartbeat, phase
from elastrun.train.in_process import current_round, in_process
from elastrun.train.memory import MemoryCheckpoint
from elastrun.train.sampler import ElasticSampler, global_order

__all__ = [
    "CheckpointInfo",
    "ElasticSampler",
    "MemoryCheckpoint",
    "WorkerContext",
    "context",
    "current_round",
    "global_order",
    "heartbeat",
    "in_process",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "phase",
    "save_checkpoint",
]
