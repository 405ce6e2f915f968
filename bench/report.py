"""Summaries of benchmark runs: median / min / max per scenario, metric and
launcher configuration, failures, elastrun/torchrun ratios; as a Markdown
report and as JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.base import Scenario
from bench.configs import LauncherConfig, counterpart

# Metrics a successful run may leave out (nothing to measure there): such a
# run is not counted for them rather than counted as failed.
OPTIONAL_METRICS = frozenset({"warm_rss"})


@dataclass
class RunResult:
    """One run of one scenario with one launcher configuration."""

    scenario: str
    config: str
    rep: int
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


@dataclass
class Row:
    scenario: str
    metric: str
    unit: str
    config: str
    runs: int
    failures: int
    median: float | None
    min: float | None
    max: float | None
    ratio: float | None = None  # elastrun median / torchrun median (same tuning)
    ratio_note: str | None = None  # why there is no ratio, e.g. torchrun never got there
    errors: list[str] = field(default_factory=list)


def summarize(
    scenarios: Sequence[Scenario],
    configs: Sequence[LauncherConfig],
    results: Sequence[RunResult],
) -> list[Row]:
    rows: list[Row] = []
    for sc in scenarios:
        for key, unit, _meaning in sc.metrics:
            by_config: dict[str, Row] = {}
            for cfg in configs:
                runs = [r for r in results if r.scenario == sc.name and r.config == cfg.name]
                if key in OPTIONAL_METRICS:
                    runs = [r for r in runs if key in r.metrics or r.error is not None]
                values = [r.metrics[key] for r in runs if key in r.metrics]
                errors = sorted({r.error or "not measured" for r in runs if key not in r.metrics})
                row = Row(
                    sc.name,
                    key,
                    unit,
                    cfg.name,
                    runs=len(runs),
                    failures=len(runs) - len(values),
                    median=statistics.median(values) if values else None,
                    min=min(values) if values else None,
                    max=max(values) if values else None,
                    errors=errors,
                )
                by_config[cfg.name] = row
                rows.append(row)
            for cfg in configs:
                other = counterpart(cfg, configs)
                if other is None:
                    continue
                mine, theirs = by_config[cfg.name], by_config[other.name]
                if mine.median is not None and theirs.median:
                    mine.ratio = mine.median / theirs.median
                elif mine.median is not None and theirs.runs and theirs.median is None:
                    mine.ratio_note = f"{other.name} failed {theirs.failures}/{theirs.runs}"
    return rows


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "steps":
        return f"{value:.0f}"
    if unit == "MiB":
        return f"{value:.0f}"
    return f"{value:.2f}"


def markdown(
    scenarios: Sequence[Scenario],
    configs: Sequence[LauncherConfig],
    rows: Sequence[Row],
    floor: Sequence[dict[str, float]],
    extras: dict[str, Any],
    header: dict[str, Any],
) -> str:
    out: list[str] = ["# elastrun vs torchrun", ""]
    for key, value in header.items():
        out.append(f"- {key}: {value}")
    out += ["", "## Launcher settings", ""]
    for cfg in configs:
        out.append(f"- **{cfg.name}**: `{' '.join(cfg.base_command[1:])}` {cfg.describe()}")
    out += [
        "",
        "## Physical floor (no launcher: python start + import torch + gloo init of 2 ranks)",
        "",
    ]
    if floor:
        out += ["| metric | runs | median s | min s | max s |", "|---|---|---|---|---|"]
        for key in floor[0]:
            values = [f[key] for f in floor]
            out.append(
                f"| launch -> {key} | {len(values)} | {statistics.median(values):.2f} "
                f"| {min(values):.2f} | {max(values):.2f} |"
            )
    else:
        out.append("not measured (failed): " + str(extras.get("floor_error", "")))
    out += ["", "## Results", ""]
    out += [
        "| scenario | metric | launcher | ok/runs | median | min | max | elastrun/torchrun |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        unit = "" if row.unit == "s" else f" ({row.unit})"
        ok = f"{row.runs - row.failures}/{row.runs}"
        if row.failures:
            ok += f" ({row.failures} failed)"
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else (row.ratio_note or "-")
        out.append(
            f"| {row.scenario} | {row.metric}{unit} | {row.config} | {ok} "
            f"| {_fmt(row.median, row.unit)} | {_fmt(row.min, row.unit)} "
            f"| {_fmt(row.max, row.unit)} | {ratio} |"
        )
    out += ["", "Times in seconds unless marked. Metrics:", ""]
    seen: set[str] = set()
    for sc in scenarios:
        for key, unit, meaning in sc.metrics:
            if key not in seen:
                seen.add(key)
                out.append(f"- `{key}` ({unit}): {meaning}")
    failures = [(r.scenario, r.metric, r.config, e) for r in rows for e in r.errors if r.failures]
    if failures:
        out += ["", "## Failures", ""]
        done: set[tuple[str, str, str]] = set()
        for scenario, _metric, config, err in failures:
            if (scenario, config, err) in done:
                continue
            done.add((scenario, config, err))
            out.append(f"- {scenario} / {config}: {err}")
    wall = extras.get("wall_time")
    if wall:
        out += ["", "## Wall time", ""]
        out += ["| part | runs | estimated s | actual s |", "|---|---|---|---|"]
        for row in wall["rows"]:
            runs = row["runs"] if row["runs"] else "-"
            est = f"{row['estimated_s']:.0f}" if row["estimated_s"] is not None else "-"
            act = f"{row['actual_s']:.0f}" if row["actual_s"] is not None else "-"
            out.append(f"| {row['part']} | {runs} | {est} | {act} |")
        out.append(
            f"| total | | {wall['estimated_s']:.0f} ({wall['estimated_s'] / 60:.1f} min) "
            f"| {wall['total_s']:.0f} ({wall['total_s'] / 60:.1f} min) |"
        )
    notes = extras.get("notes") or []
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    out += ["", "## Partition and simulated rendezvous", ""]
    out.append(f"- partition: {extras.get('partition', 'not selected')}")
    sim = extras.get("simulated_rdzv")
    if sim is not None:
        out.append(f"- simulated rendezvous participants (elastrun only): {sim.get('status')}")
        if sim.get("rows"):
            out += [
                "",
                "| participants | rendezvous s (median) | exit barrier s (median) |",
                "|---|---|---|",
            ]
            out += [
                f"| {r['participants']:.0f} | {r['rendezvous_s']:.3f} | {r['exit_barrier_s']:.3f} |"
                for r in sim["rows"]
            ]
    return "\n".join(out) + "\n"


def wall_time(
    estimated: dict[str, float],
    actual: dict[str, float],
    runs: dict[str, int],
    total: float,
) -> dict[str, Any]:
    """Estimated and actual wall seconds per part of the benchmark (startup,
    physical floor, each scenario group, simulated rendezvous); what the
    parts do not account for (report writing, waits between runs) is
    "other"."""
    parts = list(dict.fromkeys([*estimated, *actual]))
    rows: list[dict[str, Any]] = [
        {
            "part": part,
            "runs": runs.get(part, 0),
            "estimated_s": estimated.get(part),
            "actual_s": actual.get(part),
        }
        for part in parts
    ]
    rows.append(
        {
            "part": "other",
            "runs": 0,
            "estimated_s": None,
            "actual_s": max(0.0, total - sum(actual.values())),
        }
    )
    return {"rows": rows, "estimated_s": sum(estimated.values()), "total_s": total}


def write_json(
    path: Path,
    configs: Sequence[LauncherConfig],
    results: Sequence[RunResult],
    rows: Sequence[Row],
    floor: Sequence[dict[str, float]],
    extras: dict[str, Any],
    header: dict[str, Any],
) -> None:
    doc = {
        "header": header,
        "configs": [
            {
                "name": c.name,
                "launcher": c.launcher,
                "tuned": c.tuned,
                "command": c.base_command[1:],
                "settings": c.describe(),
            }
            for c in configs
        ],
        "floor": list(floor),
        "summary": [asdict(r) for r in rows],
        "runs": [asdict(r) for r in results],
        "extras": extras,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
