"""The rules table as text, rendered from ``elastrun.rendezvous.rules.RULES``.

Each rule's docstring (its first paragraph) is its row; the module docstring
of ``elastrun/rendezvous/rules.py`` holds the rendering, and a unit test
(test_rdzv_rules.py) keeps the two equal, so the table people read cannot drift
from the table the machine runs. After a change of the rules, print the new
table with ``python -m tests.unit.rdzv_table`` and paste it into that docstring.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

from elastrun.rendezvous.protocol import EVENTS, Event, State
from elastrun.rendezvous.rule_steps import Rule
from elastrun.rendezvous.rules import RULES

__all__ = ["render_table"]

_LINE_WIDTH = 99  # the docstring's lines stay within it


def _row_text(rule: Rule) -> str:
    doc = rule.__doc__ or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _rows(rules: Mapping[tuple[State, type[Event]], Rule]) -> list[tuple[str, str, str]]:
    """(state, event, text) per row, in the order of State and EVENTS. A rule
    filed under one event for three states or more is one row: ``any but X``
    where it is every state but one or two, else its first state, with the
    others named."""
    rows: list[tuple[str, str, str]] = []
    seen: set[tuple[type[Event], int]] = set()
    for state in State:
        for ev in EVENTS:
            rule = rules.get((state, ev))
            if rule is None or (ev, id(rule)) in seen:
                continue
            seen.add((ev, id(rule)))
            states = [s for s in State if rules.get((s, ev)) is rule]
            others = [s for s in State if s not in states]
            label, text = state.name, _row_text(rule)
            if len(states) >= 3 and len(others) <= 2:
                label = "any but " + ", ".join(s.name for s in others)
            elif len(states) > 1:
                text += " (also from " + ", ".join(s.name for s in states[1:]) + ")"
            rows.append((label, ev.__name__, text))
    return rows


def render_table(rules: Mapping[tuple[State, type[Event]], Rule] | None = None) -> str:
    """The rules table as reStructuredText (the module docstring's), rendered
    from ``RULES``: one row per rule, in the rule's own words (its docstring)."""
    rows = _rows(RULES if rules is None else rules)
    w_state = max(len("state"), *(len(r[0]) for r in rows))
    w_event = max(len("event"), *(len(r[1]) for r in rows))
    w_text = _LINE_WIDTH - w_state - w_event - 2
    border = f"{'=' * w_state} {'=' * w_event} {'=' * w_text}"
    out = [border, f"{'state':<{w_state}} {'event':<{w_event}} next state: actions", border]
    for label, event, text in rows:
        for i, line in enumerate(textwrap.wrap(text, w_text)):
            first, second = (label, event) if i == 0 else ("", "")
            out.append(f"{first:<{w_state}} {second:<{w_event}} {line}".rstrip())
    out.append(border)
    return "\n".join(out)


if __name__ == "__main__":
    print(render_table())
