"""Memory checkpoints for PyTorch Lightning: a ``CheckpointIO`` plugin.

::

    from elastrun.integrations.lightning import MemoryCheckpointIO

    io = MemoryCheckpointIO("checkpoints", persist_every=50)
    trainer = pl.Trainer(
        ...,
        plugins=[io],
        callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=1)],
    )
    trainer.fit(model, ckpt_path=io.resume_path())

Every checkpoint Lightning saves (on global rank 0, as Lightning does) is
copied into memory held by the node's elastrun agent
(:class:`~elastrun.train.MemoryCheckpoint`): saving every step costs a memory
copy, not a file write. The agent writes every ``persist_every``-th global
step to ``directory`` in the background (``ckpt-<step>.pt`` files, which
:func:`~elastrun.train.load_checkpoint` and this plugin read). Lightning's own
file names (``path``) are not written: ``ModelCheckpoint`` only decides when
to save.

On restart, :meth:`MemoryCheckpointIO.resume_path` says whether there is
something to resume from: a snapshot held by this node's agent (any local
rank's) or a checkpoint in ``directory``. Lightning then calls
:meth:`load_checkpoint` on every rank, which agrees on one step with the
other ranks and returns it (rank 0's copy, sent to the others: no disk read
after a worker crash), falling back to ``directory``, then to the file at
``path`` if it exists. ``resume_path`` looks only at this node: in a job of
several nodes, give the nodes a shared ``directory`` (or the same answer
otherwise), since the ranks must all resume or all start afresh.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from elastrun.train.memory import MemoryCheckpoint
from elastrun.worker.checkpoint_files import list_checkpoints
from elastrun.worker.snapshot import ENV, SnapshotError, open_slot, slot_names

__all__ = ["RESUME", "MemoryCheckpointIO"]

RESUME = "elastrun-memory-checkpoint"  # the ckpt_path that resume_path() gives


class MemoryCheckpointIO(CheckpointIO):
    """Lightning's checkpoints into memory held by elastrun's agent (see the
    module doc). ``directory``: where the agent writes every
    ``persist_every``-th step (None: memory only); ``keep``: checkpoints kept
    there."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        keep: int = 3,
        persist_every: int = 0,
    ) -> None:
        self.memory = MemoryCheckpoint(directory, keep=keep, persist_every=persist_every)
        self._files = TorchCheckpointIO()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        del path, storage_options
        self.memory.save(checkpoint, step=int(checkpoint.get("global_step", 0)))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        state = self.memory.load(shared=True, map_location=map_location or "cpu")
        if state is not None:
            return state
        if str(path) != RESUME and os.path.exists(path):
            return self._files.load_checkpoint(path, map_location, weights_only)
        raise FileNotFoundError(f"no memory checkpoint, and no checkpoint at {path}")

    def remove_checkpoint(self, path: Any) -> None:
        if os.path.exists(path):  # a file of an earlier run without this plugin
            self._files.remove_checkpoint(path)

    def teardown(self) -> None:
        self.memory.close()

    def resume_path(self) -> str | None:
        """``RESUME`` when this node holds a memory checkpoint (any local
        rank's) or ``directory`` holds a checkpoint; None otherwise."""
        folder = os.environ.get(ENV)
        if folder:
            node = os.path.dirname(folder)
            for rank_dir in sorted(os.listdir(node)) if os.path.isdir(node) else []:
                if _holds_snapshot(os.path.join(node, rank_dir)):
                    return RESUME
        directory = self.memory.directory
        if directory is not None and list_checkpoints(directory):
            return RESUME
        return None


def _holds_snapshot(folder: str) -> bool:
    for name in slot_names(folder):
        try:
            view = open_slot(os.path.join(folder, name))
        except (OSError, SnapshotError):
            continue
        if view is not None:
            view.close()
            return True
    return False
