"""Conformance worker: write what torch.distributed.is_torchelastic_launched()
says into the file given by --out-file."""

from __future__ import annotations

import argparse

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description="is_torchelastic_launched check")
    parser.add_argument("--out-file", "--out_file", dest="out_file", required=True)
    args = parser.parse_args()
    with open(args.out_file, "w", encoding="utf-8") as out:
        out.write(str(dist.is_torchelastic_launched()))


if __name__ == "__main__":
    main()
