"""Launcher configurations: each launcher at its defaults and tuned to its
best (docs/benchmarks.md, "What is launched"), and the check that a launcher
can start at all."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.paths import REPO, WORKER


@dataclass(frozen=True)
class LauncherConfig:
    """One launcher at one set of settings, e.g. ``torchrun`` tuned."""

    name: str
    launcher: str  # "torchrun" or "elastrun"
    tuned: bool
    flags: tuple[str, ...] = ()
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def base_command(self) -> list[str]:
        module = "torch.distributed.run" if self.launcher == "torchrun" else "elastrun"
        return [sys.executable, "-m", module]

    def argv(self, flags: Sequence[str], rdzv_conf: Mapping[str, str] | None = None) -> list[str]:
        """The full command line: launcher, scenario flags, this config's
        flags and rendezvous settings, then the worker script."""
        conf = dict(self.rdzv_conf)
        conf.update(rdzv_conf or {})
        argv = [*self.base_command, *flags, *self.flags]
        if conf:
            argv.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
        return [*argv, str(WORKER)]

    def describe(self) -> str:
        parts = [" ".join(self.flags) or "(no extra flags)"]
        if self.rdzv_conf:
            parts.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in self.rdzv_conf))
        else:
            parts.append("rendezvous timeouts at the launcher's defaults")
        if self.env:
            parts.append("env " + " ".join(f"{k}={v}" for k, v in self.env))
        return "; ".join(parts)


TORCHRUN_DEFAULT = LauncherConfig("torchrun-default", "torchrun", tuned=False)
ELASTRUN_DEFAULT = LauncherConfig("elastrun-default", "elastrun", tuned=False)
# torchrun at its best on one machine: the shortest last call it accepts
# (integer seconds), a 1 s keep-alive, the fastest monitor tick, and its own
# (non-shared) TCP store for workers, without which restarts and scale-ups on
# c10d hang or fail at torch 2.13.
TORCHRUN_TUNED = LauncherConfig(
    "torchrun-tuned",
    "torchrun",
    tuned=True,
    flags=("--monitor-interval=0.1",),
    rdzv_conf=(("last_call_timeout", "1"), ("keep_alive_interval", "1")),
    env=(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),),
)
ELASTRUN_TUNED = LauncherConfig(
    "elastrun-tuned",
    "elastrun",
    tuned=True,
    flags=("--monitor-interval=0.1",),
    rdzv_conf=(("last_call_timeout", "1"), ("lease_ttl", "2")),
)
# Alternating A B A B within each repetition.
DEFAULT_CONFIGS = (TORCHRUN_DEFAULT, ELASTRUN_DEFAULT, TORCHRUN_TUNED, ELASTRUN_TUNED)


def counterpart(cfg: LauncherConfig, configs: Iterable[LauncherConfig]) -> LauncherConfig | None:
    """The torchrun config an elastrun config is compared with (same tuning)."""
    if cfg.launcher != "elastrun":
        return None
    for other in configs:
        if other.launcher == "torchrun" and other.tuned == cfg.tuned:
            return other
    return None


def check_launcher(cfg: LauncherConfig, timeout: float = 30.0) -> str | None:
    """``None`` when ``<launcher> --help`` works, else why not (one line)."""
    try:
        proc = subprocess.run(
            [*cfg.base_command, "--help"],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            start_new_session=True,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"`{cfg.launcher} --help` did not answer within {timeout:.0f}s"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    tail = lines[-1] if lines else ""
    return f"`{cfg.launcher} --help` exited {proc.returncode}: {tail}"[:300]
