"""From a LaunchConfig to a Plan: the backend, endpoints and settings to use.

Applies torchrun's defaulting rules (``--standalone``; the default ``static``
backend on a single node becomes a standalone embedded store; an empty run id
becomes a generated one), reads the store's token (``--rdzv-conf token`` or
``token_file``, else the environment: :mod:`elastrun.store.token`), and checks
cross-flag rules. No sockets, no processes.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import Any

from elastrun.endpoint import Endpoint, parse_endpoint_list
from elastrun.errors import ConfigError
from elastrun.launcher.config import (
    DEFAULT_C10D_PORT,
    DEFAULT_ETCD_PORT,
    DEFAULT_MASTER_PORT,
    LaunchConfig,
    parse_rdzv_conf,
)
from elastrun.store.token import store_token

__all__ = ["BACKENDS", "Plan", "resolve"]

# --rdzv-backend name -> our implementation
BACKENDS = {
    "c10d": "c10d",
    "tcp": "c10d",
    "etcd": "etcd",
    "etcd-v2": "etcd",
    "etcd_v2": "etcd",
    "static": "static",
}
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0


@dataclass(frozen=True)
class Plan:
    config: LaunchConfig  # after defaulting (run_id, backend, endpoint filled in)
    backend: str  # "c10d" | "etcd" | "static"
    endpoints: tuple[Endpoint, ...]  # c10d: one; etcd: one or more; static: master
    conf: dict[str, Any]  # typed --rdzv-conf
    standalone: bool
    node_rank: int | None
    exit_barrier_timeout: float
    token: str | None
    # The run id was empty ("" asks for one, as torch's launcher) and was
    # generated here: other nodes cannot know it unless told.
    generated_run_id: bool = False
    token_source: str = "none"  # noqa: S105 - where the token came from, for messages

    @property
    def authenticated(self) -> bool:
        """Whether a stranger who reaches the job's store is refused: the
        embedded store with a token, or etcd with a user or a client
        certificate (etcd's own authentication). The static backend has no
        store (False)."""
        if self.backend == "c10d":
            return bool(self.token)
        if self.backend == "etcd":
            return bool(self.conf.get("user") or self.conf.get("cert"))
        return False

    @property
    def is_host(self) -> bool | None:
        """--rdzv-conf is_host (None: decide by address)."""
        value = self.conf.get("is_host")
        return None if value is None else bool(value)

    def rendezvous_timeouts(self) -> dict[str, float]:
        """The --rdzv-conf timeouts RendezvousSettings takes (only those given)."""
        out: dict[str, float] = {}
        join = self.conf.get("join_timeout", self.conf.get("timeout"))
        if join is not None:
            out["join_timeout"] = float(join)
        for key in ("last_call_timeout", "close_timeout", "lease_ttl"):
            if key in self.conf:
                out[key] = float(self.conf[key])
        out["exit_barrier_timeout"] = self.exit_barrier_timeout
        return out


def check_writable_dir(flag: str, path: str) -> None:
    """``path`` is, or can be made, a folder this process may write into:
    its nearest existing ancestor must be a writable folder (nothing is
    created here). A full disk is found later, when writing."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag}: {probe!r} exists and is not a folder (in {path!r})")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag}: cannot write into {probe!r} (in {path!r}): permission or read-only"
        )


def resolve(config: LaunchConfig) -> Plan:
    """Validate ``config`` and work out the backend to use. Raises ConfigError."""
    config.validate()
    conf = parse_rdzv_conf(config.rdzv_configs)
    backend = _backend(config.rdzv_backend)
    endpoint = config.rdzv_endpoint.strip()
    run_id, generated = config.run_id, False
    if not run_id:
        # As torch's launcher: an empty run id is a generated one. Only this
        # node knows it, so other nodes can join only if started with it
        # (the launcher says so when the job may have more than one node).
        run_id, generated = str(uuid.uuid4()), True
    standalone = config.standalone or (
        backend == "static"
        and not endpoint
        and config.master_port is None
        and config.max_nodes == 1  # torchrun: a single-node static launch needs no master port
    )
    if standalone:
        if config.max_nodes != 1 or config.min_nodes != 1:
            raise ConfigError(
                f"--standalone: runs a single node, but --nnodes asks for "
                f"{config.min_nodes}:{config.max_nodes}"
            )
        if "store_bind" in conf:
            raise ConfigError(
                "--rdzv-conf store_bind: --standalone keeps the store on 127.0.0.1; "
                "use --rdzv-backend=c10d with --rdzv-endpoint to serve other nodes"
            )
        backend, endpoint, run_id = "c10d", "127.0.0.1:0", str(uuid.uuid4())
        conf["is_host"] = True
    exit_barrier = config.exit_barrier_timeout
    if exit_barrier is None:
        exit_barrier = float(conf.get("exit_barrier_timeout", DEFAULT_EXIT_BARRIER_TIMEOUT))
    node_rank = config.node_rank
    endpoints: tuple[Endpoint, ...]
    if backend == "static":
        node_rank = _static_node_rank(config)
        endpoints = (_static_master(config, endpoint),)
    elif backend == "c10d":
        endpoint = endpoint or "localhost"  # torchrun's default: localhost:29400
        endpoints = (_c10d_endpoint(config, endpoint, standalone, conf),)
    else:  # etcd
        endpoint = endpoint or "localhost"  # torchrun's default: localhost:2379
        endpoints, https = parse_endpoint_list(endpoint, DEFAULT_ETCD_PORT, "--rdzv-endpoint")
        if https and "protocol" not in conf:
            conf["protocol"] = "https"
    if "store_bind" in conf and backend != "c10d":
        raise ConfigError(
            f"--rdzv-conf store_bind: only for the c10d backend's embedded store, not {backend}"
        )
    if backend != "static" and node_rank is not None and node_rank >= config.max_nodes:
        raise ConfigError(
            f"--node-rank: {node_rank} is out of range for --nnodes="
            f"{config.min_nodes}:{config.max_nodes} (expected 0..{config.max_nodes - 1})"
        )
    # The environment's token is the embedded store's (etcd has user/password).
    token = store_token(
        conf.get("token"), conf.get("token_file"), None if backend == "c10d" else {}
    )
    if config.log_dir:
        check_writable_dir("--log-dir", config.log_dir)
    resolved = dataclasses.replace(
        config,
        # Absolute once, here: workers get paths under it (error file,
        # heartbeat), and a script may change directory (as Hydra does).
        log_dir=os.path.abspath(config.log_dir) if config.log_dir else config.log_dir,
        events_file=os.path.abspath(config.events_file) if config.events_file else None,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        standalone=standalone,
    )
    return Plan(
        config=resolved,
        backend=backend,
        endpoints=endpoints,
        conf=conf,
        standalone=standalone,
        node_rank=node_rank,
        exit_barrier_timeout=exit_barrier,
        token=token.token,
        generated_run_id=generated and not standalone,
        token_source=token.source,
    )


def _backend(name: str) -> str:
    backend = BACKENDS.get(name.strip().lower())
    if backend is None:
        raise ConfigError(
            f"--rdzv-backend: unknown backend {name!r}; choose one of "
            "c10d (also tcp), etcd (also etcd-v2), static"
        )
    return backend


def _static_node_rank(config: LaunchConfig) -> int:
    """The static backend: a fixed number of nodes, each with its rank."""
    if config.min_nodes != config.max_nodes:
        raise ConfigError(
            f"--nnodes: the static backend needs a fixed number of nodes, got "
            f"{config.min_nodes}:{config.max_nodes} (use --rdzv-backend=c10d for a range)"
        )
    node_rank = config.node_rank
    if node_rank is None:
        if config.max_nodes > 1:
            raise ConfigError(
                f"--node-rank: required with --rdzv-backend=static and --nnodes="
                f"{config.max_nodes} (each node needs its own rank 0..{config.max_nodes - 1})"
            )
        node_rank = 0
    if node_rank >= config.max_nodes:
        raise ConfigError(
            f"--node-rank: {node_rank} is out of range for --nnodes={config.max_nodes} "
            f"(expected 0..{config.max_nodes - 1})"
        )
    return node_rank


def _static_master(config: LaunchConfig, endpoint: str) -> Endpoint:
    """The static backend's master: the endpoint (as torchrun), else the master flags."""
    if endpoint:
        master = Endpoint.parse(endpoint, DEFAULT_MASTER_PORT, "--rdzv-endpoint")
    else:
        port = config.master_port or DEFAULT_MASTER_PORT
        master = Endpoint.parse(config.master_addr, port, "--master-addr")
    if master.port == 0:
        raise ConfigError("--master-port: the static backend needs a fixed port, not 0")
    return master


def _c10d_endpoint(
    config: LaunchConfig, endpoint: str, standalone: bool, conf: dict[str, Any]
) -> Endpoint:
    """The embedded store's endpoint; port 0 (any free port) makes this node its host."""
    store = Endpoint.parse(endpoint, DEFAULT_C10D_PORT, "--rdzv-endpoint")
    if store.port == 0 and not standalone:
        if config.max_nodes != 1:
            raise ConfigError(
                "--rdzv-endpoint: port 0 (pick a free port) only works on a single node; "
                "other nodes could not find the port"
            )
        conf["is_host"] = True
    return store
