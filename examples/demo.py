"""``make demo``: elastrun restarts a training job whose worker was killed, and it resumes.

Two workers train ``examples/train.py`` from scratch under
``elastrun --standalone --nproc-per-node=2 --max-restarts=1``. At a chosen step
the example's own fault injection (``--crash-at-step N --crash-how sigkill``)
makes rank 1 SIGKILL itself, once: only on the first attempt. elastrun sees the
death, stops rank 0, restarts both workers, and they resume from the newest
checkpoint they agree on. Afterwards this script tells the story again from
elastrun's event log (``--events-file``) and the workers' output, and checks it:
it exits non-zero when the run did not restart and resume as described.

Then the best path: the same job and the same fault with ``--memory-checkpoint``
(``elastrun.train.MemoryCheckpoint``): each rank copies its state into shared
memory that its agent holds across the restart, every step, so the restarted
workers resume from the very step the failure interrupted: 0 steps redone
(fewer epochs: ``--memory-epochs``; ``--no-memory`` skips it).

Everything is written under ``--run-dir`` (default ``runs/demo``, ignored by
git); the previous demo's checkpoints and events there are removed first, so
the demo always trains from scratch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parent / "train.py"
RESUMED = re.compile(
    r"=> resumed: epoch=(\d+) offset=(\d+)/(\d+) global_step=(\d+) \(world (\d+), restart (\d+)\)"
)
FINAL = re.compile(r"final: epoch=(\d+) test_acc=([0-9.]+) world=(\d+) restarts=(\d+)")
FROM_MEMORY = re.compile(r"=> using memory checkpoint: step (\d+)")
REDONE = re.compile(r"elastrun: goodput [0-9.]+%: .*\((\d+) steps? redone\)")
RULE = "-" * 78


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/demo", help="where checkpoints and events go")
    p.add_argument("--epochs", type=int, default=6, help="epochs to train (default 6)")
    p.add_argument(
        "--crash-at-step", type=int, default=75, help="global step where rank 1 dies (default 75)"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="checkpoint every N steps (default 10)"
    )
    p.add_argument(
        "--memory-epochs",
        type=int,
        default=4,
        help="epochs of the memory-checkpoint run (default 4)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory-checkpoint run")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="give up after this many seconds (600)"
    )
    return p.parse_args(argv)


def elastrun_program() -> tuple[list[str], str]:
    """How to start elastrun (argv prefix) and how to show it: the console script beside
    this interpreter when there is one (a venv), else ``python -m elastrun``."""
    script = Path(sys.executable).parent / "elastrun"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)], "elastrun"
    return [sys.executable, "-m", "elastrun"], "python -m elastrun"


def build_command(
    args: argparse.Namespace, run_dir: Path, memory: bool = False
) -> tuple[list[str], list[str]]:
    """The elastrun command line: (argv to run, argv to show); ``memory``: the
    memory-checkpoint run (its own checkpoints and events)."""
    tag = "memory-" if memory else ""
    flags = [
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        f"--events-file={run_dir / f'{tag}events.jsonl'}",
    ]
    script = [
        *("--epochs", str(args.memory_epochs if memory else args.epochs)),
        *("--checkpoint-dir", str(run_dir / f"{tag}checkpoints")),
        *("--checkpoint-every", str(args.checkpoint_every)),
        *("--log-every", "10"),
        *("--crash-at-step", str(args.crash_at_step), "--crash-how", "sigkill"),
        *(("--memory-checkpoint",) if memory else ()),
    ]
    prefix, shown = elastrun_program()
    try:
        example = str(EXAMPLE.relative_to(Path.cwd()))
    except ValueError:
        example = str(EXAMPLE)
    return [*prefix, *flags, str(EXAMPLE), *script], [shown, *flags, example, *script]


def intro(args: argparse.Namespace, run_dir: Path, shown: list[str]) -> None:
    last_ckpt = args.crash_at_step - args.crash_at_step % args.checkpoint_every
    ckpt_dir = run_dir / "checkpoints"
    print(
        f"""{RULE}
elastrun demo: a worker dies in the middle of training, and the job goes on
{RULE}
What runs    2 worker processes (ranks 0 and 1) train a small CNN on handwritten
             digits with DistributedDataParallel (gloo, CPU): {args.epochs} epochs, from scratch.
Checkpoints  every {args.checkpoint_every} steps and at each epoch end, in {ckpt_dir}.
The fault    injected on purpose by the example (--crash-at-step {args.crash_at_step} --crash-how
             sigkill): at step {args.crash_at_step} rank 1 kills itself with SIGKILL, on the first
             attempt only, as the kernel's OOM killer would.
Expect       elastrun sees the death at once, stops rank 0, and restarts both
             workers (--max-restarts=1 allows one restart). They agree on the newest
             checkpoint (step {last_ckpt}), resume from it, and train to the end.
Event log    {run_dir / "events.jsonl"} (JSON lines: what elastrun did, and when)

$ {shlex.join(shown)}
{RULE}""",
        flush=True,
    )


def memory_intro(args: argparse.Namespace, shown: list[str]) -> None:
    print(
        f"""{RULE}
The best path: memory checkpoints, 0 steps redone
{RULE}
The same job and the same fault, now with --memory-checkpoint ({args.memory_epochs} epochs):
each rank copies its state every step into shared memory that elastrun's agent
holds (elastrun.train.MemoryCheckpoint), and the disk checkpoint every
{args.checkpoint_every} steps is written by the agent in the background. The restarted
workers resume from the step the failure interrupted (step {args.crash_at_step}), read
from memory: no step is done twice.

$ {shlex.join(shown)}
{RULE}""",
        flush=True,
    )


def memory_story(output: str, code: int, disk_redone: int | None) -> tuple[list[str], list[str]]:
    """What the memory-checkpoint run did, and what did not go as expected."""
    told: list[str] = []
    wrong: list[str] = []
    crashed = re.search(r"injected failure at step (\d+)", output)
    held = FROM_MEMORY.search(output)
    if crashed and held:
        redone = int(crashed[1]) - int(held[1])
        than = "" if disk_redone is None else f" (from the disk checkpoint: {disk_redone})"
        told.append(
            f"rank 1 died at step {crashed[1]}; the restarted workers resumed from step "
            f"{held[1]}, held in memory by the agent: {redone} steps redone{than}"
        )
        if redone != 0:
            wrong.append(f"{redone} steps were redone after the memory checkpoint")
    else:
        wrong.append("the memory-checkpoint run did not resume from memory")
    accounted = REDONE.search(output)
    if accounted:
        told.append(f"elastrun's own goodput account agrees: {accounted[1]} steps redone")
    if code != 0 or not FINAL.search(output):
        wrong.append(f"the memory-checkpoint run did not finish (elastrun exit code {code})")
    return told, wrong


def run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run elastrun, echoing its output as it comes; (exit code, output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lines: list[str] = []
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,  # so a timeout can stop elastrun and its workers together
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
            if time.monotonic() > deadline:
                raise TimeoutError
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        print(f"demo: elastrun ran longer than {timeout:.0f}s: stopping it", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    except KeyboardInterrupt:  # elastrun got the same SIGINT: let it stop its workers
        code = proc.wait()
    return code, "".join(lines)


def read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events


def story(events: list[dict[str, Any]], output: str, code: int) -> tuple[list[str], list[str]]:
    """What happened, step by step, and what did not go as the demo expects."""
    told: list[str] = []
    wrong: list[str] = []
    started = [e for e in events if e.get("kind") == "workers_started" and e["source"] == "agent"]
    failed = [
        e for e in events if e.get("kind") == "worker_exited" and e.get("cause") == "root_cause"
    ]
    restarts = [e for e in events if e.get("kind") == "restart" and e.get("counted")]
    budget = next((e["max_restarts"] for e in events if e.get("kind") == "agent_started"), "?")

    def pids(e: dict[str, Any]) -> str:
        flags = e.get("warm") or []
        warm = " (warm: Python and torch already loaded)" if flags and all(flags) else ""
        return f"ranks {e['ranks']} as pids {e['pids']}{warm}"

    if started:
        told.append(f"workers started: {pids(started[0])}")
    if failed:
        f = failed[0]
        how = f"killed by {f['signal']}" if f.get("signal") else f"exit code {f['exitcode']}"
        told.append(f"rank {f['rank']} (pid {f['pid']}) {how}: the root cause")
    else:
        wrong.append("no worker failed")
    if restarts:
        r = restarts[0]
        told.append(
            f"elastrun stopped the other worker and restarted the group: restart "
            f"{r['count']} of {budget}"
        )
    else:
        wrong.append("elastrun did not restart the workers")
    if len(started) > 1:
        told.append(f"workers started again: {pids(started[1])}")
    resumed = RESUMED.search(output)
    if resumed:
        epoch, offset, n, step = (int(resumed[i]) for i in range(1, 5))
        crashed = re.search(r"injected failure at step (\d+)", output)
        redone = f": {int(crashed[1]) - step} steps redone" if crashed else ""
        told.append(
            f"resumed from the checkpoint of step {step} (epoch {epoch}, sample {offset} "
            f"of {n}){redone}"
        )
    else:
        wrong.append("the workers did not resume from a checkpoint")
    final = FINAL.search(output)
    if final and code == 0:
        told.append(
            f"finished: test accuracy {float(final[2]):.4f} after {final[1]} epochs "
            f"(world {final[3]}, restarts {final[4]}; elastrun exit code 0)"
        )
    else:
        wrong.append(f"training did not finish (elastrun exit code {code})")
    return told, wrong


def draw_timeline(run_dir: Path) -> Path | None:
    """``elastrun timeline`` of the event log into run_dir/timeline.html (None if it failed)."""
    events, html = run_dir / "events.jsonl", run_dir / "timeline.html"
    prefix, _ = elastrun_program()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            [*prefix, "timeline", str(events), "--out", str(html)],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if done.returncode == 0 and html.exists():
            return html
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    # A fresh start: the previous demo's checkpoints would make this one resume at once.
    for tag in ("", "memory-"):
        shutil.rmtree(run_dir / f"{tag}checkpoints", ignore_errors=True)
        (run_dir / f"{tag}events.jsonl").unlink(missing_ok=True)
    (run_dir / "timeline.html").unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)

    cmd, shown = build_command(args, run_dir)
    intro(args, run_dir, shown)
    t0 = time.monotonic()
    code, output = run(cmd, args.timeout)
    elapsed = time.monotonic() - t0

    told, wrong = story(read_events(run_dir / "events.jsonl"), output, code)
    print(f"{RULE}\nWhat happened (from {run_dir / 'events.jsonl'} and the output above):")
    for i, line in enumerate(told, 1):
        print(f"  {i}. {line}")
    print(f"  ({elapsed:.0f} s in all)")
    timeline = draw_timeline(run_dir)
    if timeline is not None:
        print(f"The same history drawn as a timeline (elastrun timeline): {timeline}")
    if wrong:
        print("The demo did not go as expected: " + "; ".join(wrong), file=sys.stderr)
        return code or 1
    if not args.no_memory:
        crashed = re.search(r"injected failure at step (\d+)", output)
        resumed = RESUMED.search(output)
        disk_redone = int(crashed[1]) - int(resumed[4]) if crashed and resumed else None
        cmd, shown = build_command(args, run_dir, memory=True)
        memory_intro(args, shown)
        t0 = time.monotonic()
        code, output = run(cmd, args.timeout)
        told, wrong = memory_story(output, code, disk_redone)
        print(f"{RULE}\nWhat happened with memory checkpoints:")
        for i, line in enumerate(told, 1):
            print(f"  {i}. {line}")
        print(f"  ({time.monotonic() - t0:.0f} s in all)")
        if wrong:
            print("The demo did not go as expected: " + "; ".join(wrong), file=sys.stderr)
            return code or 1
    print(
        "Try it on several machines: README.md (Using it), docs/slurm.md, docs/kubernetes.md.\n"
        + RULE
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
