"""``elastrun status``'s STEP column says which step it shows: the training step
a script reports (``elastrun.train.heartbeat(step)``) as it is; the optimizer
steps of a process whose script reports none marked ``*`` and explained (two
lockstep ranks started apart, or a rank resumed from a checkpoint, differ
there), as the agent's progress note says it (``reported``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from elastrun.agent.stragglers import RankFile, local_progress
from elastrun.rendezvous import notes as N
from tests.unit.test_in_process_visibility import table


def rows(text: str) -> dict[str, list[str]]:
    return {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit()}


def test_a_reported_step_is_shown_as_the_training_step() -> None:
    text, out = table([{"rank": 0, "step": 40, "reported": True}])
    assert rows(text)["0"][2] == "40"
    assert "STEP: the training step the script reports" in text and "*" not in text
    assert out["ranks"][0]["reported"] is True


def test_optimizer_steps_of_a_script_that_reports_none_are_marked() -> None:
    text, out = table(
        [{"rank": 0, "step": 92, "reported": False}, {"rank": 1, "step": 59, "reported": False}]
    )
    assert [rows(text)[r][2] for r in ("0", "1")] == ["92*", "59*"]
    assert "a STEP ending in * is no training step" in text
    assert "optimizer steps this worker process took since it started" in text
    assert [r["reported"] for r in out["ranks"]] == [False, False]


def test_an_older_agent_s_note_without_the_flag_is_shown_unmarked() -> None:
    text, out = table([{"rank": 0, "step": 7}])
    assert rows(text)["0"][2] == "7" and "*" not in text
    assert out["ranks"][0]["reported"] is None


def test_the_agent_s_note_says_whether_the_step_is_the_script_s(tmp_path: Path) -> None:
    files = []
    for r, reported in ((0, True), (1, False)):
        path = tmp_path / f"beat{r}"
        record = {"v": 1, "monotonic": time.monotonic(), "step": 5, "reported": reported}
        path.write_text(json.dumps(record))
        files.append(RankFile(r, str(path), 1000 + r, False))
    ranks = local_progress(files)
    assert [(p.rank, p.reported) for p in ranks] == [(0, True), (1, False)]
    assert [N.RankProgress.from_json(p.to_json()) for p in ranks] == ranks
