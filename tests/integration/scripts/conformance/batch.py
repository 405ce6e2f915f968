"""Several launches in one driver process, told apart in its output.

A driver (api_driver, torchrun_driver) that runs its cases one after the
other calls :func:`mark` before each: the line ``=== driver case N`` on stdout
and on stderr. :func:`split` cuts the driver's captured output back into each
case's part. One interpreter start and one ``import torch`` (2 s of CPU) serve
all the cases.
"""

from __future__ import annotations

import sys

CASE_MARK = "=== driver case"
EXIT = "=== driver exit"  # then the case's exit code, where the driver gives it


def mark(index: int) -> None:
    """The line that starts case ``index``, on both streams."""
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{CASE_MARK} {index}\n")
        stream.flush()


def split(stdout: str, stderr: str) -> list[tuple[str, str]]:
    """Each marked case's (stdout, stderr), in order; the lines before the
    first mark are left out."""
    outs = stdout.split(CASE_MARK)[1:]
    errs = stderr.split(CASE_MARK)[1:]
    return list(zip(outs, errs, strict=False))
