"""``python -m bench [--quick] [--scenarios a,b] [--reps N]``: elastrun and
torchrun side by side on this machine (see docs/benchmarks.md).

Each repetition measures the physical floor, then runs every selected
scenario with each launcher configuration in turn (torchrun, elastrun,
torchrun tuned, elastrun tuned), so slow drifts of the machine hit all of them
alike. A run that fails or hangs is bounded by a timeout and counted as a
failure; it never stops the benchmark.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import report, scenarios, simulated
from bench.configs import DEFAULT_CONFIGS, LauncherConfig, check_launcher
from bench.harness import Run, physical_floor
from bench.paths import BENCH_DIR, BenchFailure
from bench.report import RunResult


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 repetition, few steps, cold start and worker crash at 2 workers only",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated groups: "
        + ",".join(scenarios.GROUPS)
        + " (default: all of these), or "
        + ",".join(scenarios.EXTRA_GROUPS),
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 2; quick 1)")
    p.add_argument(
        "--launchers",
        default=None,
        help="comma-separated configs (default: " + ",".join(c.name for c in DEFAULT_CONFIGS) + ")",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default bench/results/<timestamp>)",
    )
    p.add_argument(
        "--no-simulated", action="store_true", help="skip bench/rdzv_bench.py's simulated runs"
    )
    return p.parse_args(argv)


def run_one(
    sc: scenarios.Scenario,
    cfg: LauncherConfig,
    rep: int,
    settings: scenarios.Settings,
    out_dir: Path,
    unavailable: str | None,
) -> RunResult:
    result = RunResult(sc.name, cfg.name, rep)
    if unavailable:
        result.error = f"launcher unavailable: {unavailable}"
        return result
    worker_env = {
        "BENCH_STEP_INTERVAL": str(settings.step_interval),
        **settings.worker_env(),
        **dict(sc.worker_env),
    }
    run = Run(scenarios.scenario_dir(out_dir, sc, cfg, rep), worker_env)
    ctx = scenarios.Context(run, cfg, settings)
    t0 = time.monotonic()
    try:
        sc.fn(ctx)
    except BenchFailure as exc:
        result.error = str(exc)
    except Exception as exc:  # a harness bug must not lose the other runs
        result.error = f"harness error: {exc!r}"
        traceback.print_exc()
    finally:
        run.cleanup()
    result.wall_s = time.monotonic() - t0
    result.metrics = dict(ctx.out)
    result.notes = list(ctx.notes)
    result.info = dict(ctx.info)
    return result


def _progress(result: RunResult) -> str:
    vals = " ".join(f"{k}={v:.2f}" for k, v in result.metrics.items())
    status = "ok" if result.error is None else f"FAILED ({result.error[:160]})"
    return f"  {result.scenario:<20} {result.config:<17} rep {result.rep}: {vals} {status}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _terminate(signum: int, _frame: object) -> None:
    # Turn SIGTERM/SIGHUP into an exception so every run's cleanup still runs.
    raise KeyboardInterrupt(f"signal {signum}")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def main(argv: list[str] | None = None) -> int:
    t_main = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    args = parse_args(argv)
    settings = scenarios.Settings.quick_settings() if args.quick else scenarios.Settings()
    reps = args.reps if args.reps is not None else (1 if args.quick else 2)
    if args.scenarios:
        groups = [g.strip() for g in args.scenarios.split(",") if g.strip()]
    else:
        groups = list(scenarios.QUICK_GROUPS if args.quick else scenarios.GROUPS)
    unknown = [g for g in groups if g not in scenarios.GROUPS + scenarios.EXTRA_GROUPS]
    if unknown:
        print(f"unknown scenario group(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    configs = list(DEFAULT_CONFIGS)
    if args.launchers:
        wanted = [w.strip() for w in args.launchers.split(",")]
        bad = [w for w in wanted if w not in {c.name for c in configs}]
        if bad:
            print(f"unknown launcher config(s): {', '.join(bad)}", file=sys.stderr)
            return 2
        configs = [c for c in configs if c.name in wanted]
    selected = scenarios.select(groups, args.quick)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or BENCH_DIR / "results" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)

    header: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mode": "quick" if args.quick else "full",
        "repetitions": reps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "bounds": settings.bounds(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    with ThreadPoolExecutor() as pool:  # each --help imports its launcher: in parallel
        one_each = {c.launcher: c for c in configs}
        checks = {name: pool.submit(check_launcher, c) for name, c in one_each.items()}
        unavailable = {launcher: f.result() for launcher, f in checks.items()}
    for launcher, why in unavailable.items():
        if why:
            print(f"{launcher} is not usable, its runs count as failed: {why}")
    run_sim = "rdzv_scale" in groups and not args.no_simulated and simulated.available()
    estimated = {"startup": scenarios.STARTUP_EST_S, "floor": scenarios.FLOOR_EST_S * reps}
    estimated.update(scenarios.estimate(selected, configs, reps))
    if run_sim:
        estimated["simulated_rdzv"] = scenarios.SIMULATED_EST_S * reps
    header["estimated wall time"] = _minutes(sum(estimated.values()))
    actual: dict[str, float] = {"startup": time.monotonic() - t_main, "floor": 0.0}
    print(f"results in {out_dir}; estimated wall time {header['estimated wall time']}")

    results: list[RunResult] = []
    floor: list[dict[str, float]] = []
    extras: dict[str, Any] = {"notes": []}
    for rep in range(reps):
        print(f"repetition {rep + 1}/{reps}")
        t_floor = time.monotonic()
        try:
            floor.append(physical_floor(out_dir / "runs" / f"floor-rep{rep}", 2, 60.0))
            print("  floor: " + " ".join(f"{k}={v:.2f}" for k, v in floor[-1].items()))
        except BenchFailure as exc:
            extras["floor_error"] = str(exc)
            print(f"  floor: FAILED ({exc})")
        actual["floor"] += time.monotonic() - t_floor
        for sc in selected:
            for cfg in configs:
                result = run_one(sc, cfg, rep, settings, out_dir, unavailable[cfg.launcher])
                results.append(result)
                actual[sc.group] = actual.get(sc.group, 0.0) + result.wall_s
                print(_progress(result), flush=True)
                extras["notes"] += [f"{sc.name} / {cfg.name} rep {rep}: {n}" for n in result.notes]

    if "partition" in groups:
        why = scenarios.partition_status()
        extras["partition"] = why or "measured (see partition_2to3 above)"
    if "rdzv_scale" in groups and not args.no_simulated:
        t_sim = time.monotonic()
        extras["simulated_rdzv"] = simulated.simulated_rdzv(reps)
        if run_sim:
            actual["simulated_rdzv"] = time.monotonic() - t_sim
    header["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    total = time.monotonic() - t_main
    header["wall time"] = f"{_minutes(total)} (estimated {header['estimated wall time']})"
    runs_per_group: dict[str, int] = {}
    for sc in selected:
        runs_per_group[sc.group] = runs_per_group.get(sc.group, 0) + reps * len(configs)
    extras["wall_time"] = report.wall_time(estimated, actual, runs_per_group, total)

    rows = report.summarize(selected, configs, results)
    text = report.markdown(selected, configs, rows, floor, extras, header)
    (out_dir / "results.md").write_text(text)
    report.write_json(out_dir / "results.json", configs, results, rows, floor, extras, header)
    print()
    print(text)
    print(f"written: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    print(f"total wall time: {header['wall time']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
