"""The project builds an sdist and a wheel that install into a clean venv and run.

``python -m build`` (with the build backend of the dev venv: ``--no-isolation``, so no network)
builds the sdist from a copy of the working tree into which run outputs were planted
(checkpoints, an event log, byte code), then the wheel from that sdist. The sdist holds the
package, README, LICENSE, pyproject.toml and the docs and nothing else; the wheel holds every
module and declares the version, the Python and torch ranges and the extras, and its PyPI
description is its own: it opens with ``pip install`` and a torchrun-style command, links to
nothing relative (PyPI cannot resolve a checkout's paths), and the docs it names are in the
sdist. The wheel then goes (with the dev venv's pip) into a fresh ``python -m venv`` without
torch or pip, once with each CPython version the classifiers declare that this machine has
(3.11 always; 3.12 and 3.13 where found on PATH or under pyenv; ``make test`` the oldest and
the newest only): every module
compiles without warnings and imports, ``elastrun --version``/``--help`` work, and a 2-worker
``--standalone`` run of a plain script and of a ``--no-python`` program succeed in Python's
development mode with deprecations as errors, printing no warning.
"""

from __future__ import annotations

import email.message
import email.parser
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import soak_or

pytest.importorskip("build")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
NAME, VERSION = PYPROJECT["name"], PYPROJECT["version"]
MODULES = sorted(
    p.relative_to(REPO).as_posix()
    for p in (REPO / "src" / "elastrun").rglob("*")
    if p.suffix in (".py", ".typed") and "__pycache__" not in p.parts
)
SKIP = shutil.ignore_patterns(
    ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "results"
)
# Everything an sdist may hold, relative to its top folder (folders have no trailing slash).
SDIST_ALLOWED = re.compile(
    r"^(PKG-INFO|README\.md|LICENSE|pyproject\.toml|setup\.cfg|MANIFEST\.in|docs|docs/[\w-]+\.md"
    r"|src|src/elastrun\.egg-info"
    r"|src/elastrun(/\w+)*(\.py|/py\.typed)?"
    r"|src/elastrun\.egg-info/(PKG-INFO|SOURCES|dependency_links|entry_points|requires"
    r"|top_level)(\.txt)?)$"
)


PY_VERSION = re.compile(r"^Programming Language :: Python :: 3\.\d+$")
DECLARED_PYTHONS = sorted(
    c.rsplit(" ", 1)[1] for c in PYPROJECT["classifiers"] if PY_VERSION.match(c)
)


def find_python(version: str) -> str | None:
    """A CPython of ``version`` (``"3.12"``) with venv: on PATH, else under pyenv's versions."""
    if version == f"{sys.version_info.major}.{sys.version_info.minor}":
        return sys.executable
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    for exe in filter(None, candidates):
        probe = subprocess.run(
            [exe, "-c", "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return exe
    return None


def pythons() -> list[pytest.ParameterSet]:
    """Every declared Python under ``make soak``; the oldest and the newest
    under ``make test`` (what one between them could break, both would)."""
    versions = soak_or([DECLARED_PYTHONS[0], DECLARED_PYTHONS[-1]], DECLARED_PYTHONS)
    found: list[pytest.ParameterSet] = []
    for version in dict.fromkeys(versions):
        exe = find_python(version)
        skip = pytest.mark.skipif(exe is None, reason=f"no CPython {version} on this machine")
        found.append(pytest.param(exe, id=f"py{version}", marks=skip))
    return found


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False, **kw)  # type: ignore[call-overload, no-any-return]


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: the clean venv must run the installed wheel, not this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PET_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("packaging")
    tree = tmp / "tree"
    shutil.copytree(REPO, tree, ignore=SKIP)
    # What a used checkout holds besides its sources: none of it may reach the sdist.
    for junk in (
        "checkpoints/ckpt-000000000184.pt",
        "checkpoints/latest",
        "runs/demo/checkpoints/ckpt-000000000070.pt",
        "runs/demo/events.jsonl",
        "src/elastrun/__pycache__/cli.cpython-311.pyc",
        "tests/__pycache__/conftest.cpython-311.pyc",
        ".pytest_cache/v/cache/lastfailed",
    ):
        (tree / junk).parent.mkdir(parents=True, exist_ok=True)
        (tree / junk).write_bytes(b"not a source file")
    out = tmp / "dist"
    # Without --sdist/--wheel, build makes the sdist and then the wheel *from the sdist*, so a
    # file missing from the sdist breaks the wheel.
    built = run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    sdists = list(out.glob(f"{NAME}-{VERSION}.tar.gz"))
    wheels = list(out.glob(f"{NAME}-{VERSION}-py3-none-any.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return sdists[0], wheels[0]


def test_sdist_holds_the_package_and_nothing_else(dists: tuple[Path, Path]) -> None:
    sdist, _ = dists
    top = f"{NAME}-{VERSION}/"
    with tarfile.open(sdist) as tar:
        names = [m.name for m in tar.getmembers()]
    assert all(n == top.rstrip("/") or n.startswith(top) for n in names), names
    inner = [n[len(top) :] for n in names if n.startswith(top)]
    stray = [n for n in inner if n and not SDIST_ALLOWED.match(n.rstrip("/"))]
    assert not stray, f"unexpected files in the sdist: {stray}"
    assert not [n for n in inner if n.endswith((".pt", ".pyc", ".jsonl", "latest"))]
    assert set(MODULES) <= set(inner), set(MODULES) - set(inner)
    for needed in ("README.md", "LICENSE", "pyproject.toml", "PKG-INFO"):
        assert needed in inner
    # The docs the package's description sends its readers to.
    docs = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")}
    assert docs and docs <= set(inner), docs - set(inner)


def test_wheel_holds_every_module_and_declares_its_ranges(dists: tuple[Path, Path]) -> None:
    _, wheel = dists
    info = f"{NAME}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert {m.removeprefix("src/") for m in MODULES} <= names
    assert not [n for n in names if n.endswith((".pyc", ".pt")) or n.startswith("tests/")]
    assert f"{info}/licenses/LICENSE" in names
    assert re.search(r"^elastrun = elastrun\.cli:main$", entry_points, re.M)

    assert meta["Name"] == NAME and meta["Version"] == VERSION
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.11" in classifiers
    # Every version the classifiers declare is one this test installs the wheel with.
    declared = {c.rsplit(" ", 1)[1] for c in classifiers if PY_VERSION.match(c)}
    assert declared == set(DECLARED_PYTHONS), declared
    assert all(tuple(map(int, v.split("."))) >= (3, 11) for v in declared)
    assert set(meta.get_all("Provides-Extra") or []) >= {"torch", "etcd", "dev"}
    requires = meta.get_all("Requires-Dist") or []
    # The agent needs nothing; torch comes only with the extra, as a range (not an exact pin).
    assert all("extra ==" in r for r in requires), requires
    torch_extra = [r for r in requires if r.startswith("torch") and 'extra == "torch"' in r]
    assert torch_extra and re.match(r"torch>=2\.\d+\s*;", torch_extra[0]), torch_extra
    check_description(meta)


def check_description(meta: email.message.Message) -> None:
    """PyPI's page for the package: its own text, readable without the checkout."""
    assert meta["Description-Content-Type"] == "text/markdown"
    text = str(meta.get_payload())
    assert text.lstrip().startswith("# elastrun"), text[:200]
    first_block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first_block, "the description opens with no command block"
    assert first_block.start() < 200, "the command block is not at the top"
    # Install, then a torchrun-style launch, before anything else.
    assert re.search(r"^pip install elastrun", first_block.group(1), re.M)
    assert re.search(r"^elastrun --nnodes=\S+ --nproc-per-node=\d+", first_block.group(1), re.M)
    assert "make demo" not in text and "make test" not in text  # a checkout's targets
    # Markdown links and images, reference definitions, HTML links: absolute ones only.
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", text, re.M)
    targets += re.findall(r"(?:href|src)\s*=\s*[\"']([^\"']+)", text)
    relative = [t for t in targets if not re.match(r"https://", t)]
    assert not relative, f"links PyPI cannot resolve: {relative}"
    # No project URLs exist yet; any that is added must be an absolute https address.
    for url in meta.get_all("Project-URL") or []:
        assert re.match(r"[^,]+, https://\S+$", url), url
    # The docs it names are files of the sdist.
    for named in set(re.findall(r"`(docs/[\w-]+\.md)`", text)):
        assert (REPO / named).is_file(), named


# Run in the clean venv: every installed module compiles with warnings as errors (3.12 turns
# invalid escapes into SyntaxWarning) and imports without a DeprecationWarning, except where
# an extra's package is missing (torch, httpx, lightning) or the module runs by path.
IMPORT_ALL = """
import importlib, pathlib, pkgutil, sys, warnings
import elastrun
from elastrun.errors import ConfigError
warnings.simplefilter("error")
root = pathlib.Path(elastrun.__file__).parent
for path in sorted(root.rglob("*.py")):
    compile(path.read_text(encoding="utf-8"), str(path), "exec")
bad, imported = [], 0
for mod in pkgutil.walk_packages(elastrun.__path__, "elastrun."):
    if mod.name.endswith(("__main__", "._zygote")):
        continue
    try:
        importlib.import_module(mod.name)
        imported += 1
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "httpx", "lightning", "numpy"):
            bad.append(f"{mod.name}: {e!r}")
    except ConfigError as e:
        if "pip install 'elastrun[" not in str(e):
            bad.append(f"{mod.name}: {e!r}")
    except Exception as e:
        bad.append(f"{mod.name}: {e!r}")
print("imported", imported)
print(*bad, sep="\\n", file=sys.stderr)
sys.exit(1 if bad else 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("python", pythons())
def test_wheel_installs_into_a_clean_venv_and_runs_without_torch(
    dists: tuple[Path, Path], tmp_path: Path, python: str
) -> None:
    _, wheel = dists
    venv = tmp_path / "venv"
    # Without pip of its own (ensurepip: some 4 s of CPU a venv): the dev venv's pip
    # installs the wheel into it (``--python``), as the venv's own pip would.
    made = run([python, "-m", "venv", "--without-pip", str(venv)], env=clean_env())
    assert made.returncode == 0, made.stderr
    py, elastrun = venv / "bin" / "python", venv / "bin" / "elastrun"
    install = ["install", "-q", "--no-index", "--no-deps", str(wheel)]
    pip = run([sys.executable, "-m", "pip", "--python", str(py), *install], env=clean_env())
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = clean_env()
    # Python's development mode (resource and asyncio checks) and deprecations as errors: what
    # a newer CPython removes shows up here first.
    env |= {"PYTHONDEVMODE": "1", "PYTHONWARNINGS": "error::DeprecationWarning"}

    where = run(
        [
            str(py),
            "-c",
            "import sys, elastrun, elastrun.train, elastrun.launcher.cli; "
            "print(elastrun.__file__); print('torch' in sys.modules)",
        ],
        env=env,
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr
    location, torch_loaded = where.stdout.split()
    assert Path(location).is_relative_to(venv), location  # the wheel's copy, not the checkout's
    assert torch_loaded == "False"
    assert run([str(py), "-c", "import torch"], env=env).returncode != 0, "venv must lack torch"
    imports = run([str(py), "-c", IMPORT_ALL], env=env, cwd=tmp_path)
    assert imports.returncode == 0, imports.stdout + imports.stderr
    assert int(imports.stdout.split()[-1]) >= len(MODULES) // 2, imports.stdout

    version = run([str(elastrun), "--version"], env=env)
    assert version.returncode == 0 and version.stdout.strip() == f"elastrun {VERSION}"
    helped = run([str(elastrun), "--help"], env=env)
    assert helped.returncode == 0 and "--nproc-per-node" in helped.stdout

    script = tmp_path / "hello.py"
    script.write_text(
        "import os, sys\n"
        "print('hello from rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],\n"
        "      'restart', os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
    )
    hello = run(
        [str(elastrun), "--standalone", "--nproc-per-node=2", "--max-restarts=1", str(script)],
        env=env,
        cwd=tmp_path,
    )
    assert hello.returncode == 0, hello.stdout[-2000:] + hello.stderr[-2000:]
    assert "Warning" not in hello.stderr, hello.stderr[-3000:]
    for rank in (0, 1):
        assert f"hello from rank {rank} of 2 restart 0" in hello.stdout, hello.stdout

    program = run(
        [
            str(elastrun),
            "--standalone",
            "--nproc-per-node=2",
            "--no-python",
            "/bin/sh",
            "-c",
            'echo "program rank $RANK local $LOCAL_RANK"',
        ],
        env=env,
        cwd=tmp_path,
    )
    assert program.returncode == 0, program.stdout[-2000:] + program.stderr[-2000:]
    assert "Warning" not in program.stderr, program.stderr[-3000:]
    assert "program rank 0 local 0" in program.stdout
    assert "program rank 1 local 1" in program.stdout

    bad = run([str(elastrun), "--nnodes=x", str(script)], env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
