"""The agent's signal handlers under a flood of SIGCHLD (agent/signals.py).

Each case runs in a fresh interpreter. While the event loop is busy, the
process gets 2000 SIGCHLD (what a large group's exits bring), then a
SIGTERM. asyncio's own handlers (the control) print "Exception ignored ...
signal wakeup fd" once the wakeup socket is full, and lose the SIGTERM
whose byte did not fit. The agent's router prints nothing, runs the SIGCHLD
callback once per burst, and acts on the SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO

FLOOD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from elastrun.agent.signals import SignalRouter

    children = []

    async def main(mode):
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def stop(sig):
            if not stopped.done():
                stopped.set_result(sig)

        if mode == "router":
            router = SignalRouter(loop)
            router.add(signal.SIGCHLD, children.append, coalesce=True)
            router.add(signal.SIGTERM, stop)
        else:
            loop.add_signal_handler(signal.SIGCHLD, children.append, signal.SIGCHLD)
            loop.add_signal_handler(signal.SIGTERM, stop, signal.SIGTERM)

        def flood():  # the loop is busy: nothing reads its wakeup socket meanwhile
            for _ in range(2000):
                os.kill(os.getpid(), signal.SIGCHLD)
            os.kill(os.getpid(), signal.SIGTERM)

        loop.call_soon(flood)
        try:
            print("stopped by", await asyncio.wait_for(stopped, 5))
        except TimeoutError:
            print("SIGTERM lost")
        print("SIGCHLD callbacks", len(children))
        if mode == "router":
            router.close()

    asyncio.run(main(sys.argv[1]))
    """
)


def flood(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", FLOOD, mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_asyncio_handlers_print_and_lose_signals_under_a_flood() -> None:
    """The control: the cause is real (a full wakeup socket)."""
    res = flood("asyncio")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Exception ignored when trying to write to the signal wakeup fd" in res.stderr
    assert res.stdout.splitlines()[0] == "SIGTERM lost", res.stdout


def test_the_router_prints_nothing_and_acts_on_every_kind_of_signal() -> None:
    res = flood("router")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr == ""
    lines = res.stdout.splitlines()
    assert lines[0] == "stopped by 15", res.stdout
    calls = int(lines[1].split()[-1])
    assert 1 <= calls < 2000  # a burst is one callback, not one per signal


RACE = textwrap.dedent(
    """
    import asyncio, gc
    from elastrun.agent.signals import StopSignals

    async def workers_exited():
        return "workers exited"

    async def store_lost():
        raise RuntimeError("store lost at the same moment")

    async def main():
        stops = StopSignals()
        print(await stops.first(workers_exited(), store_lost()))

    asyncio.run(main())
    gc.collect()
    """
)


def test_a_losing_racers_error_is_not_printed_at_exit() -> None:
    """Workers that exit while the rendezvous fails too (the store lost in the
    same moment): the race's outcome is the winner's, and the loser's error
    is not dumped as "Task exception was never retrieved" with a traceback."""
    run = subprocess.run(
        [sys.executable, "-c", RACE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "workers exited"
    assert "never retrieved" not in run.stderr and "Traceback" not in run.stderr, run.stderr
