"""A restore reads what it uses: 4 real gloo ranks (no agent) with real slot
files. The ranks agree on the step from the snapshots' headers, then each
checks only the snapshot it loads or sends against its digest (counted);
damage found there is said, and the ranks agree again without it; a shared
state goes only to the ranks without it, rank to rank, in bounded chunks
(counted): a rank that holds its own copy receives nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers import needs, run_ranks

pytestmark = needs("torch")

_RANKS = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from elastrun.train.memory import MemoryCheckpoint
import elastrun.train.memory_load as memory_load
from elastrun.worker.snapshot import ENV, SlotView, open_slot, slot_names

root = sys.argv[1]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank = dist.get_rank()
memory_load.TRANSFER_CHUNK = 4096
counts = {}

def reset():
    counts.update(verified=0, received=0, chunks=0, largest=0)

verify = SlotView.verify
def counted_verify(self):
    counts["verified"] += 1
    return verify(self)
SlotView.verify = counted_verify

def received(tensor):
    counts["received"] += tensor.numel() * tensor.element_size()
    counts["chunks"] += 1
    counts["largest"] = max(counts["largest"], tensor.numel() * tensor.element_size())

recv, broadcast = dist.recv, dist.broadcast
def counted_recv(tensor, *a, **k):
    received(tensor)
    return recv(tensor, *a, **k)
def counted_broadcast(tensor, src, *a, **k):
    if src != rank:
        received(tensor)
    return broadcast(tensor, src, *a, **k)
dist.recv, dist.broadcast = counted_recv, counted_broadcast

def save(phase, steps, value):
    d = os.path.join(root, phase, f"rank{rank}")
    os.makedirs(d, mode=0o700)
    os.environ[ENV] = d
    mem = MemoryCheckpoint(log=None)
    for step in steps:
        mem.save({"w": torch.full((16384,), float(value(step))), "step": step}, step=step)
    mem.close()
    return d

def load(phase, **kw):
    dist.barrier()
    reset()
    print(f"== phase {phase}", flush=True)
    got = MemoryCheckpoint(log=print).load(**kw)
    out[phase] = {"step": got["step"], "w": float(got["w"][0]), **counts}

out = {}
save("per_rank", (1, 2, 3), lambda s: 10 * s + rank)
load("per_rank")

d = save("damaged", (1, 2, 3), lambda s: 10 * s + rank)
if rank == 1:  # a bit flipped in the data of its newest snapshot
    for name in slot_names(d):
        view = open_slot(os.path.join(d, name))
        at, step = view.start + 8, view.header.step
        view.close()
        if step == 3:
            with open(os.path.join(d, name), "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 1]))
load("damaged")

save("shared", (4, 5) if rank < 2 else (4,), lambda s: s)
load("shared", shared=True)
print("RESULT " + json.dumps({"rank": rank, "out": out}), flush=True)
dist.destroy_process_group()
"""


def test_a_restore_checks_and_moves_only_what_it_uses(tmp_path: Path) -> None:
    outs = run_ranks(_RANKS, 4, str(tmp_path))
    results = {}
    for text in outs:
        m = re.search(r"^RESULT (.*)$", text, re.M)
        assert m, text
        r = json.loads(m.group(1))
        results[r["rank"]] = r["out"]
    for rank in range(4):
        per_rank, damaged, shared = (results[rank][p] for p in ("per_rank", "damaged", "shared"))
        # three snapshots each; only the one loaded is checked; nothing moves
        assert (per_rank["step"], per_rank["w"]) == (3, 30 + rank), per_rank
        assert per_rank["verified"] == 1 and per_rank["received"] == 0, per_rank
        # rank 1's step 3 is damaged: found when chosen, and step 2 chosen instead
        assert (damaged["step"], damaged["w"]) == (2, 20 + rank), damaged
        assert damaged["verified"] == 2 and damaged["received"] == 0, damaged
        # the shared step 5: ranks 0 and 1 hold it, 2 and 3 receive it from rank 0
        assert (shared["step"], shared["w"]) == (5, 5.0), shared
        if rank < 2:
            assert shared["received"] == 0 and shared["verified"] == 1, shared
        else:
            assert shared["received"] > 16384 * 4 and shared["verified"] == 0, shared
            assert shared["chunks"] > 16 and shared["largest"] <= 4096, shared
    damage = outs[1].split("== phase ")[2]
    assert re.search(r"memory checkpoint \S+slot-\d is damaged \(its data's digest", damage), damage
    assert "using memory checkpoint: step 5 from rank 0's agent, sent to 2 rank(s)" in outs[0]
