"""Conformance worker: check the torchrun worker environment, then create a
file named after this worker's global rank, holding the variables checked as a
JSON object (or fail when given --fail)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# What a torchrun worker can rely on, plus a variable the launching test sets
# (the launcher's own environment reaches the workers).
EXPECTED = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "TEST_SENTINEL_PARENT",
    "TORCHELASTIC_ERROR_FILE",
)


def main() -> None:
    parser = argparse.ArgumentParser(description="conformance worker")
    parser.add_argument("--touch-file-dir", "--touch_file_dir", dest="touch_dir")
    parser.add_argument("--fail", action="store_true", help="raise instead of touching")
    args = parser.parse_args()
    missing = [name for name in EXPECTED if name not in os.environ]
    if missing:
        sys.exit(f"not in the worker environment: {', '.join(missing)}")
    for name in EXPECTED:
        print(f"{name}={os.environ[name]}")
    if args.fail:
        raise RuntimeError("failing on purpose (--fail)")
    target = Path(args.touch_dir, os.environ["RANK"])
    target.write_text(json.dumps({name: os.environ[name] for name in EXPECTED}))
    print(f"touched {target}")


if __name__ == "__main__":
    main()
