"""What the warm interpreter imports, tried as an attacker would.

* Anyone who reaches the rendezvous store can write the job's note
  ``modules``. Without a token, it is not used at all; with one, its names
  pass the same rule as a local worker's report (never a ``__main__``, the
  script, or a module that acts when imported). Either way the training
  script runs once per rank, and nothing refused reaches the script's cache.
* The per-script cache file planted as a FIFO, a symbolic link, deeply nested
  JSON or an oversized file: the agent starts, trains, exits 0, and the cache
  is a valid file again afterwards.

Real ``elastrun`` agents, a real embedded store (``elastrun store serve``)
written to by a raw store client, real gloo workers; loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.command import PythonScript
from elastrun.agent.modcache import MAX_FILE_BYTES, cache_key
from elastrun.names import RunId
from elastrun.rendezvous.keys import Keys
from elastrun.store.client import TcpStore
from tests.conftest import PYTHON
from tests.helpers import WARM_ENV, free_port, stop_groups, wait_for
from tests.integration.test_cli import ELASTRUN, RUN_TIMEOUT, elastrun, env_without_pet

# Each run of the script leaves one line (before anything can fail), then
# trains one step (the runner reports the modules the worker imported).
SCRIPT = textwrap.dedent(
    """
    import os
    fd = os.open(os.environ["RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, f"rank={os.environ.get('RANK')} name={__name__}\\n".encode())
    os.close(fd)
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    w.sum().backward()
    opt.step()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"TRAINED rank={dist.get_rank()} sum={t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)
MARKER_MODULE = "elastrun_trust_marker"
# Each refused for its own reason: unittest.__main__ runs the tests named on
# the command line (the training script, in a warm interpreter), this prints,
# __hello__ is a frozen module that prints.
HOSTILE = ["unittest.__main__", "this", "__hello__"]
TOKEN = "module-trust-token"


def _user_site(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A user site folder (an installed package's place) holding a module that
    leaves a mark when it is imported; the environment that finds it."""
    base = tmp_path / "userbase"
    site_dir = Path(sysconfig.get_path("purelib", "posix_user", vars={"userbase": str(base)}))
    site_dir.mkdir(parents=True)
    marker = tmp_path / "IMPORTED"
    (site_dir / f"{MARKER_MODULE}.py").write_text(
        f"with open({str(marker)!r}, 'a') as f:\n    f.write('imported\\n')\n"
    )
    path = os.pathsep.join(p for p in (str(site_dir), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONUSERBASE": str(base), "PYTHONPATH": path}, marker


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[int, str | None]]:
    """``elastrun store serve`` on loopback, with a token when the test asks."""
    token = TOKEN if getattr(request, "param", False) else None
    port = free_port()
    cmd = [PYTHON, "-m", "elastrun", "store", "serve", "--port", str(port)]
    if token is not None:
        (tmp_path / "token").write_text(token)
        os.chmod(tmp_path / "token", 0o600)
        cmd += ["--token-file", str(tmp_path / "token")]
    log = tmp_path / "store.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "listening on" in log.read_text(), 60, "the store to listen")
        yield port, token
    finally:
        stop_groups(server)


async def _write_note(port: int, token: str | None, run_id: str, names: list[str]) -> None:
    """The attacker: a raw store client writes the job's note ``modules``."""
    client = await TcpStore.connect("127.0.0.1", port, token=token, timeout=30)
    try:
        value = {"v": 1, "modules": names, "python": None, "torch": None}
        await client.put(Keys(RunId(run_id)).note("modules"), json.dumps(value).encode())
    finally:
        await client.close()


@pytest.mark.parametrize("store", [False, True], ids=["no-token", "token"], indirect=True)
def test_a_modules_note_from_the_store_never_runs_the_script_again(tmp_path, store):
    port, token = store
    run_id = "module-trust"
    (tmp_path / "train.py").write_text(SCRIPT)
    site_env, marker = _user_site(tmp_path)
    asyncio.run(_write_note(port, token, run_id, [*HOSTILE, MARKER_MODULE]))
    runs, events = tmp_path / "runs.txt", tmp_path / "events.jsonl"
    cache_dir = tmp_path / "cache"
    conf = "is_host=0" + (f",token_file={tmp_path / 'token'}" if token else "")
    env = {
        **env_without_pet(),
        **WARM_ENV,
        **site_env,
        "RUNS": str(runs),
        "ELASTRUN_CACHE_DIR": str(cache_dir),
        "ELASTRUN_DEBUG": "1",
    }
    one_cpu = min(os.sched_getaffinity(0))
    # On one CPU, 2 workers are more than the CPUs: the start waits until the
    # warm interpreter has imported everything it was given, the note's too.
    # (subprocess.run kills the agent at the timeout; its workers and warm
    # interpreter die with it.)
    proc = subprocess.run(
        [
            ELASTRUN,
            "--nnodes=1",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}",
            f"--events-file={events}",
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
        start_new_session=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}),
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-3000:]
    # The script ran exactly once per rank, as __main__: never inside the warm
    # interpreter (no rank), never imported under its own name.
    assert sorted(runs.read_text().splitlines()) == ["rank=0 name=__main__", "rank=1 name=__main__"]
    trained = sorted(x.split("TRAINED ")[1] for x in out.splitlines() if "TRAINED " in x)
    assert trained == ["rank=0 sum=2", "rank=1 sum=2"], out[-3000:]
    (cached,) = cache_dir.glob("modules-*.json")
    modules = json.loads(cached.read_text())["modules"]
    assert "torch.optim" in modules  # what the workers reported was kept
    assert not set(HOSTILE) & set(modules)
    evs = _events(events)
    from_job = [e for e in evs if e["kind"] == "modules_recorded" and e["why"] == "job"]
    if token is None:
        # Not used at all: said once, as an event and in the debug output.
        assert [e["reason"] for e in evs if e["kind"] == "modules_note_ignored"] == [
            "unauthenticated"
        ]
        assert "module note is not used" in err
        assert not from_job
        assert not marker.exists()
        assert MARKER_MODULE not in modules
    else:
        # A trusted peer's list: only the name that passes the rule is kept
        # (and imported, ahead of the start).
        assert [e["new"] for e in from_job] == [1]
        assert MARKER_MODULE in modules
        assert marker.read_text() == "imported\n"
        assert "3 module names of the job refused" in err


def _cache_file(tmp_path: Path, cache_dir: Path) -> Path:
    key = cache_key(PythonScript("train.py", python=PYTHON), str(tmp_path))
    return cache_dir / f"modules-{key}.json"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "nested", "oversized"])
def test_a_hostile_cache_file_never_stops_a_launch(tmp_path, kind):
    (tmp_path / "train.py").write_text(SCRIPT)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    path = _cache_file(tmp_path, cache_dir)
    target = tmp_path / "elsewhere.json"
    planted = json.dumps({"v": 1, "modules": ["this", "wave"]})
    if kind == "fifo":
        os.mkfifo(path, 0o600)  # a plain open() of it would wait for a writer forever
    elif kind == "symlink":
        target.write_text(planted)
        os.symlink(target, path)
    elif kind == "nested":
        path.write_text("[" * 100_000)
    else:
        path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    env = {**env_without_pet(), **WARM_ENV, "RUNS": str(tmp_path / "runs.txt")}
    env["ELASTRUN_CACHE_DIR"] = str(cache_dir)
    proc = elastrun("--standalone", "--nproc-per-node=1", "train.py", cwd=tmp_path, env=env)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "TRAINED rank=0" in out
    # One line says the file was ignored, naming it.
    said = [x for x in err.splitlines() if "module cache" in x]
    assert len(said) == 1 and str(path) in said[0] and "ignored" in said[0], err[-3000:]
    # Replaced by the list the worker reported: a regular file, never written
    # through the link.
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    entry = json.loads(path.read_text())
    assert "torch.optim" in entry["modules"] and "this" not in entry["modules"]
    if kind == "symlink":
        assert target.read_text() == planted
