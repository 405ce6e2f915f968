"""Worker logs: per-attempt files, redirects/tee, prefixed console streaming.

Both pipes of every worker are read by the agent as data arrives (asyncio
streams; workers run with ``PYTHONUNBUFFERED=1`` unless the user set it), so
console lines appear when the worker writes them. Per local rank and stream:

* file: ``{log_dir}/{run_id}/{host}/attempt_{n}/{local_rank}/stdout.log|stderr.log``,
  written whenever ``--log-dir`` is given (so a failure summary can always
  point at the full log), or in a kept temporary folder when ``--redirects``
  or ``--tee`` ask for files and no ``--log-dir`` was given (as torchrun);
* console: unless redirected (``--redirects`` without ``--tee`` for that
  stream), and only for ranks in ``--local-ranks-filter`` when given; each
  line is prefixed by ``WorkerSpec.logs.template`` and ``": "``. With torch's
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` instead
  (``WorkerSpec.logs.torch_template``), lines are shown as torchrun shows them:
  the template's text, verbatim, before each line of a ``--tee``'d stream,
  and other streams' lines as the worker wrote them;
* one prefix per line: torch prefixes the lines of an uncaught exception with
  ``[rank{R}]: `` once the process group exists; where our prefix already
  shows the rank, that copy is dropped on the console (files keep every byte);
* tails: the last lines of every rank's stderr and stdout are always kept in
  memory for the failure summary, whatever the redirects;
* duplicated lines (``--duplicate-stdout-filters`` / ``--duplicate-stderr-filters``,
  as torchrun): the lines of ``--tee``'d streams that contain one of the
  texts are also appended, with their console prefix, to
  ``filtered_stdout.log`` / ``filtered_stderr.log`` in the attempt's folder
  (:class:`FilteredCopy`, one per stream and attempt).

Folders are made private and without following links by agent/log_dirs.py.
Log files are opened to append with no link followed and never a FIFO
(:func:`elastrun.safefs.append_fd`).

A log file that cannot be written (a full disk, a read-only or vanished
folder) never stops the pump: the console and the tail go on, and
:class:`LogWriteErrors` says so once per file (a console warning naming the
file and the error, at most ``MAX_LOG_WARNINGS`` lines per agent, and a
``log_write_failed`` event), then counts the bytes that did not reach it
(``log_output_lost`` when the stream ends).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import re
import string
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO, TextIO

from elastrun.agent.spec import Std, WorkerSpec
from elastrun.errors import ConfigError
from elastrun.event_kinds import LogOutputLost, LogWriteFailed
from elastrun.events import EventSink
from elastrun.frozen import frozen
from elastrun.procs import say
from elastrun.safefs import (
    append_fd,
)

__all__ = [
    "FilteredCopy",
    "LinePump",
    "LogWriteErrors",
    "StreamRoute",
    "format_prefix",
    "routes_for",
    "shows_rank",
    "std_flags",
    "torch_prefix",
    "torch_rank_tag",
    "validate_template",
]

CHUNK = 65536
MAX_PARTIAL = 65536  # a "line" longer than this is emitted in pieces
MAX_TAIL_LINE = 4000
TAIL_LINES = 20
MAX_LOG_WARNINGS = 8  # console lines about unwritable log files, per agent
FILE_MODE = 0o666  # as open() makes files (less the umask); their folders are private


def std_flags(mapping: Mapping[int, Std], local_rank: int) -> Std:
    """Std flags for one local rank (a key of -1 applies to every rank)."""
    if local_rank in mapping:
        return mapping[local_rank]
    return mapping.get(-1, Std.NONE)


def torch_prefix(template: str, *, role: str, rank: int, local_rank: int) -> str:
    """torch's line prefix: ``${role_name}``, ``${rank}`` and ``${local_rank}``
    substituted (anything else left as written), used verbatim."""
    return string.Template(template).safe_substitute(
        role_name=role, rank=str(rank), local_rank=str(local_rank)
    )


def shows_rank(template: str) -> bool:
    """Whether a prefix made from ``template`` names the global rank."""
    return bool(re.search(r"\{rank\}|\$rank\b|\$\{rank\}", template))


def torch_rank_tag(rank: int) -> str:
    """What torch writes before each line of an uncaught exception's report."""
    return f"[rank{rank}]: "


def format_prefix(template: str, **fields: object) -> str:
    """Fill the console prefix template. ``{rank}`` (str.format) and torchrun's
    ``${rank}`` (string.Template) spellings are both accepted."""
    if not template:
        return ""
    if "$" in template:
        return string.Template(template).safe_substitute({k: str(v) for k, v in fields.items()})
    return template.format(**fields)


TEMPLATE_FIELDS = ("host", "rank", "local_rank", "role", "group_rank", "restart")


def validate_template(template: str) -> None:
    """``--log-template``: a template :func:`format_prefix` can fill (checked
    by the launcher, once). Raises ConfigError naming the flag and the fields."""
    try:
        format_prefix(template, host="h", rank=0, local_rank=0, role="r", group_rank=0, restart=0)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"--log-template: {template!r} is not a valid template ({e}); fields: "
            + ", ".join("{" + k + "}" for k in TEMPLATE_FIELDS)
        ) from None


class FilteredCopy:
    """``filtered_{stream}.log`` of one attempt: the lines that contain one
    of ``filters``. Opened at the first such line (the attempt's folder
    exists by then), without following a link, never a FIFO; a file that
    cannot be written is reported once, as any log file."""

    def __init__(
        self, path: str, filters: tuple[str, ...], errors: LogWriteErrors | None = None
    ) -> None:
        self.path = path
        self.filters = filters
        self._errors = errors if errors is not None else LogWriteErrors()
        self._file: BinaryIO | None = None
        self._failed = False

    def line(self, text: str, prefix: str) -> None:
        if not any(f in text for f in self.filters):
            return
        data = (prefix + text).encode("utf-8", errors="replace")
        if self._file is None and not self._failed:
            try:
                self._file = os.fdopen(append_fd(self.path, FILE_MODE), "ab", buffering=0)
            except OSError as e:
                self._failed = True
                self._errors.report(self.path, e, console=True)
        if self._file is None:
            self._errors.count_lost(self.path, len(data))
            return
        try:
            self._file.write(data)
        except OSError as e:
            self._errors.report(self.path, e, console=True)
            self._errors.count_lost(self.path, len(data))

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


@frozen
class StreamRoute:
    """Where one stream of one worker goes."""

    name: str  # "stdout" | "stderr"
    file_path: str | None
    console: bool
    prefix: str  # written before each console line, as is ("" for none)
    keep_tail: bool = True
    # torch's "[rank{R}]: " tag of this worker: dropped from the start of tail
    # lines, and of console lines when ``prefix`` already names the rank.
    rank_tag: str = ""
    console_drops_tag: bool = False
    # Lines that contain a --duplicate-*-filters text are also copied here.
    copy: FilteredCopy | None = None


def routes_for(
    spec: WorkerSpec,
    attempt_dir: str | None,
    local_rank: int,
    *,
    rank: int,
    group_rank: int = 0,
    restart: int = 0,
    copies: Mapping[str, FilteredCopy] | None = None,
) -> tuple[StreamRoute, StreamRoute]:
    """(stdout, stderr) routes of one worker (global rank ``rank``).
    ``attempt_dir`` is None when no files are kept at all for this attempt;
    ``copies``: the attempt's filtered copy of each stream, for its tee'd ranks."""
    redirect = std_flags(spec.logs.redirects, local_rank)
    tee = std_flags(spec.logs.tee, local_rank)
    shown = spec.logs.local_ranks_filter is None or local_rank in spec.logs.local_ranks_filter
    torch_style = spec.logs.torch_template is not None
    if spec.logs.torch_template is not None:
        ours = torch_prefix(
            spec.logs.torch_template, role=spec.role, rank=rank, local_rank=local_rank
        )
        template = spec.logs.torch_template
    else:
        ours = format_prefix(
            spec.logs.template,
            host=spec.host,
            rank=rank,
            local_rank=local_rank,
            role=spec.role,
            group_rank=group_rank,
            restart=restart,
        )
        ours = f"{ours}: " if ours else ""
        template = spec.logs.template
    out: list[StreamRoute] = []
    for name, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
        wants_file = bool((redirect | tee) & bit) or spec.logs.dir is not None
        path = None
        if wants_file and attempt_dir is not None:
            path = os.path.join(attempt_dir, str(local_rank), f"{name}.log")
        console = shown and (not (redirect & bit) or bool(tee & bit))
        # torchrun prefixes only the streams it tees; the others reach the
        # console as the worker wrote them.
        prefix = ours if not torch_style or tee & bit else ""
        drops = bool(prefix) and shows_rank(template)
        copy = (copies or {}).get(name) if tee & bit else None
        out.append(
            StreamRoute(
                name,
                path,
                console,
                prefix,
                rank_tag=torch_rank_tag(rank),
                console_drops_tag=drops,
                copy=copy,
            )
        )
    return out[0], out[1]


def needs_files(spec: WorkerSpec) -> bool:
    """Whether any file is written (--log-dir, or redirects/tee asking for files)."""
    if spec.logs.dir is not None:
        return True
    return any(v for v in spec.logs.redirects.values()) or any(v for v in spec.logs.tee.values())


@dataclass
class LogWriteErrors:
    """The worker log files of one agent that could not be written: warned
    about once each (at most ``MAX_LOG_WARNINGS`` console lines), reported
    as events, and the bytes that did not reach them counted."""

    events: EventSink | None = None
    say: Callable[[str], None] = say
    failed: dict[str, str] = field(default_factory=dict)  # path -> the first error
    lost: dict[str, int] = field(default_factory=dict)  # path -> bytes not written
    shown: int = 0

    @property
    def any(self) -> bool:
        return bool(self.failed)

    def report(
        self,
        path: str,
        error: OSError,
        *,
        rank: int | None = None,
        local_rank: int | None = None,
        stream: str | None = None,
        console: bool = True,
        fate: str = "",
    ) -> None:
        """The first failure of ``path`` (later ones of the same file are
        silent). ``fate``: what happens instead (for a stream: said here)."""
        if path in self.failed:
            return
        why = error.strerror or str(error)
        self.failed[path] = why
        if self.events is not None:
            self.events.emit(
                LogWriteFailed(
                    path=path,
                    error=why,
                    errno=error.errno,
                    rank=rank,
                    local_rank=local_rank,
                    stream=stream,
                )
            )
        if self.shown < MAX_LOG_WARNINGS:
            where = f" (rank {rank} {stream})" if rank is not None and stream else ""
            if not fate:
                fate = (
                    "the console still shows it"
                    if console
                    else "that output is lost (--redirects sends it to the file only)"
                )
            self.say(f"elastrun: warning: cannot write {path}{where}: {why}; {fate}")
        elif self.shown == MAX_LOG_WARNINGS:
            self.say(
                "elastrun: warning: more log files cannot be written; not shown "
                "(see log_write_failed in the event log)"
            )
        self.shown += 1

    def summary(self) -> str:
        """One line: what did not reach the log files."""
        first, why = next(iter(self.failed.items()))
        return (
            f"the workers succeeded, but not all of their output reached its log files "
            f"({len(self.failed)} failed, {sum(self.lost.values())} bytes lost; first: "
            f"{first}: {why})"
        )

    def count_lost(self, path: str, n: int) -> None:
        self.lost[path] = self.lost.get(path, 0) + n

    def closed(self, path: str, rank: int | None, stream: str | None) -> None:
        """A stream ended: report the bytes its file missed, if any."""
        n = self.lost.get(path, 0)
        if n and self.events is not None:
            self.events.emit(
                LogOutputLost(
                    path=path, bytes=n, error=self.failed.get(path, ""), rank=rank, stream=stream
                )
            )


class LinePump:
    """Copies one worker pipe to its file and, line by line, to the console."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        route: StreamRoute,
        errors: LogWriteErrors | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        *,
        order: Iterator[int] | None = None,
    ) -> None:
        self.reader = reader
        self.route = route
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        # Each tail line's place among the worker's lines of both streams
        # (``order``: shared by its two pumps), for the summary's last output.
        self._order = order if order is not None else itertools.count()
        self.tail_order: collections.deque[int] = collections.deque(maxlen=TAIL_LINES)
        self._partial = b""
        self._file: BinaryIO | None = None
        self._errors = errors if errors is not None else LogWriteErrors()
        self._rank, self._local_rank = rank, local_rank
        self._closed = False
        if route.file_path is not None:
            # The folder is the worker group's (private, made before the
            # worker started); no link is followed, a FIFO never blocks.
            try:
                fd = append_fd(route.file_path, FILE_MODE)
                self._file = os.fdopen(fd, "ab", buffering=0)
            except OSError as e:
                self._failed(e)

    def _failed(self, error: OSError) -> None:
        assert self.route.file_path is not None
        self._errors.report(
            self.route.file_path,
            error,
            rank=self._rank,
            local_rank=self._local_rank,
            stream=self.route.name,
            console=self.route.console,
        )

    async def run(self) -> None:
        try:
            while True:
                data = await self.reader.read(CHUNK)
                if not data:
                    break
                self._take(data)
        finally:
            if self._partial:
                self._line(self._partial)
                self._partial = b""
            self.close()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self.route.file_path is not None and not self._closed:
            self._closed = True
            self._errors.closed(self.route.file_path, self._rank, self.route.name)

    def _write(self, data: bytes) -> None:
        """All of ``data`` to the file (a raw write may take only part of it);
        what a failing disk refuses is counted as lost. The pump goes on: the
        console and the tail do not depend on the disk."""
        path = self.route.file_path
        if path is None:
            return
        if self._file is None:
            self._errors.count_lost(path, len(data))
            return
        view, written = memoryview(data), 0
        try:
            while written < len(data):
                n = self._file.write(view[written:])
                if not n:
                    raise OSError(0, "the write made no progress")
                written += n
        except OSError as e:
            self._failed(e)
            self._errors.count_lost(path, len(data) - written)

    def _take(self, data: bytes) -> None:
        self._write(data)
        buf = self._partial + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            self._line(line + b"\n")
        while len(rest) > MAX_PARTIAL:
            self._line(rest[:MAX_PARTIAL] + b"\n")
            rest = rest[MAX_PARTIAL:]
        self._partial = rest

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace")
        tag = self.route.rank_tag
        bare = text[len(tag) :] if tag and text.startswith(tag) else text
        if self.route.keep_tail:
            self.tail.append(bare.rstrip("\r\n")[:MAX_TAIL_LINE])
            self.tail_order.append(next(self._order))
        if self.route.copy is not None:
            self.route.copy.line(text if text.endswith("\n") else text + "\n", self.route.prefix)
        if self.route.console:
            if self.route.console_drops_tag:
                text = bare
            if not text.endswith("\n"):
                text += "\n"
            stream: TextIO = sys.stdout if self.route.name == "stdout" else sys.stderr
            try:
                stream.write(self.route.prefix + text)
                stream.flush()
            except (OSError, ValueError):
                pass  # console gone (closed pipe): keep pumping into the file
