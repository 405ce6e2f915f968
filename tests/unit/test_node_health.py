"""``--health-check``: the command run by agent/node_health.py (real processes),
and its settings as the launcher resolves them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from elastrun.agent.node_health import run_check
from elastrun.errors import ConfigError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from tests.helpers import pid_alive, wait_for


def check(*argv: str, timeout: float = 30.0) -> tuple[str | None, str]:
    return asyncio.run(run_check(argv, timeout))


def test_a_command_that_exits_0_passes_and_others_fail_saying_how() -> None:
    assert check("true") == (None, "")
    assert check("sh", "-c", "echo fine") == (None, "fine")
    why, out = check("sh", "-c", "echo 'GPU 0: ERR!'; exit 3")
    assert why == "exited with code 3" and out == "GPU 0: ERR!"
    assert check("sh", "-c", "kill -KILL $$")[0] == "was killed by SIGKILL"
    why, _ = check("/nonexistent/nvidia-smi")
    assert why is not None and why.startswith("cannot run /nonexistent/nvidia-smi: ")


def test_only_the_last_output_is_kept() -> None:
    _, out = check("sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo; echo last")
    assert out.endswith("last") and len(out) <= 2048


def test_a_hanging_check_is_killed_with_its_process_group_and_fails(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    # The check leaves a child in its session, then hangs.
    script = f"sleep 600 & echo $! > {pidfile}; sleep 600"
    why, _ = check("sh", "-c", script, timeout=1.0)
    assert why == "timed out after 1 s (killed)"
    child = int(pidfile.read_text())
    wait_for(lambda: not pid_alive(child), 30, "the check's child killed with its group")


def test_the_flag_wins_over_the_rdzv_conf_keys() -> None:
    conf = {"health_check": "false", "health_check_timeout": "5", "health_check_interval": "30"}
    spec = resolve(LaunchConfig(rdzv_configs=conf)).workers.node_health
    assert (spec.command, spec.timeout, spec.interval) == (("false",), 5.0, 30.0)
    config = LaunchConfig(
        rdzv_configs=conf,
        health_check="sh -c 'nvidia-smi -L | grep -q GPU'",
        health_check_timeout=9,
    )
    spec = resolve(config).workers.node_health
    assert spec.command == ("sh", "-c", "nvidia-smi -L | grep -q GPU")
    assert (spec.timeout, spec.interval) == (9.0, 30.0)
    assert resolve(LaunchConfig()).workers.node_health.command == ()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LaunchConfig(health_check="sh -c 'unclosed"), "--health-check: No closing quotation"),
        (LaunchConfig(health_check_timeout=0), "--health-check-timeout"),
        (LaunchConfig(health_check_interval=-1), "--health-check-interval"),
        (LaunchConfig(rdzv_configs={"health_check_timeout": "0"}), "health_check_timeout"),
    ],
)
def test_bad_health_check_settings_are_refused_naming_them(
    config: LaunchConfig, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(config)


GPU_CHECK = Path(__file__).resolve().parents[2] / "examples" / "gpu_health_check.sh"


def fake_smi(bin_dir: Path, gpus: int, ecc: str) -> None:
    """An ``nvidia-smi`` that answers as a node with ``gpus`` GPUs whose ECC
    counters read ``ecc`` (the documented check needs no GPU to test)."""
    bin_dir.mkdir(exist_ok=True)
    lines = "".join(f"echo 'GPU {i}: Fake H100 (UUID: GPU-{i})'\n" for i in range(gpus))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"-L) {lines or 'true'}\n;;\n"
        f"*) for i in $(seq {max(gpus, 1)}); do echo '{ecc}'; done ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)


@pytest.mark.parametrize(
    ("gpus", "ecc", "env", "verdict"),
    [
        (2, "0", {"ELASTRUN_EXPECTED_GPUS": "2"}, None),
        (1, "[N/A]", {}, None),
        (1, "0", {"ELASTRUN_EXPECTED_GPUS": "2"}, "nvidia-smi lists 1 GPUs, 2 expected"),
        (0, "0", {}, "nvidia-smi lists 0 GPUs, 1 expected"),
        (2, "3", {}, "a GPU reports 3 uncorrected ECC errors"),
        (
            1,
            "0",
            {"ELASTRUN_HEALTH_DIRS": "/nonexistent/ckpt"},
            "cannot write to /nonexistent/ckpt",
        ),
    ],
)
def test_the_documented_gpu_check_set(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    ecc: str,
    env: dict[str, str],
    verdict: str | None,
) -> None:
    fake_smi(tmp_path / "bin", gpus, ecc)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    why, out = check("sh", str(GPU_CHECK))
    if verdict is None:
        assert (why, out) == (None, "healthy")
    else:
        assert why == "exited with code 1" and out == f"unhealthy: {verdict}"


def test_the_gpu_check_fails_without_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert check("/bin/sh", str(GPU_CHECK)) == (
        "exited with code 1",
        "unhealthy: nvidia-smi not found",
    )
