"""Launch configuration: the pure parsing and validation of launcher flags.

Nothing here touches the network or starts processes (except counting GPUs
for ``--nproc-per-node=gpu|auto``). Every error is a
:class:`~elastrun.errors.ConfigError` whose message starts with the flag it is
about, e.g. ``--nnodes: minimum 3 is larger than maximum 1 (in '3:1')``.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastrun.endpoint import Endpoint, parse_endpoint_list
from elastrun.errors import ConfigError
from elastrun.launcher.limits import (
    CONF_SECONDS,
    FLAG_SECONDS,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    MAX_RESTARTS,
    check_int,
    check_seconds,
    machine_nproc_limit,
    parse_ascii_int,
    parse_seconds,
    worker_cost,
)
from elastrun.names import check_run_id
from elastrun.procs import signal_name

__all__ = [
    "DEFAULT_C10D_PORT",
    "DEFAULT_ETCD_PORT",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_SIGNALS",
    "DEFAULT_STACK_SIGNAL",
    "RDZV_CONF_KEYS",
    "LaunchConfig",
    "count_gpus",
    "count_xpus",
    "parse_endpoint",
    "parse_endpoints",
    "parse_nnodes",
    "parse_nproc",
    "parse_ranks_filter",
    "parse_rdzv_conf",
    "parse_signals",
    "parse_stack_signal",
    "parse_std",
]

DEFAULT_C10D_PORT = 29400
DEFAULT_ETCD_PORT = 2379
DEFAULT_MASTER_PORT = 29500
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
DEFAULT_STACK_SIGNAL = int(signal.SIGRTMIN) + 5
_RT_SIGNAL = re.compile(r"SIGRT(MIN|MAX)(?:([+-])([0-9]{1,3}))?")

# --rdzv-conf keys: name -> kind. "float": seconds in the key's range
# (limits.CONF_SECONDS), "bool" accepts 1/0/true/false/yes/no, "str" anything
# non-empty.
RDZV_CONF_KEYS: dict[str, str] = {
    "join_timeout": "float",
    "last_call_timeout": "float",
    "close_timeout": "float",
    "read_timeout": "float",
    "timeout": "float",  # torch's etcd/static spelling of the join timeout
    "lease_ttl": "float",
    "exit_barrier_timeout": "float",
    "is_host": "bool",
    "token": "str",
    "token_file": "str",
    "store_bind": "str",  # where the hosted c10d store listens (launcher/bind.py)
    # etcd
    "cacert": "str",
    "cert": "str",
    "key": "str",
    "user": "str",
    "password": "str",
    "key_prefix": "str",
    "protocol": "str",  # torch's etcd: http | https
}
# torch keys accepted for compatibility and ignored (their job is done otherwise).
RDZV_CONF_IGNORED = {
    "use_libuv": "the embedded store is always asyncio",
    "keep_alive_interval": "liveness is a lease; set lease_ttl",
    "keep_alive_max_attempt": "liveness is a lease; set lease_ttl",
    "heartbeat": "liveness is a lease; set lease_ttl",
    "store_type": "the store is chosen by --rdzv-backend",
    "rank": "static mode uses --node-rank",
}

_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^([0-9]+:[0-3],)*[0-9]+:[0-3]$")
_NPROC = re.compile(r"[+-]?[0-9]{1,64}")
_BAD_ADDR_CHARS = "/@?#,\\"
MAX_ROLE_LEN = 128
NPROC_WHY = "elastrun's limit per agent"


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a launch needs except what to run (torch's ``LaunchConfig``).

    Field names follow torch's ``torch.distributed.launcher.api.LaunchConfig``
    where one exists. ``node_rank=None`` means "not given".
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    # "" (torch's default in its LaunchConfig): a generated id (see plan.resolve).
    run_id: str = "none"
    role: str = "default"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    node_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    log_dir: str | None = None
    # local_rank -> Std bits; key -1 applies to every local rank.
    redirects: Mapping[int, int] = field(default_factory=dict)
    tee: Mapping[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    signals_to_handle: tuple[signal.Signals, ...] = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    shutdown_timeout: float = 30.0
    log_template: str | None = None  # None: the agent's default "[{host}:{rank}]"
    # torch's LaunchConfig field: a TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    # (${rank}, ${local_rank}, ${role_name}); lines then look as under torchrun.
    # Not used when log_template is given.
    log_line_prefix_template: str | None = None
    events_file: str | None = None
    hang_timeout: float | None = None
    # hang_timeout is the floor of each rank's own calibrated timeout
    # (``--hang-timeout auto[:FLOOR]``; see agent/watchdog.py).
    hang_auto: bool = False
    # The signal that makes a worker write its Python stacks when a hang is
    # declared (agent/stacks.py); None: no stacks are collected.
    stack_signal: int | None = DEFAULT_STACK_SIGNAL
    exit_barrier_timeout: float | None = None  # None: --rdzv-conf or 300 s
    env: Mapping[str, str] = field(default_factory=dict)  # extra worker environment
    # Fork workers from a warm interpreter (agent/spares.py); only for Python
    # commands the launcher builds (a script or -m module).
    prewarm: bool = True
    prewarm_modules: str = "installed"  # "installed" | "all" | "torch"
    prewarm_cache: str | None = None  # None: $ELASTRUN_CACHE_DIR or ~/.cache/elastrun
    warm_join_timeout: float | None = None  # None: 60 s
    # --require-logs: lost worker output fails a job whose workers succeeded.
    require_logs: bool = False

    def validate(self) -> None:
        """Check types and value ranges; raise ConfigError naming the flag."""
        check_int("--nnodes", self.min_nodes, 1, MAX_NODES)
        check_int("--nnodes", self.max_nodes, 1, MAX_NODES)
        if self.min_nodes > self.max_nodes:
            raise ConfigError(
                f"--nnodes: minimum {self.min_nodes} is larger than maximum {self.max_nodes}"
            )
        check_int("--nproc-per-node", self.nproc_per_node, 1, MAX_NPROC_PER_NODE, NPROC_WHY)
        self.check_machine_nproc()
        check_int("--max-restarts", self.max_restarts, 0, MAX_RESTARTS)
        check_seconds(
            "--monitor-interval", self.monitor_interval, FLAG_SECONDS["--monitor-interval"]
        )
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigError(
                f"--start-method: must be spawn, fork or forkserver, got {self.start_method!r}"
            )
        if self.node_rank is not None:
            check_int("--node-rank", self.node_rank, 0, MAX_NODES - 1)
        if self.master_port is not None:
            if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
                raise ConfigError(f"--master-port: expected an integer, got {self.master_port!r}")
            if not 0 < self.master_port < 65536:
                raise ConfigError(f"--master-port: must be in 1..65535, got {self.master_port}")
        self._check_timeouts()
        check_stack_signal(self.stack_signal, self.signals_to_handle)
        if self.prewarm_modules not in ("installed", "all", "torch"):
            raise ConfigError(
                f"--prewarm-modules: must be installed, all or torch, got {self.prewarm_modules!r}"
            )
        check_role(self.role)
        if self.run_id != "":  # "" asks for a generated id
            check_run_id(self.run_id, "--rdzv-id")
        if self.local_addr is not None:
            check_address("--local-addr", self.local_addr)
        self._check_output()
        parse_rdzv_conf(self.rdzv_configs)

    def _check_timeouts(self) -> None:
        check_seconds(
            "--shutdown-timeout", self.shutdown_timeout, FLAG_SECONDS["--shutdown-timeout"]
        )
        for flag, value in (
            ("--hang-timeout", self.hang_timeout),
            ("--exit-barrier-timeout", self.exit_barrier_timeout),
            ("--warm-join-timeout", self.warm_join_timeout),
        ):
            if value is not None:
                check_seconds(flag, value, FLAG_SECONDS[flag])

    def _check_output(self) -> None:
        """The worker output flags: redirects, tee, the rank filter, the line prefix."""
        for name, std in (("--redirects", self.redirects), ("--tee", self.tee)):
            for local_rank, bits in std.items():
                if local_rank < -1 or bits not in (0, 1, 2, 3):
                    raise ConfigError(f"{name}: bad entry {local_rank}:{bits}")
        if self.local_ranks_filter is not None:
            for r in self.local_ranks_filter:
                check_int("--local-ranks-filter", r, 0, MAX_NPROC_PER_NODE - 1)
        if self.log_template is not None:
            check_log_template(self.log_template)

    def check_machine_nproc(self) -> None:
        """``nproc_per_node`` against what this machine lets one agent hold."""
        files = self.log_dir is not None or any(self.redirects.values()) or any(self.tee.values())
        procs, fds = worker_cost(files, self.prewarm)
        limit = machine_nproc_limit(procs, fds)
        if limit is not None and self.nproc_per_node > limit[0]:
            raise ConfigError(
                f"--nproc-per-node: {self.nproc_per_node} workers are more than this machine "
                f"allows one agent ({limit[0]}): {limit[1]}"
            )


def check_role(role: object) -> str:
    """A role name: 1 to 128 printable characters (it is shown on consoles
    and in ``elastrun status``, and must agree between nodes)."""
    if not isinstance(role, str) or not role:
        raise ConfigError("--role: must not be empty")
    if len(role) > MAX_ROLE_LEN:
        raise ConfigError(f"--role: at most {MAX_ROLE_LEN} characters, got {len(role)}")
    if not role.isprintable():
        raise ConfigError(f"--role: {role!r} contains control characters")
    return role


def check_address(flag: str, addr: object) -> str:
    """A host name or IP address as given (not resolved): no spaces, control
    characters or URL/path punctuation, at most 255 characters."""
    if not isinstance(addr, str) or not addr.strip():
        raise ConfigError(f"{flag}: must not be empty")
    if len(addr) > 255:
        raise ConfigError(f"{flag}: at most 255 characters, got {len(addr)}")
    if not addr.isascii() or any(
        c.isspace() or not c.isprintable() or c in _BAD_ADDR_CHARS for c in addr
    ):
        raise ConfigError(f"{flag}: {addr!r} is not a host name or IP address")
    return addr


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max), validated."""
    parts = text.split(":")
    if len(parts) == 1:
        lo = hi = parse_ascii_int("--nnodes", parts[0])
    elif len(parts) == 2:
        lo, hi = parse_ascii_int("--nnodes", parts[0]), parse_ascii_int("--nnodes", parts[1])
    else:
        raise ConfigError(f"--nnodes: expected N or MIN:MAX, got {text!r}")
    if lo <= 0 or hi <= 0:
        raise ConfigError(f"--nnodes: the number of nodes must be at least 1 (got {text!r})")
    if lo > hi:
        raise ConfigError(f"--nnodes: minimum {lo} is larger than maximum {hi} (in {text!r})")
    check_int("--nnodes", hi, 1, MAX_NODES)
    return lo, hi


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _visible_devices_cap() -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES allows (None: not set)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    count = 0
    for raw in value.split(","):
        item = raw.strip()
        if not item or item.startswith("-"):
            break  # CUDA stops at the first invalid entry
        count += 1
    return count


def count_gpus() -> int:
    """NVIDIA GPUs visible to workers, without importing torch."""
    physical = 0
    proc = "/proc/driver/nvidia/gpus"
    try:
        physical = len(os.listdir(proc))
    except OSError:
        import subprocess

        try:
            out = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15, check=False
            )
            if out.returncode == 0:
                physical = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            physical = 0
    cap = _visible_devices_cap()
    return physical if cap is None else min(physical, cap)


def count_xpus(sysfs: str = "/sys/class/drm") -> int:
    """Intel GPUs (torch's ``xpu``) visible to workers, without importing torch:
    DRM cards of vendor 0x8086 driven by i915 or xe, capped by ZE_AFFINITY_MASK."""
    count = 0
    try:
        names = os.listdir(sysfs)
    except OSError:
        names = []
    for name in names:
        if not re.fullmatch(r"card\d+", name):
            continue
        device = os.path.join(sysfs, name, "device")
        try:
            with open(os.path.join(device, "vendor"), encoding="ascii") as fp:
                vendor = fp.read().strip()
            driver = os.path.basename(os.readlink(os.path.join(device, "driver")))
        except (OSError, ValueError):
            continue
        if vendor == "0x8086" and driver in ("i915", "xe"):
            count += 1
    mask = os.environ.get("ZE_AFFINITY_MASK", "").strip()
    if mask:  # "0,1" or "0.0,0.1": count the root devices named
        count = min(count, len({item.split(".")[0].strip() for item in mask.split(",")}))
    return count


def parse_nproc(text: str) -> int:
    """``N``, ``cpu``, ``gpu``, ``xpu`` or ``auto`` -> number of workers on this node."""
    value = text.strip().lower()
    if value == "cpu":
        return _cpu_count()
    if value == "xpu":
        xpus = count_xpus()
        if xpus == 0:
            raise ConfigError(
                "--nproc-per-node: 'xpu' asks for one worker per Intel XPU, but none is "
                "visible (no Intel i915/xe card in /sys/class/drm, or ZE_AFFINITY_MASK hides "
                "them); give a number instead"
            )
        return xpus
    if value in ("gpu", "cuda"):
        gpus = count_gpus()
        if gpus == 0:
            raise ConfigError(
                "--nproc-per-node: 'gpu' asks for one worker per GPU, but no NVIDIA GPU is "
                "visible (no /proc/driver/nvidia/gpus, no 'nvidia-smi -L', or "
                "CUDA_VISIBLE_DEVICES hides them); give a number instead"
            )
        return gpus
    if value == "auto":
        return count_gpus() or count_xpus() or _cpu_count()
    if _NPROC.fullmatch(value) is None:
        shown = text if len(text) <= 64 else text[:64] + "..."
        raise ConfigError(
            f"--nproc-per-node: expected a number (ASCII digits), 'auto', 'cpu', 'gpu' or "
            f"'xpu', got {shown!r}"
        )
    n = int(value)
    if n <= 0:
        raise ConfigError(f"--nproc-per-node: must be at least 1, got {text!r}")
    return check_int("--nproc-per-node", n, 1, MAX_NPROC_PER_NODE, NPROC_WHY)


def parse_endpoint(text: str, default_port: int, flag: str = "--rdzv-endpoint") -> Endpoint:
    """``host``, ``host:port``, ``[v6]:port``, ``[v6]`` or a bare IPv6 address."""
    return Endpoint.parse(text, default_port, flag)


def parse_endpoints(text: str, default_port: int) -> tuple[Endpoint, ...]:
    """A comma-separated list of endpoints (etcd); ``http(s)://`` prefixes allowed."""
    return parse_endpoint_list(text, default_port, "--rdzv-endpoint")[0]


def _unquote(text: str) -> str:
    """``'x'`` or ``"x"`` -> ``x`` (one level of matching quotes)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def parse_rdzv_conf(conf: str | Mapping[str, Any]) -> dict[str, Any]:
    """``k=v,k=v`` (or a mapping) -> typed values; unknown keys are errors.

    Quotes that no shell removed are tolerated as torchrun tolerates them: one
    level of matching quotes around the whole text (``'k=v,k=v'``, as
    PyTorch's own launcher tests pass it), an item, a key or a value is
    dropped. Values cannot hold commas, quoted or not (as in torchrun)."""
    pairs: list[tuple[str, Any]] = []
    if isinstance(conf, str):
        text = _unquote(conf.strip())
        if text:
            for item in text.split(","):
                key, sep, value = _unquote(item.strip()).partition("=")
                key, value = _unquote(key.strip()), _unquote(value.strip())
                if not key or not sep:
                    raise ConfigError(
                        f"--rdzv-conf: {item.strip()!r} is not key=value "
                        "(expected <key1>=<value1>,<key2>=<value2>,...)"
                    )
                if not value:
                    raise ConfigError(f"--rdzv-conf: {key} has an empty value")
                pairs.append((key, value))
    else:
        pairs = list(conf.items())
    known = sorted(RDZV_CONF_KEYS)
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in RDZV_CONF_IGNORED:
            out[key] = value
            continue
        kind = RDZV_CONF_KEYS.get(key)
        if kind is None:
            raise ConfigError(f"--rdzv-conf: unknown key {key!r}; known keys: {', '.join(known)}")
        out[key] = _conf_value(key, kind, value)
    if "token" in out and "token_file" in out:
        raise ConfigError("--rdzv-conf: give token or token_file, not both")
    if "protocol" in out and out["protocol"] not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf: protocol must be http or https, got {out['protocol']!r}")
    return out


def _conf_value(key: str, kind: str, value: Any) -> Any:
    if kind == "float":
        name, rng = f"--rdzv-conf: {key}", CONF_SECONDS[key]
        if isinstance(value, str):
            return parse_seconds(name, value, rng)
        return check_seconds(name, value, rng)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--rdzv-conf: {key} must be 1 or 0 (true/false), got {value!r}")
    text = str(value)
    if not text:
        raise ConfigError(f"--rdzv-conf: {key} has an empty value")
    if any(c in text for c in "\x00\n\r"):
        raise ConfigError(f"--rdzv-conf: {key} contains a NUL or line break")
    return text


def parse_std(text: str, flag: str) -> dict[int, int]:
    """torchrun's ``3`` or ``0:1,1:2`` -> {local_rank: bits}; ``-1`` means all."""
    value = text.strip()
    if _STD_VALUE.match(value):
        bits = int(value)
        return {-1: bits} if bits else {}
    if _STD_MAPPING.match(value):
        out: dict[int, int] = {}
        for item in value.split(","):
            rank, bits_text = item.split(":")
            out[int(rank)] = int(bits_text)
        return out
    raise ConfigError(
        f"{flag}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or a per-local-rank "
        f"mapping like 0:1,1:2, got {text!r}"
    )


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    value = text.strip()
    if not value:
        return None
    items = [x.strip() for x in value.split(",")]
    if any(_NPROC.fullmatch(x) is None for x in items):
        raise ConfigError(
            f"--local-ranks-filter: expected comma-separated local ranks like 0,1,2, got {text!r}"
        )
    ranks = frozenset(int(x) for x in items)
    if any(r < 0 for r in ranks):
        raise ConfigError(f"--local-ranks-filter: local ranks are >= 0, got {text!r}")
    for r in ranks:
        check_int("--local-ranks-filter", r, 0, MAX_NPROC_PER_NODE - 1)
    return ranks


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    out: list[signal.Signals] = []
    for item in text.split(","):
        name = item.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise ConfigError(
                f"--signals-to-handle: unknown signal {item.strip()!r} "
                "(expected names like SIGTERM,SIGUSR1)"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ConfigError(f"--signals-to-handle: {name} cannot be handled or forwarded")
        if sig not in out:
            out.append(sig)
    return tuple(out)


def parse_stack_signal(text: str) -> int | None:
    """``--stack-signal``: ``SIGRTMIN+N``, ``SIGRTMAX-N``, ``SIGUSR1``,
    ``SIGUSR2`` (``SIG`` optional, any case) or ``none`` -> its number (None: off)."""
    raw = text.strip().upper()
    if raw in ("NONE", "OFF"):
        return None
    name = raw if raw.startswith("SIG") else "SIG" + raw
    if name in ("SIGUSR1", "SIGUSR2"):
        return int(signal.Signals[name])
    lo, hi = int(signal.SIGRTMIN), int(signal.SIGRTMAX)
    rt = _RT_SIGNAL.fullmatch(name)
    if rt is not None:
        offset = int(rt[3] or 0) * (-1 if rt[2] == "-" else 1)
        signum = (lo if rt[1] == "MIN" else hi) + offset
        if lo <= signum <= hi:
            return signum
    raise ConfigError(
        f"--stack-signal: expected SIGRTMIN+N or SIGRTMAX-N (N in 0..{hi - lo}), SIGUSR1, "
        f"SIGUSR2 or none, got {text.strip()!r}"
    )


def check_stack_signal(signum: object, handled: tuple[signal.Signals, ...]) -> None:
    """The stack signal: a real-time signal, SIGUSR1 or SIGUSR2 that the
    agent does not also forward to the workers (None: off)."""
    if signum is None:
        return
    if isinstance(signum, bool) or not isinstance(signum, int):
        raise ConfigError(f"--stack-signal: expected a signal number or None, got {signum!r}")
    allowed = {int(signal.SIGUSR1), int(signal.SIGUSR2)}
    if signum not in allowed and not int(signal.SIGRTMIN) <= signum <= int(signal.SIGRTMAX):
        raise ConfigError(
            f"--stack-signal: {signal_name(signum)} cannot be used: a real-time signal, "
            "SIGUSR1 or SIGUSR2 only (the others stop, pause or matter to the worker)"
        )
    if signum in {int(s) for s in handled}:
        raise ConfigError(
            f"--stack-signal: {signal_name(signum)} is also in --signals-to-handle (forwarded "
            "to the workers, where it would write stacks instead); choose another"
        )


_TEMPLATE_FIELDS = {
    "host": "h",
    "rank": 0,
    "local_rank": 0,
    "role": "default",
    "group_rank": 0,
    "restart": 0,
}


def check_log_template(template: str) -> None:
    if "$" in template:
        return  # torch's ${rank} spelling: string.Template, never fails
    try:
        template.format(**_TEMPLATE_FIELDS)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"--log-template: {template!r} is not a valid template ({exc}); fields: "
            + ", ".join("{" + k + "}" for k in _TEMPLATE_FIELDS)
        ) from None
