"""Damaged checkpoints, with real torch and real files: detected, named, moved aside, skipped.

Each kind of damage (cut short, random bytes, empty, a stray higher-step
file, two flipped bytes inside tensor data, an unreadable checksum record) is
found by ``load_checkpoint``: one line names the file and why, the file (and
its record) is renamed into ``corrupt/`` byte for byte, and the previous
intact checkpoint is loaded. Checkpoints without a record (an older elastrun)
still load, said so. Saves killed at each step of the write order lose
nothing. Ranks (real gloo processes) agree on one checkpoint when some hold a
damaged copy, and an elastic job whose newest checkpoint is damaged between
restarts finishes with the right result (tests/integration/scripts/ckpt_worker.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastrun.train import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from elastrun.worker.checkpoint_files import CORRUPT_DIR, check, record_path
from tests.conftest import PYTHON
from tests.helpers import free_port, run_ranks, stop_groups
from tests.integration.elastic_harness import SCRIPTS

torch = pytest.importorskip("torch")

FILL = 1234.5  # a float32 value easy to find in the file: the bytes of w


def _state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((4096,), FILL + step), "note": f"step {step}"}


def _save_steps(d: Path, *steps: int) -> None:
    for step in steps:
        save_checkpoint(_state(step), d, step=step, keep=0)


def _logged(d: Path) -> tuple[dict[str, Any] | None, list[str]]:
    lines: list[str] = []
    state = load_checkpoint(d, log=lines.append)
    return state, lines


# -- the kinds of damage -------------------------------------------------------


def _cut_short(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _random_bytes(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def _emptied(p: Path) -> None:
    p.write_bytes(b"")


def _flip_tensor_bytes(p: Path) -> None:
    """Flip two bytes in the middle of w's data; torch still loads the file."""
    data = bytearray(p.read_bytes())
    step = int(re.search(rb"ckpt-(\d+)", p.name.encode()).group(1))  # type: ignore[union-attr]
    run = torch.full((64,), FILL + step).numpy().tobytes()
    at = data.find(run)
    assert at >= 0, "tensor data not found in the file"
    at += len(run) // 2
    data[at] ^= 0x40
    data[at + 1] ^= 0x01
    p.write_bytes(bytes(data))
    # Without the checksum this damage is silent: the file loads, with another value.
    loaded = torch.load(p, weights_only=True)
    assert not bool((loaded["w"] == FILL + step).all())


def _record_garbage(p: Path) -> None:
    record_path(p).write_text("{this is not json")


def _record_of_another_file(p: Path) -> None:
    rec = json.loads(record_path(p).read_text())
    rec["step"] -= 1
    record_path(p).write_text(json.dumps(rec))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "cut_short": (_cut_short, "bytes where its checksum record says"),
    "random_bytes": (_random_bytes, "SHA-256"),
    "empty": (_emptied, "0 bytes where its checksum record says"),
    "flipped_tensor_bytes": (_flip_tensor_bytes, "SHA-256"),
    "record_not_json": (_record_garbage, "checksum record is not valid JSON"),
    "record_of_another_step": (_record_of_another_file, "checksum record is for step 29"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_is_named_moved_aside_and_the_previous_loaded(
    tmp_path: Path, kind: str
) -> None:
    damage, why = DAMAGE[kind]
    d = tmp_path / "ckpt"
    _save_steps(d, 10, 20, 30)
    newest = d / "ckpt-000000000030.pt"
    assert (d / "latest").read_text().strip() == newest.name
    damage(newest)
    damaged_bytes = newest.read_bytes()

    state, lines = _logged(d)

    assert state is not None and state["step"] == 20
    assert bool((state["w"] == FILL + 20).all())
    damaged_lines = [ln for ln in lines if "is damaged" in ln]
    assert len(damaged_lines) == 1, lines
    assert str(newest) in damaged_lines[0] and why in damaged_lines[0], damaged_lines
    assert f"moved to {d / CORRUPT_DIR / newest.name}" in damaged_lines[0]
    # moved aside, never deleted: the same bytes, with its record
    assert not newest.exists()
    assert (d / CORRUPT_DIR / newest.name).read_bytes() == damaged_bytes
    assert (d / CORRUPT_DIR / (newest.name + ".json")).exists()
    assert [c.step for c in list_checkpoints(d)] == [10, 20]
    assert (d / "latest").read_text().strip() == "ckpt-000000000020.pt"
    # the next start finds nothing wrong
    again, lines = _logged(d)
    assert again is not None and again["step"] == 20
    assert not [ln for ln in lines if "is damaged" in ln or "no checksum record" in ln], lines


@pytest.mark.parametrize("content", ["random", "empty", "text"])
def test_stray_higher_step_file_without_record_is_moved_aside(tmp_path: Path, content: str) -> None:
    d = tmp_path / "ckpt"
    _save_steps(d, 1, 2)
    stray = d / "ckpt-000000999999.pt"
    data = {"random": os.urandom(3000), "empty": b"", "text": b"not a checkpoint\n"}[content]
    stray.write_bytes(data)
    assert latest_checkpoint(d) is not None and latest_checkpoint(d).step == 999999  # type: ignore[union-attr]

    state, lines = _logged(d)

    assert state is not None and state["step"] == 2
    (line,) = [ln for ln in lines if "is damaged" in ln]
    assert str(stray) in line and "no checksum record" in line and "do not load" in line
    assert (d / CORRUPT_DIR / stray.name).read_bytes() == data
    assert latest_checkpoint(d).step == 2  # type: ignore[union-attr]


def test_a_damaged_newest_moved_aside_by_another_rank_mid_read_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks sharing one directory: rank B reads the damaged newest, then rank
    A moves it (data, then record) aside before B looks at its record. B must
    not take the missing record for an older elastrun's checkpoint and use the
    damaged bytes unverified (seen once in CI as a rank loading step 3)."""
    from elastrun.train import checkpoint as ckpt_mod
    from elastrun.worker.checkpoint_files import move_aside

    d = tmp_path / "shared"
    _save_steps(d, 2, 3)
    _flip_tensor_bytes(d / "ckpt-000000000003.pt")
    real_read = ckpt_mod._read

    def read_then_other_rank_moves_it(path: Path) -> bytearray:
        data = real_read(path)
        if path.name == "ckpt-000000000003.pt":
            (info,) = [i for i in list_checkpoints(d) if i.step == 3]
            move_aside(info)  # what the other rank does on finding it damaged
        return data

    monkeypatch.setattr(ckpt_mod, "_read", read_then_other_rank_moves_it)
    state, lines = _logged(d)
    assert state is not None and state["step"] == 2, lines
    assert not [ln for ln in lines if "unverified" in ln], lines
    assert (d / CORRUPT_DIR / "ckpt-000000000003.pt").exists()


def test_several_damaged_in_a_row_and_a_second_damage_of_the_same_step(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _save_steps(d, 1, 2, 3, 4)
    _cut_short(d / "ckpt-000000000004.pt")
    _flip_tensor_bytes(d / "ckpt-000000000003.pt")
    state, lines = _logged(d)
    assert state is not None and state["step"] == 2
    assert len([ln for ln in lines if "is damaged" in ln]) == 2
    # step 3 saved again and damaged again: the second copy is kept beside the first
    save_checkpoint(_state(3), d, step=3, keep=0)
    _random_bytes(d / "ckpt-000000000003.pt")
    state, lines = _logged(d)
    assert state is not None and state["step"] == 2
    assert sorted(os.listdir(d / CORRUPT_DIR)) == [
        "ckpt-000000000003.pt",
        "ckpt-000000000003.pt.1",
        "ckpt-000000000003.pt.1.json",
        "ckpt-000000000003.pt.json",
        "ckpt-000000000004.pt",
        "ckpt-000000000004.pt.json",
    ]


def test_every_checkpoint_damaged_starts_from_scratch_saying_so(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _save_steps(d, 1, 2)
    _emptied(d / "ckpt-000000000001.pt")
    _cut_short(d / "ckpt-000000000002.pt")
    state, lines = _logged(d)
    assert state is None
    assert len([ln for ln in lines if "is damaged" in ln]) == 2
    assert list_checkpoints(d) == []


def test_checkpoint_of_an_older_version_without_record_still_loads(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    # as the previous version wrote them: torch.save bytes, no record
    for step in (5, 6):
        torch.save(_state(step), d / f"ckpt-{step:012d}.pt")
    (d / "latest").write_text("ckpt-000000000006.pt\n")

    state, lines = _logged(d)

    assert state is not None and state["step"] == 6
    (line,) = [ln for ln in lines if "no checksum record" in ln]
    assert "ckpt-000000000006.pt" in line and "unverified" in line
    assert not (d / CORRUPT_DIR).exists()
    # a record removed from a new checkpoint reads the same way
    save_checkpoint(_state(7), d, step=7, keep=0)
    record_path(d / "ckpt-000000000007.pt").unlink()
    state, lines = _logged(d)
    assert state is not None and state["step"] == 7
    assert any("no checksum record" in ln and "unverified" in ln for ln in lines)


def test_intact_checkpoint_that_cannot_be_loaded_is_an_error_not_damage(tmp_path: Path) -> None:
    from elastrun.errors import ConfigError
    from elastrun.train.checkpoint import save_checkpoint_bytes

    d = tmp_path / "ckpt"
    _save_steps(d, 1)
    save_checkpoint_bytes(b"bytes that were saved as they are", d, step=2)
    with pytest.raises(ConfigError, match=r"ckpt-000000000002\.pt is intact .* cannot be loaded"):
        load_checkpoint(d, log=None)
    assert (d / "ckpt-000000000002.pt").exists()  # not moved: the bytes are what was saved


# -- kills at each step of a save ---------------------------------------------

_KILLED_SAVERS = """
import json, os, signal, sys, traceback
import torch
from elastrun.train import save_checkpoint
root, ats = sys.argv[1], sys.argv[2:]

def killed_save(d, at):
    save_checkpoint({"step": 1, "w": torch.ones(1000)}, d, step=1)
    real_replace = os.replace
    def replace(src, dst):
        name = os.path.basename(dst)
        if (at == "record" and name.endswith(".pt.json")) \\
                or (at == "data" and name.endswith(".pt")) \\
                or (at == "latest" and name == "latest"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    os.replace = replace
    save_checkpoint({"step": 2, "w": torch.ones(1000) * 2}, d, step=2)
    print("not killed", flush=True)

status = {}
for at in ats:  # each save in a process of its own, forked: torch imported once for all
    pid = os.fork()
    if pid == 0:
        try:
            killed_save(os.path.join(root, at, "ckpt"), at)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    status[at] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print("STATUS " + json.dumps(status), flush=True)
"""
RENAMES = [("record", 1), ("data", 1), ("latest", 2)]


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int], str]:
    """A save SIGKILLed at each rename (one folder each, under the path
    returned), each one's exit status as ``subprocess`` gives it, and their output."""
    root = tmp_path_factory.mktemp("killed-saves")
    proc = subprocess.run(
        [PYTHON, "-c", _KILLED_SAVERS, str(root), *(at for at, _ in RENAMES)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATUS ")]
    return root, json.loads(line[len("STATUS ") :]), proc.stdout + proc.stderr


@pytest.mark.parametrize(("at", "expect"), RENAMES)
def test_sigkill_at_each_rename_of_a_save_loses_nothing(
    killed_saves: tuple[Path, dict[str, int], str], at: str, expect: int
) -> None:
    root, status, output = killed_saves
    d = root / at / "ckpt"
    assert status[at] == -signal.SIGKILL, output

    state, lines = _logged(d)

    assert state is not None and state["step"] == expect
    assert not [ln for ln in lines if "is damaged" in ln or "no checksum record" in ln], lines
    assert not (d / CORRUPT_DIR).exists()
    for info in list_checkpoints(d):
        assert check(info, info.path.read_bytes()).status == "verified"
    # later saves clean up what the killed save left (temp files, a record without data)
    save_checkpoint({"step": 3}, d, step=3, keep=1)
    save_checkpoint({"step": 4}, d, step=4, keep=1)
    assert sorted(os.listdir(d)) == ["ckpt-000000000004.pt", "ckpt-000000000004.pt.json", "latest"]


# -- agreement over gloo, real processes ---------------------------------------

_AGREE = """
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from elastrun.train import load_checkpoint
root = sys.argv[1]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank = dist.get_rank()
out = []
for phase in ("mixed", "all_newest_damaged", "shared"):
    print(f"== phase {phase}", flush=True)
    d = os.path.join(root, phase, "shared" if phase == "shared" else f"rank{rank}")
    state = load_checkpoint(d)
    out.append(None if state is None else {"step": state["step"], "w0": float(state["w"][0])})
    dist.barrier()
print("RESULT " + json.dumps({"rank": rank, "out": out}), flush=True)
dist.destroy_process_group()
"""


def test_ranks_agree_when_some_hold_a_damaged_newest(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    _save_steps(mixed / "rank0", 5, 7)
    _flip_tensor_bytes(mixed / "rank0" / "ckpt-000000000007.pt")  # rank 0: its 7 is damaged
    _save_steps(mixed / "rank1", 5, 7)  # rank 1: an intact 7
    _save_steps(mixed / "rank2", 5)
    (mixed / "rank2" / "ckpt-000000000009.pt").write_bytes(os.urandom(2000))  # stray, higher
    intact7 = (mixed / "rank1" / "ckpt-000000000007.pt").read_bytes()
    newest_bad = tmp_path / "all_newest_damaged"
    for rank, damage in enumerate((_cut_short, _random_bytes, _emptied)):
        _save_steps(newest_bad / f"rank{rank}", 4, 5)
        damage(newest_bad / f"rank{rank}" / "ckpt-000000000005.pt")
    shared = tmp_path / "shared" / "shared"
    _save_steps(shared, 2, 3)
    _flip_tensor_bytes(shared / "ckpt-000000000003.pt")

    outs = run_ranks(_AGREE, 3, str(tmp_path))

    results = {}
    for out in outs:
        m = re.search(r"^RESULT (.*)$", out, re.M)
        assert m, out
        r = json.loads(m.group(1))
        results[r["rank"]] = r["out"]
    for rank in range(3):
        assert results[rank] == [
            {"step": 7, "w0": FILL + 7},
            {"step": 4, "w0": FILL + 4},
            {"step": 2, "w0": FILL + 2},
        ], (rank, outs[rank])
    phases = [o.split("== phase ") for o in outs]
    # mixed: rank 0 and rank 2 moved theirs aside, and got rank 1's 7, byte for byte
    assert "ckpt-000000000007.pt is damaged (SHA-256" in phases[0][1]
    assert "ckpt-000000000009.pt is damaged (no checksum record" in phases[2][1]
    assert "=> using checkpoint from rank: 1, step: 7" in phases[0][1]
    for rank in (0, 2):
        copy = mixed / f"rank{rank}" / "ckpt-000000000007.pt"
        assert copy.read_bytes() == intact7
        assert check(list_checkpoints(copy.parent)[-1], intact7).status == "verified"
    assert (mixed / "rank0" / CORRUPT_DIR / "ckpt-000000000007.pt").exists()
    assert (mixed / "rank2" / CORRUPT_DIR / "ckpt-000000000009.pt").exists()
    # every newest damaged: each falls back to its own 4, nothing is sent
    for rank in range(3):
        assert "ckpt-000000000005.pt is damaged" in phases[rank][2]
    assert "=> using checkpoint from rank: 0, step: 4" in phases[0][2]
    assert "broadcast" not in phases[0][2]
    # one directory shared by every rank: one of them moves it aside, all use step 2
    assert sorted(os.listdir(shared / CORRUPT_DIR)) == [
        "ckpt-000000000003.pt",
        "ckpt-000000000003.pt.json",
    ]
    assert sum("ckpt-000000000003.pt is damaged" in p[3] for p in phases) >= 1


# -- end to end: the real agent, a damaged newest checkpoint between restarts -----

STEPS, DAMAGE_AT = 12, 6


def _expected_w(world: int) -> float:
    """What ckpt_worker.py computes when every step runs exactly once."""
    w = 0.0
    for step in range(1, STEPS + 1):
        w = w * 0.5 + world * (world + 1) / 2 + step
    return w


def _agent(
    tmp_path: Path, name: str, flags: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"agent-{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [PYTHON, "-m", "elastrun", *flags, str(SCRIPTS / "ckpt_worker.py")],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "CKPT_STEPS": str(STEPS), **env},
            start_new_session=True,
        )
    return proc, log


def _finish(agents: list[tuple[subprocess.Popen[bytes], Path]], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    try:
        for proc, log in agents:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"agent still running after {timeout}s:\n{log.read_text()[-3000:]}")
    finally:
        stop_groups(*(proc for proc, _ in agents), timeout=30)
    return [log.read_text(errors="replace") for _, log in agents]


def _result(out: str) -> dict[str, object]:
    m = re.search(r"RESULT (\{.*\})", out)
    assert m, out[-3000:]
    return dict(json.loads(m.group(1)))


@pytest.mark.slow
def test_job_whose_newest_checkpoint_is_damaged_between_restarts_finishes_right(
    tmp_path: Path,
) -> None:
    """Two agents, each with its own checkpoint folder. Before the first
    attempt's crash, node a's newest checkpoint gets two bytes flipped; on
    restart a moves it aside, gets node b's intact copy by broadcast, and the
    job ends with exactly the result of an undisturbed run."""
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=ckpt-damage",
        "--max-restarts=1",
        "--shutdown-timeout=5",
    ]
    a_dir, b_dir = tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt"
    agents = [
        _agent(
            tmp_path,
            "a",
            [*common, "--rdzv-conf=is_host=1,last_call_timeout=1"],
            {"CKPT_DIR": str(a_dir), "CKPT_DAMAGE_AT": str(DAMAGE_AT), "CKPT_DAMAGE": "flip"},
        ),
        _agent(
            tmp_path,
            "b",
            [*common, "--rdzv-conf=is_host=0,last_call_timeout=1"],
            {
                "CKPT_DIR": str(b_dir),
                "CKPT_DAMAGE_AT": str(DAMAGE_AT),
                "CKPT_CRASH_AT": str(DAMAGE_AT),
            },
        ),
    ]
    outs = _finish(agents, 240)
    for (proc, _), out in zip(agents, outs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    a_out = outs[0]
    damaged = f"{a_dir / 'ckpt-000000000006.pt'} is damaged (SHA-256"
    assert damaged in a_out, a_out[-3000:]
    assert f"received checkpoint step {DAMAGE_AT} from rank 1" in a_out
    result = _result(outs[0] + outs[1])
    assert result["resumed_from"] == DAMAGE_AT and result["restarts"] == 1
    assert result["step"] == STEPS and result["world"] == 2
    assert result["w"] == _expected_w(2)
    assert (a_dir / CORRUPT_DIR / "ckpt-000000000006.pt").exists()


@pytest.mark.slow
def test_single_node_job_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    """One agent, two workers sharing one folder: the newest checkpoint is cut
    short before the crash; the restart moves it aside, replays from the one
    before, and the result is exact."""
    d = tmp_path / "ckpt"
    agent = _agent(
        tmp_path,
        "a",
        ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--shutdown-timeout=5"],
        {
            "CKPT_DIR": str(d),
            "CKPT_DAMAGE_AT": str(DAMAGE_AT),
            "CKPT_DAMAGE": "truncate",
            "CKPT_CRASH_AT": str(DAMAGE_AT),
        },
    )
    (out,) = _finish([agent], 180)
    assert agent[0].returncode == 0, out[-3000:]
    assert f"{d / 'ckpt-000000000006.pt'} is damaged (" in out, out[-3000:]
    result = _result(out)
    assert result["resumed_from"] == DAMAGE_AT - 1 and result["restarts"] == 1
    assert result["step"] == STEPS
    assert result["w"] == _expected_w(2)
