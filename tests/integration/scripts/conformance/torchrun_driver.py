"""Runs torch's own launcher (``torchrun``) several times in one process.

    python -m tests.integration.scripts.conformance.torchrun_driver CASES_JSON

CASES_JSON is a list of ``[ARGS, ENV]``: for each case, one after the other,
the driver marks its start (batch.mark), sets ENV over its own environment
(``PET_*`` variables included: torchrun reads them when it parses ARGS), calls
``torch.distributed.run.main(ARGS)`` as ``python -m torch.distributed.run
ARGS`` would, and prints the line ``batch.EXIT N`` on stdout: 0 when it
returned, argparse's code for bad arguments, 1 for an exception, whose
traceback goes to stderr as Python prints it for an uncaught one. The
environment is restored before the next case. One ``import torch`` for all
the cases instead of one a launch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from torch.distributed.run import main as torchrun_main

from tests.integration.scripts.conformance.batch import EXIT, mark


def one(args: list[str], extra: dict[str, str]) -> int:
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        torchrun_main(args)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    for index, (args, extra) in enumerate(json.loads(sys.argv[1])):
        mark(index)
        code = one(args, extra)
        print(f"{EXIT} {code}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
