"""The warm interpreter never hands out a fork that cannot use the GPU: its
checks run after every import, whether it succeeded or raised, and again
before each fork; CUDA initialisation is refused inside it; native threads
count; a hanging import is bounded (worker/_zygote.py).

This machine has no GPU: the stand-ins are a copy of a library mapped under
the CUDA driver's name, a native thread started through ctypes (as OpenMP or
NVML start theirs), and CPU torch, whose CUDA initialisation goes through
the same ``torch.cuda._lazy_init`` as a GPU build's.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.events import ListSink
from tests.integration.test_zygote import _env, _events_until, _fork_one, _kinds, _pool

# A native thread, unknown to the threading module: libc's sleep(600) run by pthread_create.
NATIVE_THREAD = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None)\n"
    "tid = ctypes.c_ulong()\n"
    "sleep = ctypes.cast(libc.sleep, ctypes.c_void_p)\n"
    "assert libc.pthread_create(ctypes.byref(tid), None, sleep, ctypes.c_void_p(600)) == 0\n"
)


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    """The test's folder as the working directory (the zygote imports its modules)."""
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def _fake_driver(tmp_path: Path) -> Path:
    lib = next(
        p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6") if os.path.exists(p)
    )
    fake = tmp_path / "libcuda.so.1"
    fake.write_bytes(Path(lib).read_bytes())
    return fake


async def _refused_then_forked(
    tmp_path: Path, preload: tuple[str, ...], **kw: object
) -> tuple[dict[str, Any], tuple[int, str] | None]:
    """Start a pool with ``preload``; once the first zygote was discarded and
    the next is ready, fork one worker: the discard event and the worker's end."""
    env = _env(PROBE_MODULES="email.mime.text")
    sink = ListSink()
    pool, _ = _pool(tmp_path, preload=preload, scope="all", sink=sink, **kw)  # type: ignore[arg-type]
    pool.keep(env)
    try:
        await _events_until(sink, "warm_started", 2, bound=120)
        assert await pool.wait_ready(120), (sink.events, [z.tail() for z in [pool._z] if z])
        (gone,) = _kinds(sink, "warm_discarded")
        return gone, await _fork_one(pool, env)
    finally:
        await pool.close()


def test_an_import_that_raises_is_checked_too(in_tmp):
    # The module loads the driver, then fails: before, a failed import skipped
    # every check and the zygote forked workers that could not use the GPU.
    fake = _fake_driver(in_tmp)
    (in_tmp / "halfway.py").write_text(
        f"import ctypes\nctypes.CDLL({str(fake)!r})\nraise ImportError('no GPU here')\n"
    )
    gone, got = asyncio.run(_refused_then_forked(in_tmp, ("halfway", "email.mime.text")))
    assert "halfway" in gone["reason"] and "CUDA driver" in gone["reason"], gone
    assert got is not None and got[0] == 0 and "BEFORE email.mime.text" in got[1], got
    (cached,) = (in_tmp / "cache").glob("modules-*.json")
    assert "halfway" in json.loads(cached.read_text())["skip"]


def test_cuda_initialisation_is_refused_in_the_zygote_not_in_its_workers(in_tmp):
    # A module that creates a CUDA tensor when imported (and hides the error)
    # would put a context on GPU 0 in the zygote, while workers train. It is
    # refused there and reported; a forked worker has torch's own CUDA
    # initialisation back (on this CPU build: "not compiled with CUDA").
    (in_tmp / "eager.py").write_text(
        "import torch\ntry:\n    torch.zeros(1, device='cuda')\nexcept Exception:\n    pass\n"
    )
    script = (
        "import sys, torch\n"
        "try:\n"
        "    torch.cuda.init()\n"
        "    said = 'initialised'\n"
        "except Exception as e:\n"
        "    said = str(e)\n"
        "print('BEFORE', 'torch' in sys.modules, 'REFUSED', 'elastrun' in said, flush=True)\n"
    )
    gone, got = asyncio.run(
        _refused_then_forked(in_tmp, ("torch", "eager", "email.mime.text"), script_text=script)
    )
    assert "eager" in gone["reason"] and "tried to initialise CUDA" in gone["reason"], gone
    assert got is not None and got[0] == 0 and "BEFORE True REFUSED False" in got[1], got


def test_a_module_that_starts_a_native_thread_is_not_preloaded(in_tmp):
    # OpenMP and NVML start threads the threading module never sees.
    (in_tmp / "omp.py").write_text(NATIVE_THREAD)
    gone, got = asyncio.run(_refused_then_forked(in_tmp, ("omp", "email.mime.text")))
    assert "omp" in gone["reason"] and "thread" in gone["reason"], gone
    assert got is not None and got[0] == 0 and "BEFORE email.mime.text" in got[1], got


def test_a_hanging_import_is_recorded_as_unsafe(in_tmp):
    (in_tmp / "hangs.py").write_text("import time\ntime.sleep(3600)\n")
    gone, got = asyncio.run(
        _refused_then_forked(in_tmp, ("hangs", "email.mime.text"), import_timeout=1.0)
    )
    assert "hangs" in gone["reason"] and "did not finish within 1 s" in gone["reason"], gone
    assert got is not None and got[0] == 0 and "BEFORE email.mime.text" in got[1], got
    (cached,) = (in_tmp / "cache").glob("modules-*.json")
    assert "hangs" in json.loads(cached.read_text())["skip"]


def test_the_checks_run_again_before_a_fork(in_tmp):
    # Every import passed its checks, but a collector callback the module left
    # behind starts a native thread later (the zygote collects once it is
    # ready): the fork order finds it, and the workers start cold.
    body = "".join("    " + line + "\n" for line in NATIVE_THREAD.splitlines())
    (in_tmp / "later.py").write_text(
        "import gc\n"
        "def _cb(phase, info, done=[]):\n"
        "    if done:\n"
        "        return\n"
        "    done.append(1)\n" + body + "gc.callbacks.append(_cb)\n"
    )

    async def main() -> tuple[dict[int, object], ListSink]:
        sink = ListSink()
        pool, _ = _pool(in_tmp, preload=("later",), scope="all", sink=sink, cache=False)
        env = _env()
        pool.keep(env)
        ours, theirs = socket.socketpair()
        try:
            assert await pool.wait_ready(60)
            forked = await pool.fork({0: env}, {0: theirs.fileno()})
            return dict(forked), sink
        finally:
            theirs.close()
            ours.close()
            await pool.close()

    forked, sink = asyncio.run(main())
    assert forked == {}
    (gone,) = _kinds(sink, "warm_discarded")
    assert "thread" in gone["reason"] and "before a fork" in gone["reason"], gone
