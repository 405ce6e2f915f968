"""Worker: rank 1 SIGKILLs itself on cue; rank 0 fails a moment after it.

Usage: killed_rank1.py DIR

Each rank writes DIR/rank{N}.ready once it runs. Rank 1 waits for DIR/die,
writes DIR/rank1.dying and SIGKILLs itself. Rank 0 stands for a peer whose
collective broke because rank 1 died: it raises a moment after rank 1's last
word, so its failure follows rank 1's death.
"""

import os
import signal
import sys
import time
from pathlib import Path

AFTER = 0.5  # s rank 0 waits after rank 1's last word
BOUND = 60.0  # s either rank waits for its cue at most


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + BOUND
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{path.name} never appeared")
        time.sleep(0.01)


def main(folder: Path) -> None:
    rank = os.environ["RANK"]
    (folder / f"rank{rank}.ready").write_text(str(os.getpid()))
    if rank == "1":
        wait_for(folder / "die")
        (folder / "rank1.dying").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    wait_for(folder / "rank1.dying")
    time.sleep(AFTER)
    raise RuntimeError("Connection closed by peer: rank 1 is gone")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
