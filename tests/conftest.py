"""Shared test fixtures: repository paths and the Python that runs workers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# Workers started by tests run with the same interpreter and see the package.
os.environ.setdefault("PYTHONUNBUFFERED", "1")
