"""Conformance worker: print the variables named on the command line as one
JSON line ``ENV {...}`` on stdout, then the lines given with --say (stdout)
and --warn (stderr), each as given."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description="conformance worker")
    parser.add_argument("names", nargs="*")
    parser.add_argument("--say", action="append", default=[])
    parser.add_argument("--warn", action="append", default=[])
    args = parser.parse_args()
    # One write per line: unbuffered, print() writes the newline apart, and
    # two workers' lines would interleave on a shared console.
    sys.stdout.write("ENV " + json.dumps({n: os.environ.get(n) for n in args.names}) + "\n")
    for line in args.say:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    for line in args.warn:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    main()
