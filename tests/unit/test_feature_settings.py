"""Each feature's settings group in WorkerSpec, resolved once by the plan
(launcher/plan.py) from flags and the launcher's environment: the agent's
features read no environment (docs/cli.md, *Environment*)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from elastrun.agent.spec import (
    DEFAULT_GPU_RELEASE_TIMEOUT,
    DEFAULT_HEALTH_CHECK_HOSTS,
    DEFAULT_MEMORY_ROOT,
    DEFAULT_REPLICA_MAX_BYTES,
    DEFAULT_REPLICA_MAX_HEADER,
    FileTimerSettings,
)
from elastrun.errors import ConfigError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve

AGENT = Path(__file__).resolve().parents[2] / "src" / "elastrun" / "agent"
# The environment of the workers is set up here (their variables on top of the agent's).
ENV_SETUP = {"env.py"}
VARIABLES = (
    "ELASTRUN_GPU_RELEASE_TIMEOUT",
    "ELASTRUN_MEMORY_CHECKPOINT_ROOT",
    "ELASTRUN_REPLICA_MAX_BYTES",
    "ELASTRUN_REPLICA_MAX_HEADER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "ELASTRUN_HEALTH_CHECK_HOST",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "ELASTRUN_CACHE_DIR",
    "ELASTRUN_DEBUG",
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _spec(**kw: object):
    config = LaunchConfig(nproc_per_node=1, standalone=True, **kw)  # type: ignore[arg-type]
    return resolve(config)


def test_unset_variables_give_each_features_defaults() -> None:
    plan = _spec()
    spec = plan.workers
    assert spec.gpu_release.timeout == DEFAULT_GPU_RELEASE_TIMEOUT
    assert spec.memory.root == DEFAULT_MEMORY_ROOT
    assert spec.memory.replica_max_bytes == DEFAULT_REPLICA_MAX_BYTES
    assert spec.memory.replica_max_header == DEFAULT_REPLICA_MAX_HEADER
    assert spec.health_check.port is None and spec.health_check.hosts == DEFAULT_HEALTH_CHECK_HOSTS
    assert spec.file_timers == FileTimerSettings(enabled=False, path="")
    assert spec.warm.debug is False and spec.warm.cache  # a folder, resolved here
    assert plan.warnings == ()


def test_the_launchers_environment_fills_each_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ELASTRUN_GPU_RELEASE_TIMEOUT", "0")
    monkeypatch.setenv("ELASTRUN_MEMORY_CHECKPOINT_ROOT", str(tmp_path))
    monkeypatch.setenv("ELASTRUN_REPLICA_MAX_BYTES", "4096")
    monkeypatch.setenv("ELASTRUN_REPLICA_MAX_HEADER", " 2048 ")
    monkeypatch.setenv("TORCHELASTIC_HEALTH_CHECK_PORT", "8123")
    monkeypatch.setenv("ELASTRUN_HEALTH_CHECK_HOST", "10.0.0.5, [::]")
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(tmp_path / "t.fifo"))
    monkeypatch.setenv("ELASTRUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ELASTRUN_DEBUG", "1")
    spec = _spec().workers
    assert spec.gpu_release.timeout == 0.0
    assert spec.memory.root == str(tmp_path)
    assert (spec.memory.replica_max_bytes, spec.memory.replica_max_header) == (4096, 2048)
    assert spec.health_check.port == 8123 and spec.health_check.hosts == ("10.0.0.5", "::")
    assert spec.file_timers == FileTimerSettings(enabled=True, path=str(tmp_path / "t.fifo"))
    assert spec.warm.cache == str(tmp_path / "cache") and spec.warm.debug is True
    # --warm-cache wins over the environment
    assert _spec(warm_cache="/elsewhere").workers.warm.cache == "/elsewhere"


def test_the_replica_key_is_the_stores_token() -> None:
    config = LaunchConfig(
        nproc_per_node=1,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:29400",
        max_nodes=2,
        run_id="j",
        rdzv_configs={"token": "s3cret"},
    )
    spec = resolve(config).workers
    assert spec.memory.replica_secret == "s3cret"
    assert "s3cret" not in repr(spec)


def test_torchs_variables_may_come_from_the_launch_configs_env(tmp_path: Path) -> None:
    """As before: the Python API's LaunchConfig.env sets torch's variables too."""
    spec = _spec(
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_HEALTH_CHECK_PORT": "8124"}
    ).workers
    assert spec.file_timers.enabled and spec.file_timers.path == ""
    assert spec.health_check.port == 8124


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ELASTRUN_GPU_RELEASE_TIMEOUT", "soon"),
        ("ELASTRUN_GPU_RELEASE_TIMEOUT", "3601"),
        ("ELASTRUN_REPLICA_MAX_BYTES", "0"),
        ("ELASTRUN_REPLICA_MAX_HEADER", "\u0663"),
    ],
)
def test_a_bad_elastrun_number_refuses_the_launch_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"^{name}: "):
        _spec()


def test_a_bad_health_check_port_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_HEALTH_CHECK_PORT", "70000")
    plan = _spec()
    assert plan.workers.health_check.port is None
    assert plan.warnings == (
        "elastrun: warning: TORCHELASTIC_HEALTH_CHECK_PORT='70000' is not a port; "
        "no health check served",
    )


def _reads_environment(tree: ast.AST) -> list[int]:
    """Lines that read ``os.environ`` or call ``os.getenv`` (code, not text)."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            lines.append(node.lineno)
    return lines


def test_the_agents_features_read_no_environment() -> None:
    """No os.environ read in agent/ outside the workers' env setup (agent/env.py)."""
    found = {
        path.name: lines
        for path in sorted(AGENT.glob("*.py"))
        if path.name not in ENV_SETUP
        and (lines := _reads_environment(ast.parse(path.read_text(), str(path))))
    }
    assert found == {}
