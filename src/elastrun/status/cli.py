"""``elastrun status``: a job's round, members, restarts and last failure, read
from its store.

    elastrun status --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID
                    [--json] [--watch] [--rdzv-conf k=v,...] [--timeout S]

``--json`` prints the summary as one JSON object (stable keys, see
docs/events.md); with ``--watch`` one object per line, each time the job
changes. ``--watch`` follows the job with a store watch on its prefix (no
polling) until the job finishes or fails, or until SIGINT / SIGTERM; its table
is redrawn in place on a terminal, and printed as the lines that changed
when the output is a file or a pipe (see :class:`Printer`).

Exit codes: 0 shown; 1 no such job, store unreachable or broken records;
2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import json
import math
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from elastrun.endpoint import Endpoint, format_endpoints, parse_endpoint_list
from elastrun.errors import ConfigError, ElastrunError, StoreError, StoreUnavailable
from elastrun.names import RunId
from elastrun.rendezvous.keys import Keys
from elastrun.status.hosts import open_candidates
from elastrun.status.model import TERMINAL_STATES, HangStacks, RankRow, StoreHosts, Summary
from elastrun.status.summary import read_summary
from elastrun.store.base import Store, Watch, WatchEvent
from elastrun.store.factory import DEFAULT_ETCD_PORT, DEFAULT_PORT
from elastrun.store.token import store_token
from elastrun.untrusted import printable

__all__ = ["Printer", "main", "render_table"]

DEFAULT_TIMEOUT = 10.0
PROBE_TIMEOUT = 2.0  # one TCP connection to each endpoint before the store's own retries
DEBOUNCE = 0.05  # gather a burst of store changes into one refresh
TICK = 1.0  # a live table on a terminal is refreshed this often
STORE_CONF_KEYS = ("cacert", "cert", "key", "user", "password", "key_prefix", "protocol")
KNOWN_CONF = frozenset((*STORE_CONF_KEYS, "token", "token_file"))
MAX_FIELD = 500  # characters of one string of the summary shown in the table


class _Failed(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


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
        "password, key_prefix, protocol (other launcher keys are ignored)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (one object per line)")
    p.add_argument(
        "--watch",
        action="store_true",
        help="follow the job: print again on every change, until it ends",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"give up reaching the store after S seconds (default {DEFAULT_TIMEOUT:g})",
    )
    return p


def _conf(text: str, backend: str = "c10d") -> tuple[str | None, dict[str, str]]:
    """``--rdzv-conf`` -> (the store's token, etcd's options). The token, as
    the launcher's: ``token`` or ``token_file``, else ELASTRUN_STORE_TOKEN or
    ELASTRUN_STORE_TOKEN_FILE (the embedded store only)."""
    token: str | None = None
    token_file: str | None = None
    conf: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf: {item!r} is not key=value")
        if key == "token":
            token = value
        elif key == "token_file":
            token_file = value
        elif key in STORE_CONF_KEYS:
            conf[key] = value
        # Any other launcher key (join_timeout, is_host, ...) is irrelevant here:
        # accepted so that a job's --rdzv-conf can be pasted as is.
    environ: dict[str, str] | None = None if backend in ("c10d", "tcp") else {}
    return store_token(token, token_file, environ).token, conf


def _endpoints(backend: str, text: str) -> tuple[tuple[Endpoint, ...], bool]:
    """``--rdzv-endpoint`` for ``backend``: the store's one endpoint, or etcd's
    members (and whether one of them said ``https://``)."""
    if backend in ("etcd", "etcd-v2"):
        return parse_endpoint_list(text, DEFAULT_ETCD_PORT, "--rdzv-endpoint")
    if "," in text:  # the store's candidate hosts
        return parse_endpoint_list(text, DEFAULT_PORT, "--rdzv-endpoint")[0], False
    return (Endpoint.parse(text, DEFAULT_PORT, "--rdzv-endpoint"),), False


async def _open(
    args: argparse.Namespace, endpoints: tuple[Endpoint, ...], https: bool, where: str
) -> Store:
    from elastrun.store.factory import open_store

    token, conf = _conf(args.conf, args.backend)
    if https:
        conf.setdefault("protocol", "https")
    if await _all_refuse(endpoints, min(args.timeout, PROBE_TIMEOUT)):
        # Nothing listens: a store that is gone (its job over), or a wrong
        # endpoint. Said at once, not after --timeout of retries.
        raise _Failed(
            f"nothing listens at {where} (connection refused): the job's store is gone (the "
            "job ended, or the node that hosted it), or the endpoint is wrong"
        )
    try:
        return await asyncio.wait_for(
            open_store(args.backend, endpoints, token=token, conf=conf, timeout=args.timeout),
            args.timeout + 1.0,
        )
    except TimeoutError:
        raise _Failed(
            f"cannot reach the {args.backend} store at {where} within {args.timeout:g} s "
            "(--timeout)"
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
        summary = await asyncio.wait_for(read_summary(store, args.run_id), args.timeout)
    except TimeoutError:
        raise _Failed(
            f"the {args.backend} store at {where} did not answer within {args.timeout:g} s"
        ) from None
    except StoreError as exc:
        raise _Failed(f"reading job {args.run_id!r} from the store at {where}: {exc}") from None
    if summary is None:
        raise _Failed(f"no job {args.run_id!r} in the store at {where}")
    hosts: StoreHosts | None = getattr(args, "store_hosts", None)
    return summary if hosts is None else dataclasses.replace(summary, store_hosts=hosts)


async def _open_candidates(args: argparse.Namespace, endpoints: tuple[Endpoint, ...]) -> Store:
    token, _ = _conf(args.conf, args.backend)
    try:
        store, args.store_hosts = await open_candidates(endpoints, token, args.timeout)
    except StoreError as exc:
        raise _Failed(str(exc)) from None
    return store


# ---------------------------------------------------------------- rendering
def fmt_duration(seconds: float) -> str:
    """``12s``, ``3m04s``, ``2h05m``, ``3d04h``."""
    n = int(max(0.0, seconds))
    if n < 60:
        return f"{n}s"
    if n < 3600:
        return f"{n // 60}m{n % 60:02d}s"
    if n < 86400:
        return f"{n // 3600}h{n % 3600 // 60:02d}m"
    return f"{n // 86400}d{n % 86400 // 3600:02d}h"


def _p(value: object) -> str:
    """``value`` made safe for a terminal (one line, control characters
    escaped, at most ``MAX_FIELD`` characters): the summary holds what other
    nodes, or anyone who reached the store, wrote."""
    return printable(value, limit=MAX_FIELD)


def _opt(value: object, none: str = "?") -> str:
    return none if value is None else _p(value)


def render_table(summary: Summary, where: str) -> str:
    """The summary as a human-readable block of text (every string from the
    store escaped for the terminal)."""
    s = summary
    out = [f"job {_p(s.run_id)}  (store {printable(where)}, revision {s.revision})"]
    rnd = _opt(s.round, "-")
    why = f" (opened: {_p(s.round_reason)}" if s.round_reason else ""
    if why:
        why += f": {_p(s.round_detail)})" if s.round_detail else ")"
    for_ = f" for {fmt_duration(s.state_for_s)}" if s.state_for_s is not None else ""
    out.append(f"state     {s.state}{for_}, round {rnd}{why}")
    out.append(f"restarts  {s.restarts} of {_opt(s.max_restarts)}")
    if s.store_hosts is not None:
        out.append(printable(f"store     {s.store_hosts.describe()}"))
    unit = f", node unit {s.node_unit}" if s.node_unit > 1 else ""
    spares = f", {len(s.spares)} spare{'' if len(s.spares) == 1 else 's'}" if s.spares else ""
    out.append(
        f"nodes     {len(s.members)} in the group (min {_opt(s.min_nodes, 'None')}, "
        f"max {_opt(s.max_nodes, 'None')}{unit}), {s.nodes_present} present{spares}; "
        f"world size {s.world_size}"
    )
    if s.master:
        out.append(f"master    {_p(s.master)}")
    if s.members:
        label = "members" if s.members_round == s.round else "members of the last round"
        out.append(f"\n{label} (round {s.members_round}):")
        rows = [("GROUP_RANK", "HOST", "ADDR", "NPROC", "STATUS", "NODE")]
        rows += [
            (str(m.group_rank), _p(m.host), _p(m.addr), str(m.nproc), m.status, _p(m.node_id))
            for m in s.members
        ]
        out.extend(_table(rows))
    if s.joined:
        joined = ", ".join(f"{_p(j.host)} ({_p(j.node_id)})" for j in s.joined)
        out.append(f"\njoined round {rnd}: {joined}")
    if s.spares:
        out.append("spares: " + ", ".join(f"{_p(w.host)} ({_p(w.node_id)})" for w in s.spares))
    elif s.waiting:
        out.append("waiting: " + ", ".join(f"{_p(w.host)} ({_p(w.node_id)})" for w in s.waiting))
    out.extend(_ranks_block(s.ranks))
    failure = s.last_failure
    # The one wording of a failure (FailureRecord.describe), with its time and message.
    line = printable(failure.describe(detailed=True), limit=2 * MAX_FIELD) if failure else "none"
    out.append("\nlast failure: " + line)
    out.extend(_stacks_block(s.hang_stacks))
    return "\n".join(out)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _ranks_block(ranks: Sequence[RankRow]) -> list[str]:
    """Per-rank step times (reported every few seconds by each agent)."""
    if not ranks:
        return []
    rows = [("RANK", "HOST", "STEP", "STEP_TIME", "OWN_TIME", "IDLE", "")]
    for r in ranks:
        note = "STRAGGLER" if r.straggler else (f"in {_p(r.phase)}" if r.phase else "")
        rows.append(
            (
                str(r.rank),
                _p(r.host or "?"),
                _opt(r.step, "-"),
                _ms(r.step_time_s),
                _ms(r.own_time_s),
                "-" if r.idle_s is None else fmt_duration(r.idle_s),
                note,
            )
        )
    title = (
        "\nranks (medians of the recent optimizer steps; own time: outside backward passes, "
        "where DDP waits for the slowest rank):"
    )
    return [title, *_table(rows)]


def _stacks_block(stacks: HangStacks | None) -> list[str]:
    """Where each rank sat when the last hang was declared."""
    if stacks is None or not stacks.ranks:
        return []
    out = [f"\nstacks at the last hang (round {stacks.round}), stuck ranks first:"]
    for r in stacks.ranks:
        role = "waiting in torch" if r.in_torch else "stuck in its own code"
        where = _p(r.frames[0]) if r.frames else "(no Python frame)"
        out.append(f"  rank {r.rank} on {_p(r.host or '?')} [{role}] sits in {where}")
    return out


class Printer:
    """Prints summaries: once, or for ``--watch`` each change.

    ``--json``: one object per line. A table on a terminal is redrawn in place
    (cursor moved back over the previous drawing, each line rewritten), and
    refreshed each second so that durations keep counting; a table into a
    file or pipe is printed once in full, then only the lines that changed,
    under a time stamp (``+`` new, ``-`` gone)."""

    def __init__(
        self,
        args: argparse.Namespace,
        where: str,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ) -> None:
        self.json = bool(args.json)
        self.watch = bool(args.watch)
        self.where = where
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._drawn_rows = 0
        self._last_lines: list[str] | None = None
        self._last: Summary | None = None
        self._last_at = 0.0

    @property
    def ticks(self) -> bool:
        """Whether the display wants a refresh each second (a live table)."""
        return self.watch and self.tty and not self.json

    def __call__(self, summary: Summary) -> None:
        self._last, self._last_at = summary, time.monotonic()
        if self.json:
            self._write(json.dumps(summary.to_json(), sort_keys=True) + "\n")
        elif not self.watch:
            self._write(render_table(summary, self.where) + "\n")
        elif self.tty:
            self._redraw(render_table(summary, self.where))
        else:
            self._changes(summary)

    def tick(self) -> None:
        """Redraw the last summary with its durations advanced (terminal only)."""
        if not self.ticks or self._last is None:
            return
        since = self._last.state_for_s
        if since is not None:
            aged = dataclasses.replace(
                self._last, state_for_s=since + time.monotonic() - self._last_at
            )
            self._redraw(render_table(aged, self.where))

    def _redraw(self, text: str) -> None:
        cols, rows = shutil.get_terminal_size((80, 24))
        lines = text.splitlines()
        height = sum(max(1, math.ceil(len(ln) / max(cols, 1))) for ln in lines)
        out = ""
        if self._drawn_rows and self._drawn_rows < rows:
            out = f"\x1b[{self._drawn_rows}F"  # back to the start of the drawing
        elif self._drawn_rows:
            out = "\x1b[H\x1b[2J"  # taller than the screen: start over at the top
        out += "".join(f"\x1b[2K{ln}\n" for ln in lines) + "\x1b[J"
        self._drawn_rows = height
        self._write(out)

    def _changes(self, summary: Summary) -> None:
        # Compared without what changes by itself (durations, the revision).
        lines = render_table(summary.quiet(), self.where)
        now = lines.splitlines()
        before, self._last_lines = self._last_lines, now
        if before is None:
            self._write(render_table(summary, self.where) + "\n")
            return
        diff = [
            ln[0] + " " + ln[2:]
            for ln in difflib.ndiff(before, now)
            if ln[:1] in "+-" and ln[2:].strip()
        ]
        if not diff:
            return
        stamp = time.strftime("%H:%M:%S")
        self._write(f"--- {stamp} (revision {summary.revision})\n" + "\n".join(diff) + "\n")

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()


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


async def _watch(store: Store, args: argparse.Namespace, where: str, show: Printer) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    changes: asyncio.Queue[WatchEvent | BaseException] = asyncio.Queue()
    watch: Watch | None = None
    pump: asyncio.Task[None] | None = None

    async def drain(w: Watch) -> None:
        try:
            async for ev in w:
                changes.put_nowait(ev)
        except StoreError as exc:
            changes.put_nowait(exc)

    try:
        last = await _read(store, args, where)
        show(last)
        if last.state in TERMINAL_STATES:
            return 0
        try:
            watch = await asyncio.wait_for(
                store.watch(Keys(args.run_id).root, prefix=True, start_revision=last.revision + 1),
                args.timeout,
            )
        except (TimeoutError, StoreError) as exc:
            raise _Failed(
                f"cannot watch job {args.run_id!r} in the store at {where}: {exc}"
            ) from None
        pump = loop.create_task(drain(watch))
        stopped = loop.create_task(stop.wait())
        try:
            while True:
                item = await _next_change(changes, stopped, show)
                if item is None:
                    return 0  # SIGINT / SIGTERM: the operator is done watching
                if isinstance(item, BaseException):
                    raise _Failed(f"lost the store at {where} while watching: {item}")
                summary = await _read(store, args, where)
                # state_for_s grows with the clock: not a change of the job.
                if summary.quiet() != last.quiet():
                    show(summary)
                    last = summary
                if last.state in TERMINAL_STATES:
                    return 0
        finally:
            stopped.cancel()
    finally:
        if pump is not None:
            pump.cancel()
        if watch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.close(), 2.0)
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _main(args: argparse.Namespace) -> int:
    if args.backend.strip().lower() == "static":
        raise ConfigError("--rdzv-backend static keeps no store: there is no job state to show")
    endpoints, https = _endpoints(args.backend.strip().lower(), args.endpoint)
    where = format_endpoints(endpoints)
    if len(endpoints) > 1 and args.backend.strip().lower() in ("c10d", "tcp"):
        store = await _open_candidates(args, endpoints)
    else:
        store = await _open(args, endpoints, https, where)
    try:
        show = Printer(args, where)
        if args.watch:
            return await _watch(store, args, where, show)
        show(await _read(store, args, where))
        return 0
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(store.close(), 2.0)


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse printed the usage and the problem
        return exc.code if isinstance(exc.code, int) else 2
    if not args.timeout > 0:
        print("elastrun status: error: --timeout must be > 0", file=sys.stderr)
        return 2
    try:  # the same job-id grammar as the launcher's
        args.run_id = RunId.parse(args.run_id, "--rdzv-id")
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
