"""Sharded states (DTensors: FSDP2 on CPU, Shard and Replicate placements) in
memory checkpoints, with real gloo ranks (tests/integration/scripts/sharded_ranks.py).

Two ranks save; the agent's disk writer (``persist_snapshot``, run here on
their marked slots as the agent runs it) writes their disk copies; two fresh
ranks get their shards back as DTensors from memory and from the disk; the
disk copies load with a plain ``torch.load(weights_only=True)``;
``elastrun checkpoint-convert`` puts them together (``torch.save`` and
``torch.distributed.checkpoint``); one rank (the world changed) is told why
memory and disk cannot serve, and loads the converted checkpoint with
``dcp.load``, resharded. The three phases' ranks are forked from one process
(``Ranks``), which imports torch once for all of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.memory import persist_snapshot
from elastrun.cli import main as elastrun_main
from elastrun.worker.snapshot import CommitNote, open_slot
from tests.helpers import finished, free_port, kill_group, wait_for
from tests.integration.elastic_harness import SCRIPTS

torch = pytest.importorskip("torch")

BOUND = 300.0


class Ranks:
    """One ``sharded_ranks.py`` process for every phase of a test: it imports
    torch once and forks each phase's ranks."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.log = base / "ranks.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPTS / "sharded_ranks.py"), str(base)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )

    def __call__(self, phase: str, world: int) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{phase} {world} {free_port()}\n")
        self.proc.stdin.flush()
        done = self.base / f"{phase}.done"

        def said() -> str | None:
            if done.exists():
                return done.read_text()
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return None

        assert wait_for(said, BOUND, f"the {phase} ranks", 0.2) == "ok", (
            done.read_text() + self.log.read_text()[-3000:]
        )
        return [json.loads((self.base / f"{phase}-{r}.json").read_text()) for r in range(world)]

    def close(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait(BOUND)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    r = Ranks(tmp_path)
    try:
        yield r
    finally:
        r.close()


def persist(base: Path, world: int) -> list[Path]:
    """What each rank's agent does with its marked snapshot."""
    out = []
    for r in range(world):
        folder = base / "mem" / f"r{r}"
        note = CommitNote.read(str(folder))
        assert note is not None and note.marked is not None
        view = open_slot(str(folder / f"slot-{note.marked.slot}"))
        assert view is not None
        with view:
            out.append(Path(persist_snapshot(view).path))
    return out


def test_sharded_state_saved_restored_converted_and_resharded(
    tmp_path: Path, ranks: Ranks, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = ranks("save", 2)
    files = persist(tmp_path, 2)

    # Each disk copy is a plain torch.save file: the rank's local shards.
    for r, path in enumerate(files):
        plain = torch.load(path, weights_only=True)
        assert plain["step"] == 7
        shapes = {k: list(v.shape) for k, v in plain["model"].items()}
        assert shapes == saved[r]["local"]
        assert shapes["0.weight"] == [3 - r, 6]  # 5 rows over 2 ranks: 3 and 2

    # Same world: every rank gets its shards back as DTensors, from memory and disk.
    restored = ranks("restore", 2)
    for seen in restored:
        for source in ("memory", "disk"):
            kinds = seen[f"{source}_kinds"]
            assert set(kinds.values()) >= {"DTensor", "DTensor[Shard(dim=0)]"}, kinds
            assert kinds["extra/bias"] == "DTensor[Replicate()]"
            assert kinds["extra/cols"] == "DTensor[Shard(dim=1)]"
            assert seen[f"{source}_differs"] == [], (source, seen)
    assert "=> using memory checkpoint: step 7" in "\n".join(restored[0]["lines"])

    # The ranks' disk copies put together: one torch.save file, and a DCP folder.
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert (
        elastrun_main(
            ["checkpoint-convert", "--format=torch", str(tmp_path / "full.pt")]
            + [str(f) for f in reversed(files)]
        )
        == 0
    )
    whole = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(whole["model"]["0.weight"], ref["/model/0.weight"])
    assert torch.equal(whole["extra"]["rows"], ref["/extra/rows"])
    assert torch.equal(whole["opt"]["state"][0]["exp_avg"], ref["/opt/state/0/exp_avg"])
    assert elastrun_main(["checkpoint-convert", str(tmp_path / "dcp"), *map(str, files)]) == 0
    assert "the shards of 2 rank(s) of a world of 2" in capsys.readouterr().out

    # One rank's file is not enough: the missing rank is named.
    assert elastrun_main(["checkpoint-convert", str(tmp_path / "x"), str(files[0])]) == 1
    assert "the files of rank(s) [1] are missing" in capsys.readouterr().err

    # Another world: memory says why it is not used, the disk refuses with the
    # way out, and the converted checkpoint loads resharded.
    (seen,) = ranks("reshard", 1)
    said = "\n".join(seen["lines"])
    assert (
        "=> memory checkpoint step 7 not used: its sharded tensors (state['model']['0.weight'], "
        "...) are shards of a world of 2 ranks, and the world is now 1; sharded states are not "
        "resharded in memory (the disk checkpoints serve, if any)" in said
    ), said
    assert "=> using memory checkpoint" not in said
    assert "elastrun checkpoint-convert" in seen["disk_error"], seen
    assert seen["dcp_differs"] == [], seen


def test_a_killed_rank_of_four_gets_its_shards_back_with_no_step_redone(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=1",
        str(SCRIPTS / "sharded_worker.py"),
    ]
    env = {"MEM_STEPS": "6", "MEM_CRASH_AT": "4", "MEM_PROGRESS": str(progress)}
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        start_new_session=True,
    )
    text = finished(proc, BOUND)
    assert "SIGKILLs itself after step 4" in text
    lines = [ln for ln in text.splitlines() if re.match(r"^\[[^\]]+:\d+\]: LOADED ", ln)]
    loaded = [json.loads(ln.split("LOADED ", 1)[1]) for ln in lines]
    restarted = sorted((d["rank"], d["step"]) for d in loaded if d["step"] > 0)
    assert restarted == [(0, 4), (1, 4), (2, 4), (3, 4)], text[-3000:]  # no step redone
    saved: dict[tuple[int, int], float] = {}
    for line in progress.read_text().splitlines():
        d = json.loads(line)
        saved.setdefault((d["rank"], d["step"]), d["fp"])  # the first attempt's
    for d in loaded:
        if d["step"]:
            assert d["kinds"] == ["DTensor"], d
            assert d["fp"] == saved[(d["rank"], 4)], d  # the very shards it saved
    assert "=> using memory checkpoint: step 4" in text
