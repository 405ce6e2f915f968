"""The orphan guard's process (stdlib only; run as ``python -S -I -B <this file>``).

It reads lines from stdin, whose write end only the agent holds::

    +<pgid>   a worker was started: it leads process group and session <pgid>
    -<pgid>   that worker is gone and its group was cleaned up
    L<json>   the agent's rendezvous lease and how to revoke it (parse_spec)
    L         the agent holds no lease (any earlier one is forgotten)
    R<json>   a folder (a JSON string: its path) to remove once the agent is gone

End of file means the agent is gone. The kernel closes the agent's descriptors
however it dies, SIGKILL included, so this runs exactly when nobody else can
clean up: every process group still listed is SIGKILLed, and so is every
process still in one of those sessions (children that moved to a process
group of their own). Only descendants that started a new session (daemons)
escape. Then the folders it was given are removed (the agent's memory
checkpoints in shared memory: memory nobody would free otherwise; no link is
followed). Then the lease, if one is held, is revoked, so that the other nodes
see this one gone now rather than at its lease's TTL: on etcd through its
JSON gateway (``POST /v3/lease/revoke``, with the agent's endpoints, TLS files
and user), on the embedded store through its own protocol. Then the guard
exits. Everything is bounded in time; nothing here may hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import sys
import time

TYPE_CHECKING = False  # typing is not imported: this process starts in about 10 ms
if TYPE_CHECKING or __name__.startswith("elastrun."):
    from elastrun.fields import Fields
else:  # run by path, without elastrun: elastrun/fields.py (stdlib only), by its path
    import importlib.util

    _FIELDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fields.py")
    _spec = importlib.util.spec_from_file_location("_elastrun_fields", _FIELDS)
    assert _spec is not None and _spec.loader is not None
    _fields = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _fields
    _spec.loader.exec_module(_fields)
    Fields = _fields.Fields

KILL_FOR = 3.0  # keep killing (new forks) for at most this long
REVOKE_FOR = 5.0  # try to revoke the lease for at most this long
MAX_FOLDERS = 16  # folders to remove: the agent gives one


def _sessions_members(sids: set[int]) -> list[int]:
    out: list[int] = []
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fp:
                stat = fp.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        # fields: state ppid pgrp session ...
        if len(fields) > 3 and fields[0] not in (b"Z", b"X") and int(fields[3]) in sids:
            out.append(pid)
    return out


def kill_all(pgids: set[int]) -> None:
    deadline = time.monotonic() + KILL_FOR
    while pgids and time.monotonic() < deadline:
        live: set[int] = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
                live.add(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        strays = _sessions_members(pgids)
        for pid in strays:
            try:  # noqa: SIM105 - no contextlib: keep the guard's start-up minimal
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not live and not strays:
            return
        time.sleep(0.02)


def _kill_once(pgids: set[int]) -> None:
    for pgid in pgids:
        try:  # noqa: SIM105
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# -- revoking the lease ---------------------------------------------------------------
# The agent writes its lease as the JSON of elastrun.store.base.RevokeSpec
# (``RevokeSpec.to_json``); these two classes mirror its two kinds (this
# process stays on the standard library alone), read by parse_spec with the
# field reader RevokeSpec.from_json uses (elastrun/fields.py).
class EmbeddedLease:
    """A lease of the embedded store (``kind``: ``"elastrun"``)."""

    __slots__ = ("host", "lease", "port", "token")

    def __init__(self, lease: int, host: str, port: int, token: str | None) -> None:
        self.lease, self.host, self.port, self.token = lease, host, port, token


class EtcdLease:
    """A lease of etcd (``kind``: ``"etcd"``), revoked through its JSON gateway."""

    __slots__ = ("cacert", "cert", "endpoints", "https", "key", "lease", "password", "user")

    def __init__(self, lease: int, endpoints: list[tuple[str, int]], f: Fields) -> None:
        self.lease, self.endpoints = lease, endpoints
        self.https = f.raw.get("https") is True
        self.cacert = f.optional_text("cacert")
        self.cert = f.optional_text("cert")
        self.key = f.optional_text("key")
        self.user = f.optional_text("user")
        self.password = f.optional_text("password")


def parse_spec(raw: object) -> EmbeddedLease | EtcdLease | None:
    """The lease the agent described, or None when ``raw`` is not a spec:
    read as ``RevokeSpec.from_json`` reads it (elastrun/fields.py), every
    problem ignored (this process must never die of a bad line)."""
    try:
        f = Fields(raw, "a revoke spec")
        lease = f.integer("lease", low=1, high=2**63 - 1)
        if f.raw.get("kind") == "elastrun":
            port = f.integer("port", low=1, high=65535)
            return EmbeddedLease(lease, f.text("host"), port, f.optional_text("token"))
        if f.raw.get("kind") == "etcd":
            endpoints: list[tuple[str, int]] = []
            for e in f.items("endpoints", required=True):
                if not isinstance(e, list) or len(e) != 2:
                    return None
                pair = Fields({"host": e[0], "port": e[1]}, "an endpoint")
                endpoints.append((pair.text("host"), pair.integer("port", low=1, high=65535)))
            return EtcdLease(lease, endpoints, f)
    except ValueError:
        return None
    return None


def revoke(spec: EmbeddedLease | EtcdLease, deadline: float) -> bool:
    """Revoke the lease ``spec`` describes; True when a store said it is
    gone. Errors are swallowed: best effort."""
    try:
        if isinstance(spec, EtcdLease):
            return _revoke_etcd(spec, deadline)
        return _revoke_elastrun(spec, deadline)
    except Exception:
        return False


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _revoke_etcd(spec: EtcdLease, deadline: float) -> bool:
    import http.client
    import ssl

    context = None
    if spec.https:
        context = ssl.create_default_context(cafile=spec.cacert)
        if spec.cert is not None:
            context.load_cert_chain(spec.cert, spec.key)

    def post(
        conn: http.client.HTTPConnection, path: str, body: object, headers: dict[str, str]
    ) -> dict[str, object]:
        conn.request("POST", path, json.dumps(body), headers)
        data = json.loads(conn.getresponse().read() or b"{}")
        return data if isinstance(data, dict) else {}

    for _ in range(3):  # a few rounds over the endpoints (one may be down)
        for host, port in spec.endpoints:
            if time.monotonic() >= deadline:
                return False
            conn: http.client.HTTPConnection
            if context is not None:
                conn = http.client.HTTPSConnection(
                    host, port, timeout=_left(deadline), context=context
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=_left(deadline))
            try:
                headers = {"Content-Type": "application/json"}
                if spec.user:
                    auth = {"name": spec.user, "password": spec.password or ""}
                    token = post(conn, "/v3/auth/authenticate", auth, headers).get("token")
                    if not isinstance(token, str):
                        continue
                    headers["Authorization"] = token
                answer = post(conn, "/v3/lease/revoke", {"ID": str(spec.lease)}, headers)
                if "error" not in answer or "not found" in str(answer.get("error")):
                    return True
            except (OSError, ValueError, http.client.HTTPException):
                continue
            finally:
                conn.close()
        time.sleep(min(0.2, _left(deadline)))
    return False


def _revoke_elastrun(spec: EmbeddedLease, deadline: float) -> bool:
    """The embedded store's protocol: a hello, then one lease_revoke request
    (frames of a 4-byte big-endian length and UTF-8 JSON)."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((spec.host, spec.port), timeout=_left(deadline)) as sock:
                sock.settimeout(_left(deadline))
                _send_frame(sock, {"v": 1, "t": "hello", "token": spec.token})
                if _read_frame(sock).get("t") != "hello":
                    return False  # refused (wrong token?): nothing else to try
                request = {"v": 1, "t": "req", "id": 1, "op": "lease_revoke", "lease": spec.lease}
                _send_frame(sock, request)
                return _read_frame(sock).get("ok") is True
        except (OSError, ValueError):
            time.sleep(min(0.2, _left(deadline)))
    return False


def _send_frame(sock: socket.socket, message: dict[str, object]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def _read_frame(sock: socket.socket) -> dict[str, object]:
    head = _read_exactly(sock, 4)
    (length,) = struct.unpack(">I", head)
    if length > 1 << 20:
        raise ValueError("frame too large")
    data = json.loads(_read_exactly(sock, length))
    return data if isinstance(data, dict) else {}


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ValueError("connection closed")
        out += chunk
    return out


class Orders:
    """What the agent told the guard: process groups, the lease, folders."""

    def __init__(self) -> None:
        self.pgids: set[int] = set()
        self.lease: EmbeddedLease | EtcdLease | None = None
        self.folders: list[str] = []

    def take(self, line: bytes) -> None:
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"R":
                path = json.loads(rest)
                room = len(self.folders) < MAX_FOLDERS
                if isinstance(path, str) and os.path.isabs(path) and room:
                    self.folders.append(path)
            elif kind == b"L":
                self.lease = parse_spec(json.loads(rest)) if rest else None
            elif kind in (b"+", b"-") and (pgid := int(rest)) > 1:
                if kind == b"+":
                    self.pgids.add(pgid)
                else:
                    self.pgids.discard(pgid)
        except ValueError:
            return


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    orders = Orders()
    buf = b""
    while True:
        try:
            data = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            orders.take(line)
    # The agent is gone. Its workers first (one pass at once), its folders,
    # then its lease, then the workers again until none is left.
    _kill_once(orders.pgids)
    for folder in orders.folders:
        shutil.rmtree(folder, ignore_errors=True)  # never follows a link inside
    if orders.lease is not None:
        revoke(orders.lease, time.monotonic() + REVOKE_FOR)
    kill_all(orders.pgids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
