"""The connection under :mod:`elastrun.store.etcd`: etcd v3's gRPC-JSON gateway
spoken with httpx (see docs/etcd.md for why).

This module owns everything about the wire: endpoint parsing, TLS settings,
user/password tokens, failover between endpoints, bounded retries and the
translation of HTTP/gateway errors into :mod:`elastrun.errors`. Nothing here
knows the :class:`~elastrun.store.base.Store` interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from elastrun.endpoint import Endpoint, parse_endpoint_list
from elastrun.errors import (
    AuthenticationError,
    ConfigError,
    LeaseNotFound,
    ProtocolError,
    RevisionCompacted,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from elastrun.frozen import frozen
from elastrun.store.etcd_options import DEFAULT_ETCD_PORT, EtcdOptions

try:
    import httpx
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ConfigError(
        "the etcd backend needs the 'httpx' package: pip install 'elastrun[etcd]'"
    ) from exc

# httpcore asks ``import sniffio`` at every request (which async library runs
# it); where sniffio is not installed, each of those failed imports searches
# sys.path again: a fifth of an agent's CPU on etcd (200 us a request). A None
# entry in sys.modules makes that import fail at once, with the same answer
# (asyncio).
if importlib.util.find_spec("sniffio") is None:
    sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]

__all__ = [
    "Endpoint",
    "EtcdConnection",
    "EtcdSettings",
    "Json",
    "RetryableError",
    "Stream",
    "gateway_error",
    "int_field",
    "parse_endpoints",
    "settings_from_options",
    "translate",
]

CONNECT_TIMEOUT = 3.0  # one connection attempt to one endpoint
# One request to one endpoint waits at most timeout/3 (within 2..10 s), so a
# member that accepts connections but never answers (frozen) is failed over.
# etcd answers "request timed out" by itself after ~7 s.
MIN_ATTEMPT, MAX_ATTEMPT = 2.0, 10.0
MAX_BACKOFF = 1.0

Json = dict[str, Any]

# gRPC status codes that the gateway reports in {"code": N}.
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_OUT_OF_RANGE = 11
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16
_INVALID_ARGUMENT = 3
_DEADLINE_EXCEEDED = 4

# Ask etcd to refuse requests (and cancel watches) on a member that has lost
# its leader, so that we fail over instead of talking to an isolated member.
_REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}


@frozen(slots=True)
class EtcdSettings:
    endpoints: tuple[Endpoint, ...]
    https: bool
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    key_prefix: str = ""

    def describe(self) -> str:
        return ", ".join(str(e) for e in self.endpoints)


def parse_endpoints(spec: str) -> tuple[tuple[Endpoint, ...], bool]:
    """``host:port[,host:port...]`` (port defaults to 2379; IPv6 in brackets;
    an ``http://`` or ``https://`` prefix is accepted) -> endpoints, https?"""
    return parse_endpoint_list(spec, DEFAULT_ETCD_PORT, "etcd endpoint")


def settings_from_options(
    endpoints: str | Sequence[Endpoint], options: EtcdOptions
) -> EtcdSettings:
    """Validate the endpoints (a ``host:port,...`` string is parsed here) and
    the etcd options (``--rdzv-conf``'s etcd keys). HTTPS: an ``https://``
    endpoint, ``protocol=https`` or TLS files."""
    if isinstance(endpoints, str):
        members, https = parse_endpoints(endpoints)
    else:
        members, https = tuple(endpoints), False
    if not members:
        raise ConfigError("no etcd endpoint (expected host:port[,host:port...])")
    for e in members:
        if e.port == 0:
            raise ConfigError(f"etcd endpoint {str(e)!r}: port 0 is not a port etcd listens on")
    https = https or options.protocol == "https"
    files: dict[str, str | None] = {}
    for name in ("cacert", "cert", "key"):
        path = getattr(options, name) or None
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"etcd TLS {name} file {path!r} does not exist (--rdzv-conf {name}=)")
        files[name] = path
    if (files["cert"] is None) != (files["key"] is None):
        raise ConfigError("etcd TLS needs both cert and key (--rdzv-conf cert=...,key=...)")
    user, password = options.user or None, options.password
    if password and user is None:
        raise ConfigError("etcd password given without user (--rdzv-conf user=...)")
    return EtcdSettings(
        endpoints=members,
        https=https or any(files.values()),
        cacert=files["cacert"],
        cert=files["cert"],
        key=files["key"],
        user=user,
        password=password or "",
        key_prefix=options.key_prefix or "",
    )


def _ssl_context(settings: EtcdSettings) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=settings.cacert)
        if settings.cert is not None:
            ctx.load_cert_chain(settings.cert, settings.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"etcd TLS files unusable (cacert={settings.cacert!r}, cert={settings.cert!r}, "
            f"key={settings.key!r}): {exc}"
        ) from exc
    return ctx


def _socket_options() -> list[tuple[int, int, int]]:
    """TCP keepalive, so that a peer that vanished without closing the
    connection (power loss, partition) breaks an idle watch within ~11 s."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


class RetryableError(Exception):
    """One endpoint failed in a way another endpoint (or a later try) may not.
    ``reauth``: our token expired; get a new one first."""

    def __init__(self, reason: str, *, timeout: bool = False, reauth: bool = False) -> None:
        super().__init__(reason)
        self.timeout = timeout
        self.reauth = reauth


def int_field(data: Mapping[str, Any], name: str) -> int:
    """An int64 field: etcd's gateway sends them as JSON strings, and leaves
    them out when zero."""
    return int(data.get(name, 0))


def gateway_error(data: Json, status: int) -> tuple[int, str]:
    err = data.get("error")
    if isinstance(err, dict):  # streaming errors: {"error": {"grpc_code": .., "message": ..}}
        return int(err.get("grpc_code", 0)), str(err.get("message", err))
    return int(data.get("code", 0)), str(data.get("message") or err or f"HTTP {status}")


def translate(code: int, message: str, where: str) -> StoreError | RetryableError:
    """A gateway error -> the elastrun error to raise, or RetryableError."""
    low = message.lower()
    if "invalid auth token" in low:
        return RetryableError(message, reauth=True)
    if "compacted" in low:
        return RevisionCompacted(f"etcd at {where}: {message}")
    if "lease not found" in low:
        return LeaseNotFound(f"etcd at {where}: {message} (it expired or was revoked)")
    if "authentication failed" in low:
        return AuthenticationError(f"etcd at {where} rejected the user name or password")
    if "user name is empty" in low or (code == _UNAUTHENTICATED and "token" not in low):
        return AuthenticationError(
            f"etcd at {where} requires authentication: set user= and password= in --rdzv-conf"
        )
    if code == _PERMISSION_DENIED or "permission denied" in low:
        return AuthenticationError(f"etcd at {where}: permission denied for this user ({message})")
    if code in (_UNAVAILABLE, _DEADLINE_EXCEEDED) or "leader" in low or "timed out" in low:
        return RetryableError(message, timeout="timed out" in low)
    if code == _OUT_OF_RANGE:
        return StoreError(f"etcd at {where}: {message}")
    return StoreError(f"etcd at {where} refused the request: {message} (code {code})")


class Stream:
    """An open streaming response (a watch): JSON messages, one per line."""

    def __init__(self, response: httpx.Response, endpoint: Endpoint) -> None:
        self.response = response
        self.endpoint = endpoint
        self._lines = response.aiter_lines()

    async def next(self) -> Json | None:
        """The next message, or None at the end of the stream. Transport
        errors raise StoreUnavailable."""
        while True:
            try:
                line = await anext(self._lines)
            except StopAsyncIteration:
                return None
            except httpx.HTTPError as exc:
                raise StoreUnavailable(
                    f"watch stream from etcd at {self.endpoint} broke: {_describe(exc)}"
                ) from exc
            if line.strip():
                return _decode(line, self.endpoint)

    async def aclose(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.response.aclose()


def _decode(text: str, endpoint: Endpoint) -> Json:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(
            f"etcd at {endpoint} sent something that is not JSON (is it etcd 3.4 or newer, "
            f"serving the v3 API?): {text[:200]!r}"
        ) from exc
    if not isinstance(data, dict):
        raise ProtocolError(f"etcd at {endpoint} sent unexpected JSON: {text[:200]!r}")
    return data


class EtcdConnection:
    """Unary calls and streams to the first healthy endpoint, with failover."""

    def __init__(self, settings: EtcdSettings, *, timeout: float) -> None:
        self.settings = settings
        self.set_timeout(timeout)
        self._scheme = "https" if settings.https else "http"
        transport = httpx.AsyncHTTPTransport(
            verify=_ssl_context(settings) if settings.https else False,
            retries=0,
            socket_options=_socket_options(),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )
        self._client = httpx.AsyncClient(transport=transport, trust_env=False)
        self._current = 0
        self._token: str | None = None
        self._auth_lock = asyncio.Lock()

    def set_timeout(self, timeout: float) -> None:
        """Bound each later operation (failover included) by ``timeout`` s."""
        self.timeout = timeout
        self.attempt_timeout = min(MAX_ATTEMPT, max(MIN_ATTEMPT, timeout / 3))

    @property
    def endpoint(self) -> Endpoint:
        return self.settings.endpoints[self._current]

    def deadline(self) -> float:
        return time.monotonic() + self.timeout

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- unary calls ---------------------------------------------------------
    async def call(self, path: str, body: Json, *, idempotent: bool = True) -> Json:
        """POST ``body`` to ``/v3/<path>`` and return the decoded answer,
        failing over between endpoints until the operation's deadline."""
        return await self._with_failover(path, body, idempotent=idempotent)

    async def stream(
        self,
        path: str,
        body: Json,
        deadline: float,
        check: Callable[[Json, Endpoint], Awaitable[None]],
    ) -> tuple[Stream, Json]:
        """Open a streaming call (watch) and return it with its first message,
        which ``check`` accepts or rejects (RetryableError: try elsewhere)."""
        stream: Stream | None = None

        async def attempt(endpoint: Endpoint, remaining: float) -> Json:
            nonlocal stream
            request = self._client.build_request(
                "POST",
                self._url(endpoint, path),
                json=body,
                headers=self._headers(),
                timeout=httpx.Timeout(None, connect=min(remaining, CONNECT_TIMEOUT)),
            )
            until = asyncio.get_running_loop().time() + remaining
            async with asyncio.timeout_at(until):
                response = await self._client.send(request, stream=True)
            candidate = Stream(response, endpoint)
            try:
                async with asyncio.timeout_at(until):
                    if response.status_code != 200:
                        await response.aread()
                        return _decode(response.text, endpoint)
                    first = await candidate.next()
                if first is None:
                    raise RetryableError("watch stream closed at once")
                await check(first, endpoint)
            except BaseException:
                await candidate.aclose()
                raise
            stream = candidate
            return first

        first = await self._failover(attempt, deadline, idempotent=True)
        assert stream is not None
        return stream, first

    async def _with_failover(self, path: str, body: Json, *, idempotent: bool) -> Json:
        async def attempt(endpoint: Endpoint, remaining: float) -> Json:
            response = await self._client.post(
                self._url(endpoint, path),
                json=body,
                headers=self._headers() if path != "auth/authenticate" else _REQUIRE_LEADER,
                timeout=httpx.Timeout(remaining, connect=min(remaining, CONNECT_TIMEOUT)),
            )
            return _decode(response.text, endpoint) | {"__status": response.status_code}

        return await self._failover(attempt, self.deadline(), idempotent=idempotent)

    async def _failover(
        self,
        attempt: Callable[[Endpoint, float], Awaitable[Json]],
        deadline: float,
        *,
        idempotent: bool,
    ) -> Json:
        """Run ``attempt`` on the current endpoint, then the others in turn,
        with backoff between rounds, until one answers or ``deadline``."""
        endpoints = self.settings.endpoints
        failures: dict[str, str] = {}
        timed_out = False
        backoff = 0.05
        reauthenticated = False
        while True:
            for i in range(len(endpoints)):
                index = (self._current + i) % len(endpoints)
                endpoint = endpoints[index]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                budget = min(remaining, self.attempt_timeout)
                try:
                    data = await self._attempt_once(attempt, endpoint, budget, idempotent)
                except RetryableError as exc:
                    failures[str(endpoint)] = str(exc)
                    timed_out = exc.timeout
                    if exc.reauth:
                        if reauthenticated or self.settings.user is None:
                            raise AuthenticationError(
                                f"etcd at {endpoint} keeps rejecting our token: {exc}"
                            ) from None
                        reauthenticated = True
                        await self.authenticate(force=True)
                    continue
                self._current = index
                return data
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                tried = "; ".join(f"{k}: {v}" for k, v in failures.items()) or "no attempt made"
                kind = StoreTimeout if timed_out else StoreUnavailable
                tls = " over TLS" if self.settings.https else ""
                raise kind(
                    f"etcd at {self.settings.describe()} unavailable{tls} for "
                    f"{self.timeout:g} s ({tried})"
                )
            await asyncio.sleep(min(backoff, remaining))
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _attempt_once(
        self,
        attempt: Callable[[Endpoint, float], Awaitable[Json]],
        endpoint: Endpoint,
        remaining: float,
        idempotent: bool,
    ) -> Json:
        """One try on one endpoint: the answer, a StoreError to give up with,
        or RetryableError (try the next endpoint)."""
        try:
            data = await attempt(endpoint, remaining)
        except (httpx.ConnectError, httpx.ConnectTimeout, ssl.SSLError) as exc:
            # Not connected, or the TLS handshake was refused: nothing was applied.
            raise RetryableError(
                _describe(exc), timeout=isinstance(exc, httpx.ConnectTimeout)
            ) from None
        except (httpx.TransportError, StoreUnavailable, OSError) as exc:
            if not idempotent:
                raise StoreUnavailable(
                    f"lost the connection to etcd at {endpoint} during a write "
                    f"({_describe(exc)}); whether it was applied is unknown"
                ) from exc
            timeout = isinstance(exc, httpx.TimeoutException | StoreTimeout)
            raise RetryableError(_describe(exc), timeout=timeout) from None
        except TimeoutError:
            raise RetryableError("no answer before the deadline", timeout=True) from None
        except httpx.HTTPError as exc:
            raise StoreError(f"etcd at {endpoint}: {_describe(exc)}") from exc
        status = int(data.pop("__status", 200))
        if "error" not in data and status == 200:
            return data
        code, message = gateway_error(data, status)
        error = translate(code, message, str(endpoint))
        if isinstance(error, StoreError):
            raise error
        if not idempotent and not error.reauth and "no leader" not in message:
            raise StoreUnavailable(
                f"etcd at {endpoint} failed a write ({message}); whether it was applied is unknown"
            )
        raise error

    # -- auth ----------------------------------------------------------------
    async def authenticate(self, *, force: bool = False) -> None:
        """Get a token for user/password (if configured)."""
        if self.settings.user is None:
            return
        stale = self._token
        async with self._auth_lock:
            if self._token is not None and (not force or self._token != stale):
                return
            self._token = None
            data = await self.call(
                "auth/authenticate",
                {"name": self.settings.user, "password": self.settings.password},
            )
            token = data.get("token")
            if not isinstance(token, str) or not token:
                raise AuthenticationError(
                    f"etcd at {self.settings.describe()} returned no token for user "
                    f"{self.settings.user!r} (is auth enabled?)"
                )
            self._token = token

    # -- helpers -------------------------------------------------------------
    def _url(self, endpoint: Endpoint, path: str) -> str:
        return f"{self._scheme}://{endpoint}/v3/{path}"

    def _headers(self) -> dict[str, str]:
        if self._token is None:
            return _REQUIRE_LEADER
        return {**_REQUIRE_LEADER, "Authorization": self._token}

    def describe(self) -> str:
        return self.settings.describe()


def _describe(exc: BaseException) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, ssl.SSLError):
            return f"TLS error: {cause}"
        cause = cause.__cause__ or cause.__context__
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
