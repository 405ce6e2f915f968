"""Conformance worker: write what torch.distributed.is_torchelastic_launched()
says into the file given by --out-file.

torch's answer is whether ``TORCHELASTIC_RUN_ID`` is set; this worker gives
that answer without importing torch (2 s of CPU a worker), and
test_is_not_torchelastic_launched checks that torch's own function agrees,
without and with the variable (a torch that changes its definition fails there).
"""

from __future__ import annotations

import argparse
import os


def is_torchelastic_launched() -> bool:
    """torch.distributed.is_torchelastic_launched(), as torch 2.13 defines it."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description="is_torchelastic_launched check")
    parser.add_argument("--out-file", "--out_file", dest="out_file", required=True)
    args = parser.parse_args()
    with open(args.out_file, "w", encoding="utf-8") as out:
        out.write(str(is_torchelastic_launched()))


if __name__ == "__main__":
    main()
