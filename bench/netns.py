"""Network namespaces for the partition scenario: three "nodes" joined by a
bridge, one of which can be cut off without anybody getting a reset."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

from bench.paths import BenchFailure


class NetnsLab:
    """Three "nodes" in network namespaces of their own, joined by a bridge in
    a fourth (hub) namespace; nothing is changed in the host's namespace.
    Node ``i`` has address ``10.77.<lab>.<i+1>`` on its interface ``eth0``.
    ``partition(i)`` takes node ``i``'s link to the bridge down: its packets
    are dropped silently, as with a pulled cable (no reset, no FIN)."""

    def __init__(self, nodes: int = 3) -> None:
        self.tag = f"eb{os.getpid() % 100000}"
        self.hub = f"{self.tag}-h"
        self.nodes = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.subnet = 100 + os.getpid() % 100
        self._created: list[str] = []

    def addr(self, i: int) -> str:
        return f"10.77.{self.subnet}.{i + 1}"

    @staticmethod
    def _ip(*args: str) -> None:
        proc = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=20, check=False
        )
        if proc.returncode != 0:
            raise BenchFailure(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()[:200]}")

    def __enter__(self) -> NetnsLab:
        try:
            for ns in [self.hub, *self.nodes]:
                self._ip("netns", "add", ns)
                self._created.append(ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.nodes):
                port = f"v{i}"
                self._ip(
                    "-n", self.hub, "link", "add", port, "type", "veth",
                    "peer", "name", "eth0", "netns", ns,
                )  # fmt: skip
                self._ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
                self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for ns in reversed(self._created):
            with contextlib.suppress(BenchFailure, subprocess.TimeoutExpired):
                self._ip("netns", "del", ns)
        self._created.clear()

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[i]]

    def partition(self, i: int) -> float:
        t = time.monotonic()
        self._ip("-n", self.hub, "link", "set", f"v{i}", "down")
        return t


def netns_status() -> str | None:
    """None when network namespaces can be made here, else why not."""

    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "skipped: needs root + ip netns"
    try:
        with NetnsLab(nodes=1):
            pass
    except (BenchFailure, OSError, subprocess.TimeoutExpired) as exc:
        return f"skipped: needs root + ip netns ({exc})"
    return None
