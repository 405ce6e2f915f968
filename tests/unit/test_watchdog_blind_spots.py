"""The hang watchdog's rules when progress cannot be seen (virtual time, real files).

A rank is declared hung only on evidence that it stopped: a progress record
the agent read, or progress relayed over its runner's channel. A stale
record in a folder that cannot take a write, a record its worker removed, a
file that cannot be read, or a channel that closed: the rank is not judged,
and the watchdog says why (``on_unknown``). A truly stuck rank with a
readable record is still declared hung (the control).
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.watchdog import (
    Beat,
    Hang,
    HangWatchdog,
    folder_problem,
    read_beat,
    read_progress,
)
from elastrun.clock import VirtualTimeLoop, run_virtual
from elastrun.train.heartbeat import HEARTBEAT_ENV
from elastrun.worker import _runner
from elastrun.worker._progress import Progress

TIMEOUT = 10.0
# The module (elastrun.train's heartbeat is the function).
hb_api: Any = importlib.import_module("elastrun.train.heartbeat")


class Seen:
    def __init__(self) -> None:
        self.hangs: list[Hang] = []
        self.unknown: list[tuple[int, str]] = []


def write_beat(path: Path, monotonic: float, step: int) -> None:
    path.write_text(json.dumps({"v": 1, "monotonic": monotonic, "step": step}))


async def healthy(path: Path, seconds: int) -> None:
    """A worker writing a record every second (the watchdog reads some)."""
    loop = asyncio.get_running_loop()
    for step in range(seconds):
        write_beat(path, loop.time(), step)
        await asyncio.sleep(1)


def start(path: Path, seen: Seen, channel: bool = False) -> HangWatchdog:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    dog = HangWatchdog(
        TIMEOUT,
        seen.hangs.append,
        loop.clock,
        on_unknown=lambda key, why: seen.unknown.append((key, why)),
    )
    dog.watch(0, str(path), channel=channel)
    return dog


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[Path]:
    """A folder nothing can be created in, even by root (chattr +i)."""
    folder = tmp_path / "imm"
    folder.mkdir()
    chattr = shutil.which("chattr")
    if chattr is None or os.geteuid() != 0:
        pytest.skip("needs root and chattr(1) to make a folder immutable")
    res = subprocess.run([chattr, "+i", str(folder)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"this file system takes no immutable flag: {res.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=False)


def test_a_stuck_rank_with_a_readable_record_is_declared_hung(tmp_path: Path) -> None:
    hb, seen = tmp_path / "hb.json", Seen()

    async def main() -> None:
        dog = start(hb, seen)
        write_beat(hb, asyncio.get_running_loop().time(), 4)
        await asyncio.sleep(3 * TIMEOUT)
        dog.close()

    run_virtual(main())
    assert len(seen.hangs) == 1 and seen.hangs[0].last_step == 4 and not seen.unknown


def test_a_hang_is_declared_exactly_the_timeout_after_the_last_progress(tmp_path: Path) -> None:
    """The timer (what tests/integration/test_watchdog.py checks end to end
    without a clock): never before the timeout, and not later either."""
    hb, seen = tmp_path / "hb.json", Seen()
    declared: list[float] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        t0 = loop.time()

        def on_hang(hang: Hang) -> None:
            seen.hangs.append(hang)
            declared.append(loop.time())

        dog = HangWatchdog(TIMEOUT, on_hang, loop.clock)
        dog.watch(0, str(hb))
        await healthy(hb, 5)  # a record every second, the last one at t0 + 4
        await asyncio.sleep(3 * TIMEOUT)
        dog.close()
        return t0

    t0 = run_virtual(main())
    assert declared == [t0 + 4 + TIMEOUT]
    (hang,) = seen.hangs
    assert (hang.last_step, hang.idle, hang.timeout) == (4, TIMEOUT, TIMEOUT)


def test_a_kept_process_s_record_of_an_earlier_round_is_no_progress(tmp_path: Path) -> None:
    """A kept process's runner may write its last round's record after the
    agent removed it for the new round (its writer thread wakes late): the
    rank is judged from its first progress of this round, never from that."""
    hb, seen = tmp_path / "hb.json", Seen()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        await asyncio.sleep(60)  # the round before
        since = loop.time()  # the round's start for this rank
        dog = HangWatchdog(TIMEOUT, seen.hangs.append, loop.clock)
        dog.watch(0, str(hb), since=since)
        write_beat(hb, since - 0.5, 7)  # its last step of the round before
        await asyncio.sleep(3 * TIMEOUT)  # re-entering its function takes long
        assert not seen.hangs
        first = loop.time()
        write_beat(hb, first, 8)  # its first step of this round, then it hangs
        await asyncio.sleep(2 * TIMEOUT)
        dog.close()
        return first

    first = run_virtual(main())
    assert [(h.last_step, h.idle) for h in seen.hangs] == [(8, TIMEOUT)], first


def test_the_script_s_end_is_an_exit_phase_judged_from_its_start(tmp_path: Path) -> None:
    """A rank whose script returned or raised tears down (torch.distributed's
    shutdown, atexit handlers): judged from the end of the script, not from
    its last step, and named as in its exit when it hangs there."""
    hb, seen = tmp_path / "hb.json", Seen()
    declared: list[float] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        t0 = loop.time()

        def on_hang(hang: Hang) -> None:
            seen.hangs.append(hang)
            declared.append(loop.time())

        dog = HangWatchdog(TIMEOUT, on_hang, loop.clock)
        dog.watch(0, str(hb))
        progress = Progress(str(hb), 0.5, loop.time)
        for step in range(5):  # the last step at t0 + 4
            progress.event(step)
            progress.write()
            await asyncio.sleep(1)
        await asyncio.sleep(TIMEOUT - 2)  # t0 + 13: the script ends, its step is not written
        progress.exiting()
        await asyncio.sleep(3 * TIMEOUT)
        dog.close()
        return t0

    t0 = run_virtual(main())
    assert declared == [t0 + 13 + TIMEOUT]
    (hang,) = seen.hangs
    assert hang.phase == "exit" and hang.last_step == 4


def test_relayed_progress_keeps_a_rank_whose_file_is_gone_alive(tmp_path: Path) -> None:
    hb, seen = tmp_path / "hb.json", Seen()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dog = start(hb, seen, channel=True)
        write_beat(hb, loop.time(), 1)
        await asyncio.sleep(2)
        hb.unlink()  # the worker cannot write it: removed, progress comes over the channel
        for step in range(2, 40):
            await asyncio.sleep(1)
            dog.relayed(0, Beat(step=step, monotonic=loop.time()))
        assert not seen.hangs and not seen.unknown
        # The relay stops (the rank is stuck): judged by what was relayed.
        await asyncio.sleep(2 * TIMEOUT)
        dog.close()

    run_virtual(main())
    assert [h.last_step for h in seen.hangs] == [39] and not seen.unknown


def test_a_record_its_worker_removed_is_progress_unknown_not_a_hang(tmp_path: Path) -> None:
    hb, seen = tmp_path / "hb.json", Seen()

    async def main() -> None:
        dog = start(hb, seen)  # no channel: a --no-python worker calling heartbeat()
        await healthy(hb, 15)
        hb.unlink()
        await asyncio.sleep(5 * TIMEOUT)
        dog.close()

    run_virtual(main())
    assert not seen.hangs
    assert seen.unknown and all(key == 0 for key, _ in seen.unknown)
    assert "is gone (its worker could not write it)" in seen.unknown[0][1]


def test_relayed_progress_then_a_closed_channel_is_progress_unknown(tmp_path: Path) -> None:
    hb, seen = tmp_path / "hb.json", Seen()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dog = start(hb, seen, channel=True)
        dog.relayed(0, Beat(step=1, monotonic=loop.time()))
        dog.channel_closed(0)
        await asyncio.sleep(3 * TIMEOUT)
        dog.close()

    run_virtual(main())
    assert not seen.hangs
    assert "cannot be written and its channel to the agent is closed" in seen.unknown[0][1]


def test_a_file_written_again_is_judged_after_its_channel_closed(tmp_path: Path) -> None:
    """The runner relayed while its file failed, then wrote it again, then its
    channel closed: the file is a source again, and a stop in it is a hang."""
    hb, seen = tmp_path / "hb.json", Seen()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dog = start(hb, seen, channel=True)
        dog.relayed(0, Beat(step=1, monotonic=loop.time()))
        await asyncio.sleep(1)
        await healthy(hb, 15)  # the file is written again (the disk has room)
        dog.channel_closed(0)
        await asyncio.sleep(3 * TIMEOUT)
        dog.close()

    run_virtual(main())
    assert len(seen.hangs) == 1 and not seen.unknown


def test_a_stale_record_in_an_immutable_folder_is_progress_unknown(
    immutable: Path, tmp_path: Path
) -> None:
    """The record could not be removed either: the folder says the worker cannot write."""
    seen = Seen()
    hb = immutable / "hb.json"
    subprocess.run(["chattr", "-i", str(immutable)], check=True)
    write_beat(hb, 0.0, 7)
    subprocess.run(["chattr", "+i", str(immutable)], check=True)
    assert folder_problem(str(immutable)) == f"{immutable} is not writable"

    async def main() -> None:
        dog = start(hb, seen)
        await asyncio.sleep(3 * TIMEOUT)
        dog.close()

    run_virtual(main())
    assert not seen.hangs
    assert f"{immutable} is not writable" in seen.unknown[0][1]


def test_a_fifo_at_the_record_never_blocks_and_is_progress_unknown(tmp_path: Path) -> None:
    hb, seen = tmp_path / "hb.json", Seen()
    done = threading.Event()

    def run() -> None:
        async def main() -> None:
            dog = start(hb, seen)
            await healthy(hb, 15)
            hb.unlink()
            os.mkfifo(hb)  # planted: a plain open() would wait for a writer forever
            await asyncio.sleep(3 * TIMEOUT)
            dog.close()

        run_virtual(main())
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert done.is_set(), "the watchdog blocked on a FIFO"
    assert not seen.hangs
    assert "cannot be read: is a FIFO, not a regular file" in seen.unknown[0][1]


def test_hostile_records_are_no_record(tmp_path: Path) -> None:
    f = tmp_path / "hb.json"
    f.write_text("[" * 4000)  # json.loads would raise RecursionError
    assert read_progress(str(f)).beat is None and read_progress(str(f)).error is None
    f.write_text('{"monotonic": 5}' + " " * 5000)  # larger than a record can be
    got = read_progress(str(f))
    assert got.beat is None and got.error is not None and "larger than" in got.error
    link = tmp_path / "link.json"
    f.write_text('{"monotonic": 5}')
    link.symlink_to(f)
    assert read_beat(str(link)) is None and read_progress(str(link)).error == "is a symbolic link"
    assert read_progress(str(tmp_path / "missing")).missing


# -- the writers: a file that cannot be written -------------------------------------


def test_the_runner_relays_progress_once_its_file_cannot_be_written(
    immutable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """worker/_progress.py: said once on stderr and on the channel, then every
    change goes over the channel; the file is tried again with backoff."""
    subprocess.run(["chattr", "-i", str(immutable)], check=True)
    sent: list[Any] = []  # worker/_messages.py's messages, as the runner loads it
    now = [100.0]
    progress = Progress(str(immutable / "hb.json"), 0.5, lambda: now[0], send=sent.append)
    progress.heartbeat(1)
    progress.write()
    assert read_beat(str(immutable / "hb.json")) is not None and not sent
    subprocess.run(["chattr", "+i", str(immutable)], check=True)
    for step in range(2, 6):
        now[0] += 0.5
        progress.heartbeat(step)
        progress.write()
    kinds = [m.KIND for m in sent]
    assert kinds == ["progress_failed", "progress", "progress", "progress", "progress"], kinds
    assert "Operation not permitted" in sent[0].error and sent[0].path.endswith("hb.json")
    last = sent[-1].beat
    assert isinstance(last, dict) and last["step"] == 5 and last["monotonic"] == now[0]
    err = capsys.readouterr().err
    assert err.count("not recorded") == 1 and "over the runner's channel" in err
    assert progress.failure is not None and 0.5 <= progress._backoff <= 30.0


def test_heartbeat_says_once_and_never_raises_when_its_file_cannot_be_written(
    immutable: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HEARTBEAT_ENV, str(immutable / "hb.json"))
    monkeypatch.setenv("ELASTRUN_HEARTBEAT_INTERVAL", "0.01")
    hb_api._reset_for_tests()
    try:
        for step in range(3):
            hb_api.heartbeat(step)
            hb_api._last_write = -float("inf")  # past the rate limit and the backoff
        err = capsys.readouterr().err
        assert err.count("not recorded") == 1 and "cannot judge this worker" in err
    finally:
        hb_api._reset_for_tests()


# -- the files: no link followed -------------------------------------------------------


def test_links_planted_at_the_progress_and_stacks_files_are_replaced_not_followed(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "hb.json").symlink_to(victim)
    (tmp_path / "stacks.txt").symlink_to(victim)
    progress = Progress(str(tmp_path / "hb.json"), 0.5, lambda: 100.0)
    progress.heartbeat(1)
    progress.write()
    signum = signal.SIGRTMIN + 7
    try:
        _runner.register_stacks(str(tmp_path / "stacks.txt"), signum)
    finally:
        faulthandler.unregister(signum)
        signal.signal(signum, signal.SIG_DFL)
    assert victim.read_text() == "precious"
    for name in ("hb.json", "stacks.txt"):
        assert not (tmp_path / name).is_symlink() and (tmp_path / name).is_file()
    assert read_beat(str(tmp_path / "hb.json")) is not None
    assert (tmp_path / "stacks.txt").read_text().startswith("# elastrun: main thread 0x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hb.json", "stacks.txt", "victim"]
