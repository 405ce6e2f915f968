"""One agent's event file (docs/events.md): where it is, and the log that
writes the rendezvous' and the agent's events into it, tagged with their
source and the run's common fields."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from elastrun.agent.log_dirs import open_event_log, run_dir
from elastrun.errors import ConfigError
from elastrun.event_kinds import Event
from elastrun.events import EventSink, JsonLinesSink
from elastrun.launcher.plan import Plan
from elastrun.names import path_component

__all__ = ["EventLog", "events_path"]


def events_path(plan: Plan, host: str) -> str | None:
    """The agent's event log: ``--events-file``, else
    ``{log_dir}/{run_id}/events-{host}.jsonl`` with ``--log-dir`` (its run
    folder made here, private: see :func:`elastrun.agent.log_dirs.run_dir`; a
    refused one is a ConfigError), else none."""
    spec = plan.workers
    if spec.events_file:
        return spec.events_file
    if spec.logs.dir:
        name = path_component(host, "unknown-host")
        try:
            folder = run_dir(spec.logs.dir, plan.run_id)
        except OSError as e:
            raise ConfigError(
                f"cannot open the event log in {spec.logs.dir}: {e.strerror or e}"
            ) from None
        return os.path.join(folder, f"events-{name}.jsonl")
    return None


class EventLog:
    """One agent's event file (docs/events.md): the rendezvous' and the agent's
    events in one JSON-lines file, each with the common fields (run_id, host,
    node_id once known) and its ``source``. The caller's own sink (the Python
    API's) gets the same events, untouched."""

    def __init__(self, path: str | None, user: EventSink | None, flag: str, **common: Any) -> None:
        self.user = user
        self.common: dict[str, Any] = dict(common)
        self.file: JsonLinesSink | None = None
        if path:
            self.file = open_event_log(path, flag)

    def sink(self, source: str) -> EventSink | None:
        return self.user if self.file is None else _Tagged(self, source)

    def emit(self, source: str, event: Event) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError, ValueError):
                self.file.write(event.KIND, {**self.common, "source": source, **event.to_json()})

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


class _Tagged:
    def __init__(self, log: EventLog, source: str) -> None:
        self.log, self.source = log, source

    def emit(self, event: Event) -> None:
        if self.log.user is not None:
            self.log.user.emit(event)
        self.log.emit(self.source, event)
