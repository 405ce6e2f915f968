"""Goodput figures: the share of wall time that turned into training, and
the seconds of each cause (what the agents account: agent/goodput.py).

A value that crosses the store (the ``goodput`` note, rendezvous/notes.py),
the event log (the ``goodput`` event) and ``elastrun status``; its one text
form is :meth:`Goodput.line`.
"""

from __future__ import annotations

from dataclasses import asdict
from enum import StrEnum
from typing import Any

from elastrun.fields import Fields
from elastrun.frozen import frozen

__all__ = ["LOSSES", "MAX_SECONDS", "Cause", "Goodput"]

MAX_SECONDS = 1e12  # a figure read from outside is at most this


class Cause(StrEnum):
    TRAINING = "training"
    RESTART = "restart"
    REDONE = "redone"
    SAVES = "saves"
    WAITING = "waiting"
    HANG = "hang"
    STARTUP = "startup"


LOSSES = (Cause.RESTART, Cause.REDONE, Cause.HANG, Cause.SAVES, Cause.WAITING)


@frozen
class Goodput:
    """The figures at one time: seconds per cause, and what was counted."""

    seconds: dict[str, float]  # Cause -> s
    failures: int = 0  # restarts counted (a failure here or elsewhere)
    hangs: int = 0  # hangs declared here
    steps_redone: int = 0
    steps_known: bool = False  # the script reports its step numbers (redone steps seen)

    def of(self, cause: Cause) -> float:
        return self.seconds.get(cause.value, 0.0)

    @property
    def accounted(self) -> float:
        """The wall time the figure is over (all but the start-up)."""
        return sum(v for k, v in self.seconds.items() if k != Cause.STARTUP)

    @property
    def ratio(self) -> float | None:
        """training / accounted; None before the first step (no training)."""
        total, training = self.accounted, self.of(Cause.TRAINING)
        return training / total if training > 0 and total > 0 else None

    def losses(self) -> list[tuple[Cause, float]]:
        """The causes of loss, the largest first (those with time only)."""
        found = [(c, self.of(c)) for c in LOSSES if self.of(c) > 0]
        return sorted(found, key=lambda cs: -cs[1])

    def line(self) -> str:
        """One line, e.g. ``goodput 96.1%: 11 failures cost 5.7 s (0 steps
        redone), saves 7%``."""
        ratio = self.ratio
        if ratio is None:
            return "goodput unknown: no training step seen (the script reports no steps)"
        total = self.accounted
        failed = self.of(Cause.RESTART) + self.of(Cause.REDONE) + self.of(Cause.HANG)
        redone = f"{self.steps_redone} steps redone" if self.steps_known else "redone steps unseen"
        n = self.failures
        parts = [f"{n} failure{'' if n == 1 else 's'} cost {failed:.1f} s ({redone})"]
        if self.hangs:
            parts.append(
                f"{self.hangs} hang{'' if self.hangs == 1 else 's'} {self.of(Cause.HANG):.1f} s"
            )
        for cause in (Cause.SAVES, Cause.WAITING):
            if self.of(cause) > 0:
                share = 100 * self.of(cause) / total
                parts.append(
                    f"{cause.value} {share:.0f}%" if share >= 1 else f"{cause.value} {share:.1f}%"
                )
        return f"goodput {100 * ratio:.1f}%: " + ", ".join(parts)

    def status_text(self) -> str:
        """``elastrun status``' line: the figure and the top causes of loss."""
        ratio = self.ratio
        if ratio is None:
            return "unknown: no training step seen (the script reports no steps)"
        top = ", ".join(f"{c.value} {s:.1f} s" for c, s in self.losses()[:3]) or "none"
        return (
            f"{100 * ratio:.1f}% of {self.accounted:.1f} s since training began "
            f"({self.failures} restarts, {self.steps_redone} steps redone); lost to: {top}"
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        out["goodput"] = None if self.ratio is None else round(self.ratio, 4)
        return out

    @classmethod
    def from_json(cls, data: object, error: type[Exception] = ValueError) -> Goodput:
        """Read back, strictly (``error`` naming the field when it is not one:
        the figures may come from the store, which strangers may write)."""
        f = Fields(data, "goodput figures", error)
        raw = f.raw.get("seconds")
        causes = {c.value for c in Cause}
        if not isinstance(raw, dict) or not all(
            k in causes
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and 0 <= v <= MAX_SECONDS
            for k, v in raw.items()
        ):
            raise error("goodput figures: field seconds: not seconds per cause")
        return cls(
            {str(k): float(v) for k, v in raw.items()},
            failures=f.integer("failures"),
            hangs=f.integer("hangs"),
            steps_redone=f.integer("steps_redone"),
            steps_known=f.flag("steps_known"),
        )
