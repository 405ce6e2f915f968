"""Conformance worker for torch.distributed.launch: its local rank arrives as
``--local_rank`` (declared the way scripts of that launcher do) and must match
``LOCAL_RANK``."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description="local rank argument check")
    parser.add_argument("--local_rank", type=int, required=True)
    args = parser.parse_args()
    env_rank = int(os.environ["LOCAL_RANK"])
    if args.local_rank != env_rank:
        sys.exit(f"--local_rank={args.local_rank} but LOCAL_RANK={env_rank}")
    print(f"local rank {args.local_rank} ok")


if __name__ == "__main__":
    main()
