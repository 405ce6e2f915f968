"""A page rendered by a real browser: Debian's headless Chromium
(``scripts/ensure-chromium.sh`` installs it; ``make test`` runs that). Tests
that need it are skipped, with the reason, when it is not installed."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = (
    "needs a headless Chromium (Debian's chromium; run scripts/ensure-chromium.sh as root, "
    "which `make test` does)"
)
requires_chromium = pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
BOUND = 120.0  # one browser run, on a loaded machine
# What Chromium logs of the page's console (console.* calls, uncaught errors,
# failed loads) with --enable-logging=stderr.
CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)")


@dataclass(frozen=True)
class Rendered:
    dom: str  # the document as the browser parsed it
    console: list[str]  # what the page said on its console (errors among them)
    png: bytes  # a screenshot


def _chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, SKIP_REASON
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND, check=False)


def render(page: Path, width: int = 1120, height: int = 600) -> Rendered:
    """``page`` loaded by headless Chromium: its DOM, its console, a screenshot
    (one load of the page, one browser: each start costs about a second of CPU)."""
    url = page.resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="elastrun-chromium-") as tmp:
        profile = Path(tmp) / "profile"
        shot = Path(tmp) / "shot.png"
        size = f"--window-size={width},{height}"
        args = ["--dump-dom", "--hide-scrollbars", size, f"--screenshot={shot}", url]
        done = _chromium(args, profile)
        assert done.returncode == 0 and shot.exists(), done.stderr[-3000:]
        console = [m.group(1) for m in CONSOLE.finditer(done.stderr)]
        return Rendered(done.stdout, console, shot.read_bytes())


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG
    (what Chromium writes), decoded with the standard library."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, data, head = 8, b"", b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            head = body
        elif kind == b"IDAT":
            data += body
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", head)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(data)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def colors(png: bytes) -> Counter[str]:
    """How many pixels of the screenshot are of each color (``#rrggbb``)."""
    width, _, rows = png_pixels(png)
    bpp = len(rows[0]) // width if rows else 3
    return Counter("#" + row[i : i + 3].hex() for row in rows for i in range(0, len(row), bpp))
