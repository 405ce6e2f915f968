"""Runs an Agent with a OneNodeRendezvous in its own process (for tests that
signal or SIGKILL the agent). Usage:
    agent_driver.py CONFIG_JSON
CONFIG_JSON: {"argv": [...], "nproc": N, "max_restarts": R, "shutdown_timeout": S,
              "events_file": path, "log_dir": path|null}
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from elastrun.agent import Agent, Executable, WorkerSpec
from elastrun.agent.spec import LogSettings
from tests.integration.scripts.one_node import OneNodeRendezvous


def main() -> int:
    cfg = json.loads(sys.argv[1])
    spec = WorkerSpec(
        command=Executable(tuple(cfg["argv"])),
        nproc=cfg["nproc"],
        run_id=cfg.get("run_id", "drv"),
        host="testhost",
        shutdown_timeout=cfg.get("shutdown_timeout", 30.0),
        events_file=cfg.get("events_file"),
        logs=LogSettings(dir=cfg.get("log_dir")),
        signals_to_forward=tuple(signal.Signals[n] for n in cfg.get("forward", [])),
    )
    rdzv = OneNodeRendezvous(
        run_id=spec.run_id, nproc=spec.nproc, max_restarts=cfg.get("max_restarts", 0)
    )
    return asyncio.run(Agent(spec, rdzv).run())


if __name__ == "__main__":
    sys.exit(main())
