"""Function entrypoints for the ``launch()`` conformance cases that need no
torch: their module's source imports none, so their workers start as a
script without torch does (no warm interpreter waited for; see
functions.py for those that return tensors)."""

from __future__ import annotations

import os


def rank_plus_ten() -> int:
    """Each worker returns 10 + its global rank."""
    return 10 + int(os.environ["RANK"])
