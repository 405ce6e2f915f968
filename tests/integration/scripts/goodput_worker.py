"""A worker for the goodput accounting's end-to-end test: an optimizer step
every 50 ms, each reported with its number (``heartbeat(step)``), a
checkpoint of the step every 20 steps (a file, in a ``checkpoint`` phase),
and a memory checkpoint of the model every 10 steps (never loaded: for the
agent's save metrics).
Once, at step 50, it stops for 3 s and exits 3 (``$GOODPUT_DIR/crashed``
marks it done): resumed from step 40, 10 steps are done again. It ends when
``$GOODPUT_DIR/finish`` exists; ``$GOODPUT_DIR/step`` holds its last step."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from elastrun.train import MemoryCheckpoint, heartbeat, phase

DIR = Path(os.environ["GOODPUT_DIR"])
ckpt = DIR / "ckpt.txt"
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = int(ckpt.read_text()) if ckpt.exists() else 0
mem = MemoryCheckpoint(None)
while not (DIR / "finish").exists():
    time.sleep(0.05)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    step += 1
    heartbeat(step)
    (DIR / "step").write_text(str(step))
    if step % 10 == 0:
        mem.save(model.state_dict(), step=step)
    if step % 20 == 0:
        with phase("checkpoint"):
            ckpt.write_text(str(step))
    if step == 50 and not (DIR / "crashed").exists():
        (DIR / "crashed").touch()
        time.sleep(3.0)  # the record of step 50 is written; no step after it
        os._exit(3)
