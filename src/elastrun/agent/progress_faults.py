"""Progress the agent cannot see, said once.

Two faults reach the agent (agent/watchdog.py has the rules they feed):

* a worker's runner could not write its progress file (a full disk, a
  read-only or unwritable folder) and said so on its channel: event
  ``progress_write_failed``;
* the hang watchdog could not judge a rank whose timeout expired, because
  its progress is unknown (its file unreadable, gone, or in a folder that
  cannot take a write, with nothing relayed over a channel): event
  ``progress_unknown``.

Each is an event once per rank and attempt, and a console line once per
agent run (a full disk is one fault, not one per rank and restart). The
events have the details of the ranks after the first. Text that came from a
worker is made safe for a terminal and bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from elastrun.event_kinds import ProgressUnknown, ProgressWriteFailed
from elastrun.events import EventSink
from elastrun.procs import say
from elastrun.untrusted import printable

__all__ = ["MAX_ERROR_CHARS", "ProgressFaults"]

MAX_ERROR_CHARS = 300  # of an error a worker sent


@dataclass
class ProgressFaults:
    """One agent's progress faults: events per rank and attempt, one console line each kind."""

    events: EventSink
    say: Callable[[str], None] = say
    _seen: set[tuple[str, int, int]] = field(default_factory=set)  # (kind, attempt, rank)
    _said: set[str] = field(default_factory=set)

    def write_failed(
        self,
        *,
        rank: int,
        local_rank: int,
        attempt: int,
        round_: int,
        path: str | None,
        error: object,
        relayed: bool,
        watched: bool,
    ) -> None:
        """The worker's runner could not write its progress file. ``relayed``:
        its progress comes over its channel; ``watched``: a hang watchdog runs."""
        if not self._first("progress_write_failed", attempt, rank):
            return
        why = printable(error, limit=MAX_ERROR_CHARS)
        self.events.emit(
            ProgressWriteFailed(
                rank=rank,
                local_rank=local_rank,
                path=path,
                error=why,
                relayed=relayed,
                round=round_,
                attempt=attempt,
            )
        )
        if watched and "write" not in self._said:
            self._said.add("write")
            how = (
                "the hang watchdog judges it from the progress its runner sends over its channel"
                if relayed
                else "the hang watchdog cannot judge it"
            )
            self.say(
                f"elastrun: warning: rank {rank}'s progress file {path} is not recorded: "
                f"{why}; {how} (other ranks: event progress_write_failed)"
            )

    def unknown(self, *, rank: int, local_rank: int, attempt: int, round_: int, why: str) -> None:
        """The watchdog did not judge a rank whose progress it cannot see."""
        if not self._first("progress_unknown", attempt, rank):
            return
        text = printable(why, limit=2 * MAX_ERROR_CHARS)
        self.events.emit(
            ProgressUnknown(
                rank=rank, local_rank=local_rank, why=text, round=round_, attempt=attempt
            )
        )
        if "unknown" not in self._said:
            self._said.add("unknown")
            self.say(
                f"elastrun: warning: the hang watchdog cannot see rank {rank}'s progress: "
                f"{text}; it is not judged while so (other ranks: event progress_unknown)"
            )

    def _first(self, kind: str, attempt: int, rank: int) -> bool:
        key = (kind, attempt, rank)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
