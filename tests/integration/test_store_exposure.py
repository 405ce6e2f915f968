"""Who can reach the store an agent hosts, and with what: real agents.

* It listens on the endpoint's address only (not on every interface), and
  ``--standalone`` on loopback only: the agent's listening sockets, read from
  /proc, and connections tried on other loopback addresses.
* Without a token, beyond loopback, the agent says once that anyone who can
  reach the port can join the job, and how to set a token (inside a network
  namespace of the test's own, with a private address nothing can reach).
* A token given in the environment or in a file never shows in ``ps``; the
  agents meet with it, ``elastrun status`` reads the job with the same
  sources, and a client without it is refused.
* A token file that is a FIFO is refused at once by each command, never
  blocking it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.errors import AuthenticationError
from elastrun.store.client import TcpStore
from elastrun.store.token import TOKEN_ENV, TOKEN_FILE_ENV
from tests.conftest import REPO
from tests.faults.netns import Network, unavailable_reason
from tests.helpers import free_port, stop_groups, wait_for

ELASTRUN = [sys.executable, "-m", "elastrun"]
BOUND = 60.0
WARNING = "has no token and listens beyond loopback"
# A worker that needs no torch: says it is up, then waits for the test (bounded).
WORKER = textwrap.dedent(
    """
    import os, pathlib, sys, time
    print("worker up", os.environ["RANK"], os.environ["WORLD_SIZE"], flush=True)
    print("worker token:", os.environ.get("ELASTRUN_STORE_TOKEN", "none"), flush=True)
    go = pathlib.Path(sys.argv[1])
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def env(**extra: str) -> dict[str, str]:
    out = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PET_") and k not in (TOKEN_ENV, TOKEN_FILE_ENV)
    }
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), out.get("PYTHONPATH")]))
    out.update(extra)
    return out


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses ``pid`` listens on (its network namespace's /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return out


class Agents:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[Any]] = []
        (tmp / "w.py").write_text(WORKER)

    def start(self, name: str, flags: list[str], environ: dict[str, str]) -> subprocess.Popen[Any]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [*ELASTRUN, "--no-warm", *flags, str(self.tmp / "w.py"), str(self.tmp / "go")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                cwd=self.tmp,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def finish(self, *procs: subprocess.Popen[Any]) -> list[int]:
        (self.tmp / "go").touch()
        return [p.wait(BOUND) for p in procs]


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path)
    try:
        yield a
    finally:
        stop_groups(*a.procs)


def c10d(port: int, host: str = "127.0.0.1", nodes: str = "1:2", conf: str = "") -> list[str]:
    return [
        f"--nnodes={nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host}:{port}",
        "--rdzv-id=exposure",
        f"--rdzv-conf=last_call_timeout=0.5,join_timeout=30{conf}",
    ]


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_store_listens_on_the_endpoint_address_only(agents: Agents) -> None:
    port = free_port("127.0.0.2")
    agent = agents.start("a", c10d(port, "127.0.0.2"), env())
    wait_for(lambda: "worker up" in agents.output("a"), BOUND, "the worker to start")
    assert listening(agent.pid) == {("127.0.0.2", port)}
    assert connects("127.0.0.2", port)
    assert not connects("127.0.0.1", port)
    assert agents.finish(agent) == [0]
    output = agents.output("a")
    assert "hosts the rendezvous store on 127.0.0.2" in output
    assert WARNING not in output  # loopback: nobody else can reach it


def test_standalone_listens_on_loopback_only(agents: Agents) -> None:
    agent = agents.start("a", ["--standalone"], env())
    wait_for(lambda: "worker up" in agents.output("a"), BOUND, "the worker to start")
    addresses = listening(agent.pid)
    assert addresses and {host for host, _ in addresses} == {"127.0.0.1"}
    assert agents.finish(agent) == [0]
    assert WARNING not in agents.output("a")


def _until(marker: str, argv: list[str]) -> list[str]:
    """Run ``argv`` until its output has ``marker`` (at most BOUND s), then SIGTERM it.

    Whatever the process prints at start is in the output: it installs its SIGTERM
    handler (which only sets an event) before it prints, so it says all it has to
    say before it stops.
    """
    script = (
        'out=$(mktemp); "$@" >"$out" 2>&1 & pid=$!; i=0; '
        f'while ! grep -q "{marker}" "$out" && [ $i -lt {int(BOUND * 10)} ]; do '
        "sleep 0.1; i=$((i+1)); done; "
        'kill -TERM $pid; wait $pid; cat "$out"; rm -f "$out"'
    )
    return ["sh", "-c", script, "sh", *argv]


@pytest.mark.netns
def test_without_a_token_beyond_loopback_the_agent_says_so(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    net = Network.create(["a"])
    try:
        (tmp_path / "w.py").write_text("print('worker up', flush=True)\n")
        (tmp_path / "token").write_text("s3cret")
        (tmp_path / "token").chmod(0o600)
        base = [*ELASTRUN, "--no-warm", "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-id=x"]
        script = str(tmp_path / "w.py")
        addr = net["a"].addr

        def agent(*extra: str, token: str | None = None) -> str:
            prefix = ["env", f"{TOKEN_FILE_ENV}={token}"] if token else []
            both = ["sh", "-c", 'exec "$@" 2>&1', "sh"]  # the agent speaks on stderr
            return net.check_call_in("a", [*both, *prefix, *base, *extra, script], timeout=BOUND)

        exposed = agent(f"--rdzv-endpoint={addr}:29400")
        lines = [line for line in exposed.splitlines() if WARNING in line]
        assert len(lines) == 1, exposed
        assert "anyone who can reach its port can join the job" in lines[0]
        assert f"{TOKEN_ENV}=" in lines[0] and "token_file=PATH" in lines[0]
        assert WARNING not in agent(f"--rdzv-endpoint={addr}:29400", token=str(tmp_path / "token"))
        # Every interface, when asked: the endpoint is loopback but the port is not.
        every = agent("--rdzv-endpoint=127.0.0.1:29400", "--rdzv-conf=store_bind=0.0.0.0")
        assert "listening on 0.0.0.0:29400" in every and WARNING in every, every
        # elastrun store serve says the same. It prints its lines once bound, then serves
        # until SIGTERM: the shell waits (bounded) for the line that ends what it says
        # at start, however slow the machine, then stops it.
        serve = [*ELASTRUN, "store", "serve", f"--host={addr}", "--port=0"]
        served = net.check_call_in("a", _until(WARNING, serve), timeout=BOUND)
        assert f"listening on {addr}:" in served and WARNING in served, served
        assert "--token-file PATH or ELASTRUN_STORE_TOKEN" in served
        env_token = ["env", f"{TOKEN_ENV}=s3cret"]
        quiet = net.check_call_in("a", _until("listening on", [*env_token, *serve]), timeout=BOUND)
        assert "listening on" in quiet and WARNING not in quiet, quiet
    finally:
        net.close()


def test_a_token_from_the_environment_or_a_file_never_shows_in_ps(
    agents: Agents, tmp_path: Path
) -> None:
    secret = "correct-horse-battery-staple"
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    port = free_port()
    host = agents.start("a", c10d(port, nodes="2", conf=",is_host=1"), env(**{TOKEN_ENV: secret}))
    from_file = env(**{TOKEN_FILE_ENV: str(token_file)})
    other = agents.start("b", c10d(port, nodes="2", conf=",is_host=0"), from_file)
    wait_for(lambda: all("worker up" in agents.output(n) for n in "ab"), BOUND, "both workers up")
    for proc in (host, other):
        assert secret.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    # The token is the agent's: its workers do not inherit it.
    assert "worker token: none" in agents.output("a")
    assert secret not in agents.output("a") + agents.output("b")

    def status(**extra: str) -> subprocess.CompletedProcess[str]:
        argv = [*ELASTRUN, "status", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=exposure"]
        return subprocess.run(
            argv, env=env(**extra), capture_output=True, text=True, timeout=BOUND, check=False
        )

    seen = status(**{TOKEN_FILE_ENV: str(token_file)})
    assert seen.returncode == 0 and "exposure" in seen.stdout, seen.stderr
    refused = status()
    assert refused.returncode == 1 and "requires a token" in refused.stderr, refused.stderr

    async def stranger() -> None:
        with pytest.raises(AuthenticationError):
            await TcpStore.connect("127.0.0.1", port, token="guess", timeout=5)

    asyncio.run(stranger())
    assert agents.finish(host, other) == [0, 0]
    assert "worker up 1 2" in agents.output("a") + agents.output("b")


@pytest.mark.parametrize("command", ["launch", "status", "serve"])
def test_a_fifo_as_token_file_is_refused_at_once(tmp_path: Path, command: str) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)  # a plain open() would block until a writer comes
    (tmp_path / "w.py").write_text("")
    argv = {
        "launch": [
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", f"--rdzv-conf=token_file={fifo}",
            str(tmp_path / "w.py"),
        ],
        "status": ["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=x"],
        "serve": ["store", "serve", "--port=0"],
    }[command]  # fmt: skip
    extra = {} if command == "launch" else {TOKEN_FILE_ENV: str(fifo)}
    done = subprocess.run(
        [*ELASTRUN, *argv],
        env=env(**extra),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"{fifo}" in done.stderr and "is a FIFO, not a regular file" in done.stderr
    assert "Traceback" not in done.stderr
