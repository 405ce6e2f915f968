"""A throw-away multi-host network built from Linux network namespaces.

Layout: one "switch" namespace holding a bridge, and one namespace per node,
each joined to the bridge by a veth pair. Nothing is created in the root
namespace, the node namespaces have no route beyond their /24, so no packet
can leave the test's private network. Names carry a per-run prefix (pid and
random bits), so concurrent runs never collide.

Partition (``cut``): the node's bridge port is set to the STP "disabled"
state. Frames to and from the node are silently dropped while its link stays
up (no carrier change, no RST, no ICMP): the node simply stops hearing from
the others, as when a switch or cable elsewhere fails. ``heal`` puts the port
back to "forwarding". (netem, tc matchall and iptables are not available on
every kernel or image; bridge port states need only the bridge module.)

Processes started with ``run_in`` run in their own process group; ``close``
kills those groups, then anything else still inside the namespaces, deletes
the namespaces and checks that nothing it made is left. Every command and
every wait is bounded. Namespace names carry the creating pid, so a later run
can delete what a run killed before its teardown left behind
(``sweep_stale``), and never touches a live run's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import stop_groups

CMD_TIMEOUT = 15.0


class NetnsUnavailable(RuntimeError):
    """Raised when namespaces cannot be made here (not root, no iproute2...)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def bridge(*args: str) -> None:
    proc = subprocess.run(
        ["bridge", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bridge {' '.join(args)} failed: {proc.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "bridge"):
        if shutil.which(tool) is None:
            return f"needs iproute2 ('{tool}' not found)"
    probe = f"erprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"'ip netns add' failed: {made.stderr.strip()}"
        link = ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if link.returncode != 0:
            return f"cannot create a bridge in a namespace: {link.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


NS_PREFIX = "erfault"  # namespaces: erfault-<owner pid>-<random>-<node>


def _owner_alive(ns: str) -> bool:
    """Whether the process that made namespace ``ns`` (its pid is in the name) lives."""
    parts = ns.split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return True  # not ours to judge
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces left by earlier runs whose process is gone (a run killed
    before its teardown). A namespace of a live run is never touched; processes
    still inside a stale one are killed first (they can only be that run's)."""
    removed = []
    listed = ip("netns", "list", check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX + "-") or _owner_alive(name):
            continue
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        if ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


@dataclass
class Node:
    name: str
    ns: str
    ifname: str  # the veth inside the node's namespace
    port: str  # its peer, a port of the switch's bridge
    addr: str
    cut: bool = False


@dataclass
class Network:
    """Namespaces ``<ns_prefix>-<node>`` around a switch namespace ``<ns_prefix>-sw``;
    interfaces ``<prefix>n<i>`` / ``<prefix>p<i>``."""

    prefix: str  # interface names (at most 11 bytes: names are limited to 15)
    ns_prefix: str  # namespace names: erfault-<pid>-<random>
    subnet: str  # "10.213.X"
    switch: str
    nodes: dict[str, Node] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    # -- building -------------------------------------------------------

    @classmethod
    def create(cls, names: Sequence[str]) -> Network:
        token = secrets.token_hex(2)
        prefix = f"ef{os.getpid() % 100000}{token}"
        ns_prefix = f"{NS_PREFIX}-{os.getpid()}-{token}"
        subnet = f"10.213.{1 + secrets.randbelow(254)}"
        net = cls(prefix=prefix, ns_prefix=ns_prefix, subnet=subnet, switch=f"{ns_prefix}-sw")
        try:
            net._add_ns(net.switch)
            ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", net.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names, start=1):
                net._add_node(name, i)
        except BaseException:
            net.close(check=False)
            raise
        return net

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def _add_node(self, name: str, index: int) -> None:
        ns = f"{self.ns_prefix}-{name}"
        # Interface names are limited to 15 bytes; the prefix is at most 11.
        node = Node(
            name=name,
            ns=ns,
            ifname=f"{self.prefix}n{index}",
            port=f"{self.prefix}p{index}",
            addr=f"{self.subnet}.{index}",
        )
        self._add_ns(ns)
        # Both ends are created directly inside their namespaces: the root
        # namespace never sees them.
        ip(
            "link", "add", node.ifname, "netns", ns, "type", "veth",
            "peer", "name", node.port, "netns", self.switch,
        )  # fmt: skip
        ip("-n", ns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
        ip("-n", ns, "link", "set", node.ifname, "up")
        ip("-n", self.switch, "link", "set", node.port, "master", "br0")
        ip("-n", self.switch, "link", "set", node.port, "up")
        self.nodes[name] = node

    # -- using ----------------------------------------------------------

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def run_in(
        self,
        node: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the node's namespace, in its own process group.

        ``ip netns exec`` execs the command, so the returned pid is the
        command's own. The environment gets ``GLOO_SOCKET_IFNAME`` set to the
        node's interface (gloo otherwise binds to the address the hostname
        resolves to, which does not exist in the namespace, and falls back to
        loopback).
        """
        n = self.nodes[node]
        full_env = dict(os.environ if env is None else env)
        full_env.setdefault("GLOO_SOCKET_IFNAME", n.ifname)
        out: int | None = None
        log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
        try:
            out = log.fileno() if log is not None else subprocess.DEVNULL
            proc = subprocess.Popen(
                ["ip", "netns", "exec", n.ns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()
        self.procs.append(proc)
        return proc

    def check_call_in(self, node: str, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Run a short command in the node's namespace and return its output."""
        proc = subprocess.run(
            ["ip", "netns", "exec", self.nodes[node].ns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{argv} in {node} failed: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def cut(self, node: str) -> None:
        """Partition the node: its frames are dropped silently both ways."""
        bridge("-n", self.switch, "link", "set", "dev", self.nodes[node].port, "state", "0")
        self.nodes[node].cut = True

    def heal(self, node: str) -> None:
        bridge("-n", self.switch, "link", "set", "dev", self.nodes[node].port, "state", "3")
        self.nodes[node].cut = False

    def pids_in(self, ns: str) -> list[int]:
        proc = ip("netns", "pids", ns, check=False)
        return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]

    # -- teardown -------------------------------------------------------

    def leftovers(self) -> list[str]:
        """What this network made that still exists (namespaces, root links, processes)."""
        left: list[str] = []
        listed = ip("netns", "list", check=False).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(self.ns_prefix):
                left.append(f"namespace {name}")
        links = ip("-o", "link", "show", check=False).stdout
        left += [
            f"root link {line.split(':')[1].strip()}"
            for line in links.splitlines()
            if self.prefix in line
        ]
        for proc in self.procs:
            if proc.poll() is None:
                left.append(f"process {proc.pid}")
        return left

    def close(self, check: bool = True) -> list[int]:
        """Kill everything started here, delete the namespaces, verify.

        Returns the pids that were still running inside the namespaces after
        the started process groups were killed (stray processes).
        """
        stop_groups(*self.procs)
        strays: list[int] = []
        for ns in self.namespaces:
            # Only processes in a namespace this network created: ours.
            for pid in self.pids_in(ns):
                strays.append(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while strays and time.monotonic() < deadline:
            if not any(self.pids_in(ns) for ns in self.namespaces):
                break
            time.sleep(0.1)
        for ns in reversed(self.namespaces):
            ip("netns", "del", ns, check=False)
        # veth pairs disappear asynchronously with their namespace.
        deadline = time.monotonic() + 10
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.leftovers()
        if check and left:
            raise AssertionError(f"network {self.prefix} left behind: {left}")
        return strays


@contextlib.contextmanager
def teardown_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM (``timeout``, a CI runner cancelling) into KeyboardInterrupt
    while namespaces exist, so that teardowns run instead of leaking them."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def network(names: Sequence[str]) -> Iterator[Network]:
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    sweep_stale()
    with teardown_on_sigterm():
        net = Network.create(names)
        try:
            yield net
        finally:
            net.close()
