"""What automatic progress costs a training step, and how fast ``auto`` finds a hang.

1. **Overhead.** A training loop as scripts write it (an MLP under
   ``DistributedDataParallel`` on a one-rank gloo group, SGD with momentum,
   batches from a ``DataLoader``), run in child processes with the progress
   hooks installed as elastrun's runner installs them (``on``) and without
   (``off``), alternating, ``--rounds`` times each. Each child times
   ``--steps`` steps after a warm-up and reports the median of its blocks'
   mean step time. The steps have no sleep: the hooks' cost is as large a
   share of the step as it can be. Reported: the median ``on/off`` ratio
   (noisy: separate processes), and, measured in one process, what the
   hooks add to one step (``hook_cost_s``) and its share of the unhooked
   step and of a 50 ms step.
2. **Detection.** ``tests/integration/scripts/hang_ddp.py stuck`` (3 ranks,
   about 50 ms steps, rank 1 stuck at step 30) under ``elastrun
   --hang-timeout auto:FLOOR``: ``idle_s`` of the ``hang_detected`` event
   (seconds from the stuck rank's last progress to the declaration). torchrun
   has no such detection: the others wait in gloo's all-reduce until its
   timeout (30 minutes by default).

3. **False positives** (``--soak N``): the evaluation-and-checkpoint scenario
   of the tests (``hang_ddp.py pauses``) N times under ``--hang-timeout
   auto:4``; every declared hang is a false one.

Usage: python -m bench.progress_overhead [--rounds 5] [--steps 2000] [--floor 5] [--soak N]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HANG_SCRIPT = REPO / "tests" / "integration" / "scripts" / "hang_ddp.py"
BLOCK = 100


def child(hooks: bool, steps: int) -> None:
    if hooks:
        from elastrun.worker import _progress, _runner

        fd, path = tempfile.mkstemp(prefix="progress-bench-")
        os.close(fd)
        os.environ[_progress.FILE_ENV] = path
        _progress.install(_runner.on_import)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = TensorDataset(torch.randn(8192, 64), torch.randn(8192, 1))

    def batches():
        while True:
            yield from DataLoader(data, batch_size=32, shuffle=True)

    it = batches()

    def step() -> None:
        x, y = next(it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(200):
        step()
    means = []
    for _ in range(max(1, steps // BLOCK)):
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            step()
        means.append((time.perf_counter() - t0) / BLOCK)
    dist.destroy_process_group()
    print(json.dumps({"hooks": hooks, "step_s": statistics.median(means)}))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hook_cost(n: int = 200_000) -> float:
    """Seconds the hooks add to one training step, measured in this process:
    what a DDP step triggers (a DataLoader batch, a timed backward pass, an
    optimizer step) against the same calls unhooked."""
    from elastrun.worker._progress import Progress, _timed

    with tempfile.TemporaryDirectory() as d:
        p = Progress(os.path.join(d, "hb.json"), 1.0)

        def noop() -> None:
            return None

        timed = _timed(p, noop)
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
            noop()
            noop()
        base = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            p.event()
            timed()
            p.optimizer_step()
        hooked = time.perf_counter() - t0
    return max(0.0, (hooked - base) / n)


def overhead(rounds: int, steps: int) -> dict[str, object]:
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for hooks in (False, True):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.progress_overhead",
                    "--child",
                    str(int(hooks)),
                    "--steps",
                    str(steps),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            ).stdout
            times[hooks].append(json.loads(out.strip().splitlines()[-1])["step_s"])
    ratios = [on / off for on, off in zip(times[True], times[False], strict=True)]
    cost = hook_cost()
    return {
        "hook_cost_s": cost,
        "hook_share_of_step_off": cost / statistics.median(times[False]),
        "hook_share_of_50ms_step": cost / 0.05,
        "step_s_off": times[False],
        "step_s_on": times[True],
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
    }


def run_hang_script(
    mode: str, steps: int, floor: float, *extra: str, **env: str
) -> tuple[int, list[dict[str, Any]]]:
    """``hang_ddp.py MODE STEPS`` on 3 ranks under ``--hang-timeout
    auto:FLOOR``: elastrun's exit code and its events."""
    with tempfile.TemporaryDirectory(prefix="hang-bench-") as d:
        out, events = Path(d) / "out", Path(d) / "events.jsonl"
        out.mkdir()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastrun",
                "--nproc-per-node=3",
                *extra,
                f"--hang-timeout=auto:{floor:g}",
                f"--events-file={events}",
                str(HANG_SCRIPT),
                str(out),
                mode,
                str(steps),
            ],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        return proc.returncode, [json.loads(x) for x in events.read_text().splitlines()]


def detection(floor: float) -> dict[str, object]:
    code, events = run_hang_script("stuck", 40, floor, "--max-restarts=1")
    hangs = [e for e in events if e["kind"] == "hang_detected"]
    return {
        "floor_s": floor,
        "exit": code,
        "idle_s": hangs[0]["idle_s"] if hangs else None,
        "timeout_s": hangs[0]["hang_timeout"] if hangs else None,
        "sits_in": hangs[0]["sits_in"] if hangs else None,
    }


def soak(runs: int, floor: float) -> dict[str, object]:
    """``hang_ddp.py pauses`` (an 8 s evaluation over a DataLoader, two 8 s
    checkpoint saves, about 50 ms steps, 3 ranks) ``runs`` times under
    ``--hang-timeout auto:FLOOR``: hangs declared (all false)."""
    declared, suspected, failed = 0, 0, 0
    for _ in range(runs):
        code, events = run_hang_script("pauses", 60, floor, EVAL_S="8", SAVE_S="8")
        kinds = [e["kind"] for e in events]
        declared += kinds.count("hang_detected")
        suspected += kinds.count("hang_suspected")
        failed += code != 0
    return {
        "runs": runs,
        "floor_s": floor,
        "hangs_declared": declared,
        "hangs_suspected": suspected,
        "runs_failed": failed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=("0", "1"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--floor", type=float, default=5.0)
    ap.add_argument("--soak", type=int, default=0, help="runs of the pauses scenario (0: none)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child is not None:
        child(args.child == "1", args.steps)
        return 0
    result = {
        "overhead": overhead(args.rounds, args.steps),
        "detection": detection(args.floor),
    }
    if args.soak:
        result["soak"] = soak(args.soak, 4.0)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
