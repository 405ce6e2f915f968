"""``elastrun status``: a job's round, members, restarts and last failure, read
from its store.

    elastrun status --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID
                    [--json] [--watch] [--rdzv-conf k=v,...] [--timeout S]

``--json`` prints the summary as one JSON object (stable keys, see
docs/events.md); with ``--watch`` one object per line, each time the job
changes. ``--watch`` follows the job with a store watch on its prefix (no
polling) until the job finishes or fails, or until SIGINT / SIGTERM; its table
is redrawn in place on a terminal, and printed as the lines that changed
when the output is a file or a pipe (the table and its printer:
:mod:`elastrun.status.show`).

Exit codes: 0 shown; 1 no such job, store unreachable or broken records;
2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from elastrun.endpoint import Endpoint, format_endpoints, parse_endpoint_list
from elastrun.errors import ConfigError, ElastrunError, HostLost, StoreError, StoreUnavailable
from elastrun.launcher.rdzv_conf import parse_rdzv_conf
from elastrun.names import RunId
from elastrun.rendezvous import quarantine
from elastrun.rendezvous.keys import Keys
from elastrun.status.hosts import open_candidates
from elastrun.status.model import TERMINAL_STATES, StoreHosts, Summary
from elastrun.status.show import Printer, render_table
from elastrun.status.summary import read_summary
from elastrun.store.base import Store, Watch, WatchEvent
from elastrun.store.etcd_options import DEFAULT_ETCD_PORT
from elastrun.store.factory import (
    DEFAULT_PORT,
    Backend,
    StoreOptions,
    open_store,
)
from elastrun.store.token import store_token
from elastrun.untrusted import ascii_decimal, printable

# Printer and render_table are defined in status/show.py and kept importable from here.
__all__ = ["Printer", "main", "render_table"]

DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 3600.0  # --timeout: an hour (every wait is bounded by it)
PROBE_TIMEOUT = 2.0  # one TCP connection to each endpoint before the store's own retries
DEBOUNCE = 0.05  # gather a burst of store changes into one refresh
TICK = 1.0  # a live table on a terminal is refreshed this often
RETRY = 1.0  # --watch looks again this often for a store or a job not there yet


class _Failed(Exception):
    """Why status stops. ``later``: the store or the job is not there now, and
    may be later (nothing listens yet, no host elected, no job registered):
    ``--watch`` waits for it."""

    def __init__(self, message: str, code: int = 1, *, later: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.later = later


class _StoreLost(Exception):
    """The store stopped answering (with candidate hosts, ``--watch`` looks
    for the new host)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastrun status",
        description="Show a job's round, members, ranks, restarts and last failure, "
        "read from its rendezvous store.",
    )
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="backend",
        default="c10d",
        help="c10d (or tcp), etcd, etcd-v2 (default c10d)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="endpoint",
        required=True,
        metavar="HOST[:PORT]",
        help="the job's store",
    )
    p.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        dest="run_id",
        required=True,
        metavar="ID",
        help="the job's --rdzv-id",
    )
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="conf",
        default="",
        metavar="K=V,...",
        help="store options: token, token_file (default: $ELASTRUN_STORE_TOKEN or "
        "$ELASTRUN_STORE_TOKEN_FILE); etcd: cacert, cert, key, user, "
        "password, key_prefix, protocol (the launcher's other keys are checked and ignored)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (one object per line)")
    p.add_argument(
        "--clear-quarantine",
        "--clear_quarantine",
        dest="clear_quarantine",
        default=None,
        metavar="HOST",
        help="let HOST, kept out of the job for a node fault (--quarantine-time) or as a "
        "replaced straggler (--replace-stragglers), join again",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="follow the job: print again on every change, until it ends",
    )
    p.add_argument(
        "--timeout",
        default=str(DEFAULT_TIMEOUT),
        metavar="S",
        help=f"give up reaching the store after S seconds, at most {MAX_TIMEOUT:g} "
        f"(default {DEFAULT_TIMEOUT:g})",
    )
    return p


def _options(text: str, backend: Backend) -> StoreOptions:
    """``--rdzv-conf``, read as the launcher reads it (a job's can be pasted
    as is; the keys that are not the store's are checked and not used) ->
    the store's options. The token, as the launcher's: ``token`` or
    ``token_file``, else ELASTRUN_STORE_TOKEN or ELASTRUN_STORE_TOKEN_FILE
    (the embedded store only)."""
    conf = parse_rdzv_conf(text)
    environ: dict[str, str] | None = None if backend is Backend.C10D else {}
    token = store_token(conf.token, conf.token_file, environ).token
    return StoreOptions(token=token, etcd=conf.etcd_options())


def _endpoints(backend: Backend, text: str) -> tuple[tuple[Endpoint, ...], bool]:
    """``--rdzv-endpoint`` for ``backend``: the store's one endpoint, or etcd's
    members (and whether one of them said ``https://``)."""
    if backend is Backend.ETCD:
        return parse_endpoint_list(text, DEFAULT_ETCD_PORT, "--rdzv-endpoint")
    if "," in text:  # the store's candidate hosts
        return parse_endpoint_list(text, DEFAULT_PORT, "--rdzv-endpoint")[0], False
    return (Endpoint.parse(text, DEFAULT_PORT, "--rdzv-endpoint"),), False


async def _open(
    args: argparse.Namespace, endpoints: tuple[Endpoint, ...], https: bool, where: str
) -> Store:
    options: StoreOptions = args.options
    if https and options.etcd.protocol is None:
        options = dataclasses.replace(
            options, etcd=dataclasses.replace(options.etcd, protocol="https")
        )
    if await _all_refuse(endpoints, min(args.timeout, PROBE_TIMEOUT)):
        # Nothing listens: a store that is gone (its job over), or a wrong
        # endpoint. Said at once, not after --timeout of retries.
        raise _Failed(
            f"nothing listens at {where} (connection refused): the job's store is gone (the "
            "job ended, or the node that hosted it), or the endpoint is wrong",
            later=True,
        )
    try:
        return await asyncio.wait_for(
            open_store(args.backend, endpoints, options, timeout=args.timeout),
            args.timeout + 1.0,
        )
    except TimeoutError:
        raise _Failed(
            f"cannot reach the {args.backend} store at {where} within {args.timeout:g} s "
            "(--timeout)",
            later=True,
        ) from None
    except StoreError as exc:
        msg = str(exc)
        if where in msg:  # the store's own message already names the endpoint
            raise _Failed(f"{msg} (--rdzv-backend {args.backend})") from None
        raise _Failed(f"cannot reach the {args.backend} store at {where}: {msg}") from None


async def _all_refuse(endpoints: tuple[Endpoint, ...], timeout: float) -> bool:
    """Whether every endpoint refuses a TCP connection (within ``timeout``
    each; an endpoint that does not answer at all is not a refusal)."""
    for e in endpoints:
        try:
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(e.host, e.port)
        except ConnectionRefusedError:
            continue
        except (OSError, TimeoutError):
            return False
        writer.close()
        return False
    return bool(endpoints)


async def _read(store: Store, args: argparse.Namespace, where: str) -> Summary:
    try:
        summary = await _read_job(store, args, where)
    except _StoreLost as exc:
        raise _Failed(str(exc)) from None
    if summary is None:
        raise _Failed(f"no job {args.run_id!r} in the store at {where}")
    return summary


async def _read_job(store: Store, args: argparse.Namespace, where: str) -> Summary | None:
    """The job's summary (None: no such job); _StoreLost when the store does
    not answer, _Failed when its records are broken."""
    try:
        summary = await asyncio.wait_for(read_summary(store, args.run_id), args.timeout)
    except TimeoutError:
        raise _StoreLost(
            f"the {args.backend} store at {where} did not answer within {args.timeout:g} s"
        ) from None
    except (StoreUnavailable, OSError) as exc:
        raise _StoreLost(f"reading job {args.run_id!r} from the store at {where}: {exc}") from None
    except StoreError as exc:
        raise _Failed(f"reading job {args.run_id!r} from the store at {where}: {exc}") from None
    if summary is None:
        return None
    hosts: StoreHosts | None = getattr(args, "store_hosts", None)
    return summary if hosts is None else dataclasses.replace(summary, store_hosts=hosts)


async def _open_candidates(args: argparse.Namespace, endpoints: tuple[Endpoint, ...]) -> Store:
    try:
        store, args.store_hosts = await open_candidates(endpoints, args.options.token, args.timeout)
    except StoreError as exc:
        raise _Failed(str(exc), later=isinstance(exc, HostLost)) from None
    return store


# ---------------------------------------------------------------- watching
async def _next_change(
    changes: asyncio.Queue[WatchEvent | BaseException],
    stopped: asyncio.Task[Any],
    show: Printer,
) -> WatchEvent | BaseException | None:
    """The next change (after a burst: the last of it), or a watch error;
    None once ``stopped`` is done. The display ticks meanwhile."""
    got = asyncio.get_running_loop().create_task(changes.get())
    while not got.done() and not stopped.done():
        await asyncio.wait(
            {got, stopped},
            timeout=TICK if show.ticks else None,
            return_when=asyncio.FIRST_COMPLETED,
        )
        show.tick()
    if not got.done():
        got.cancel()
        return None
    item = got.result()
    await asyncio.sleep(DEBOUNCE)
    while not changes.empty() and not isinstance(item, BaseException):
        item = changes.get_nowait()
    return item


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGINT / SIGTERM while in the block."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` or until ``stop``; whether it was ``stop``."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


@dataclasses.dataclass
class _Watcher:
    """``--watch``: follow the job until it ends or SIGINT / SIGTERM
    (``stop``). What is not there yet (the store, its elected host, the job's
    registration) is waited for: said once each on stderr, then looked for
    every ``RETRY`` s. With candidate hosts, a takeover is followed to the new
    host; any other error ends the watch."""

    args: argparse.Namespace
    where: str
    show: Printer
    stop: asyncio.Event
    last: Summary | None = None  # the summary shown last
    said: set[str] = dataclasses.field(default_factory=set)

    def say(self, what: str, text: str) -> None:
        """A line about the watch itself, once per ``what`` (stderr: stdout is
        the job's, one JSON object per line with ``--json``)."""
        if what not in self.said:
            self.said.add(what)
            print(f"elastrun status: {printable(text)}", file=sys.stderr, flush=True)

    async def run(self) -> int:
        args = self.args
        candidates = len(args.endpoints) > 1 and args.backend is Backend.C10D
        while not self.stop.is_set():
            try:
                store = await _connect(args, self.where)
            except _Failed as exc:
                if not exc.later:
                    raise
                self.say("store", f"waiting for the store ({exc}); Ctrl-C to stop")
                if await _stopped_within(self.stop, RETRY):
                    break
                continue
            try:
                return await self.follow(store)
            except _StoreLost as lost:
                if not candidates:
                    raise _Failed(
                        f"lost the store at {self.where} while watching: {lost}"
                    ) from None
                self.said.discard("lost")
                self.say("lost", f"lost the store's host ({lost}); looking for the new host")
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(store.close(), 2.0)
        return 0  # SIGINT / SIGTERM: the operator is done watching

    async def read(self, store: Store) -> Summary | None:
        """The job's summary; None while it is not registered."""
        summary = await _read_job(store, self.args, self.where)
        if summary is None:
            job = f"job {self.args.run_id!r}"
            self.say("job", f"waiting for {job} to register in the store at {self.where}")
        return summary

    def shown(self, summary: Summary) -> bool:
        """Show ``summary`` if the job changed; whether it has ended."""
        # state_for_s grows with the clock: not a change of the job.
        if self.last is None or summary.quiet() != self.last.quiet():
            self.show(summary)
            self.last = summary
        return summary.state in TERMINAL_STATES

    async def follow(self, store: Store) -> int:
        """Follow the job in ``store`` (waiting for it to register); raise
        _StoreLost when the store is lost."""
        summary = await self.read(store)
        while summary is None:
            if await _stopped_within(self.stop, RETRY):
                return 0
            summary = await self.read(store)
        if self.shown(summary):
            return 0
        try:
            key = Keys(self.args.run_id).root
            watch = await asyncio.wait_for(
                store.watch(key, prefix=True, start_revision=summary.revision + 1),
                self.args.timeout,
            )
        except (TimeoutError, StoreError) as exc:
            raise _StoreLost(f"cannot watch job {self.args.run_id!r}: {exc}") from None
        try:
            return await self._changes(store, watch)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.close(), 2.0)

    async def _changes(self, store: Store, watch: Watch) -> int:
        loop = asyncio.get_running_loop()
        changes: asyncio.Queue[WatchEvent | BaseException] = asyncio.Queue()

        async def drain() -> None:
            try:
                async for ev in watch:
                    changes.put_nowait(ev)
            except StoreError as exc:
                changes.put_nowait(exc)

        pump = loop.create_task(drain())
        stopped = loop.create_task(self.stop.wait())
        try:
            while True:
                item = await _next_change(changes, stopped, self.show)
                if item is None:
                    return 0  # SIGINT / SIGTERM: the operator is done watching
                if isinstance(item, BaseException):
                    raise _StoreLost(str(item))
                summary = await self.read(store)
                if summary is not None and self.shown(summary):
                    return 0
        finally:
            stopped.cancel()
            pump.cancel()


async def _connect(args: argparse.Namespace, where: str) -> Store:
    if len(args.endpoints) > 1 and args.backend is Backend.C10D:
        return await _open_candidates(args, args.endpoints)
    return await _open(args, args.endpoints, args.https, where)


async def _main(args: argparse.Namespace) -> int:
    where = format_endpoints(args.endpoints)
    show = Printer(args, where)
    if args.watch and args.clear_quarantine is None:
        with _stop_on_signals() as stop:
            return await _Watcher(args, where, show, stop).run()
    store = await _connect(args, where)
    try:
        if args.clear_quarantine is not None:
            return await _clear(store, args, where)
        show(await _read(store, args, where))
        return 0
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(store.close(), 2.0)


async def _clear(store: Store, args: argparse.Namespace, where: str) -> int:
    """``--clear-quarantine HOST``: remove HOST's quarantine record."""
    host: str = args.clear_quarantine
    shown = printable(repr(host[:256]))
    try:
        async with asyncio.timeout(args.timeout):
            cleared = await quarantine.clear(store, Keys(args.run_id), host)
    except (TimeoutError, StoreError) as exc:
        raise _Failed(f"clearing the quarantine of {shown} at {where}: {exc}") from None
    if cleared:
        print(f"elastrun status: the quarantine of node {shown} is cleared; it may join again")
    else:
        print(f"elastrun status: node {shown} is not quarantined in job {args.run_id!r}")
    return 0


def _timeout(text: str) -> float:
    """``--timeout``: ASCII seconds, more than 0 and at most an hour."""
    value = ascii_decimal(text)
    if value is None or not 0 < value <= MAX_TIMEOUT:
        raise ConfigError(
            f"--timeout: must be > 0 and <= {MAX_TIMEOUT:g} seconds (ASCII digits), "
            f"got {printable(repr(text[:64]))}"
        )
    return value


def _backend(text: str) -> Backend:
    """``--rdzv-backend``: a backend that keeps a store."""
    backend = Backend.parse(text)
    if backend is Backend.STATIC:
        raise ConfigError("--rdzv-backend static keeps no store: there is no job state to show")
    return backend


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse printed the usage and the problem
        return exc.code if isinstance(exc.code, int) else 2
    try:  # the same job-id grammar as the launcher's
        args.timeout = _timeout(args.timeout)
        args.backend = _backend(args.backend)
        args.run_id = RunId.parse(args.run_id, "--rdzv-id")
        args.endpoints, args.https = _endpoints(args.backend, args.endpoint)
        args.options = _options(args.conf, args.backend)  # its errors before any connection
    except ConfigError as exc:
        print(f"elastrun status: error: {printable(exc)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args))
    except _Failed as exc:
        print(f"elastrun status: error: {printable(exc)}", file=sys.stderr, flush=True)
        return exc.code
    except ConfigError as exc:
        print(f"elastrun status: error: {printable(exc)}", file=sys.stderr, flush=True)
        return 2
    except (ElastrunError, StoreUnavailable) as exc:
        print(f"elastrun status: error: {printable(exc)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
