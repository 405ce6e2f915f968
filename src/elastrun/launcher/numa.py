"""``--numa-binding``: each worker's CPUs, near its GPU, as torchrun binds them.

torchrun runs each worker under ``numactl --physcpubind=CPUS``, CPUS chosen
from the NUMA topology of the GPU whose index is the worker's local rank
(torch.numa.binding). The same here, read from the kernel without torch:
the NVIDIA GPUs are the driver's (``/proc/driver/nvidia/gpus/<PCI address>``,
in PCI order, the order CUDA numbers identical GPUs in; ``CUDA_VISIBLE_DEVICES``
indices pick among them), each one's NUMA node is its PCI device's
(``/sys/bus/pci/devices/<address>/numa_node``; -1, a machine of one node, is
node 0) and a node's CPUs are ``/sys/devices/system/node/node<N>/cpulist``.

* ``node``: every CPU of the GPU's NUMA node;
* ``socket``: every CPU of the nodes of that node's socket;
* ``exclusive``: the node's CPUs split in equal, disjoint, contiguous shares
  among the local ranks whose GPUs are on that node (whole cores: a core's
  hardware threads stay together);
* ``core-complex``: one group of CPUs sharing the last-level cache on the
  node, a different one for each local rank on it (round robin when fewer).

Refused, with the reason, where the machine cannot: no NVIDIA GPU, no
``numactl``, or fewer GPUs than local ranks.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from elastrun.errors import ConfigError

__all__ = ["NUMA_MODES", "format_cpu_list", "numa_cpus", "parse_cpu_list"]

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
FLAG = "--numa-binding"


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``0-3,8``."""
    ranges: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            ranges.append(_span(run))
            run = []
        run.append(c)
    if run:
        ranges.append(_span(run))
    return ",".join(ranges)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read(65536).strip()


def _gpus(proc: str) -> list[str]:
    """The NVIDIA GPUs' PCI addresses, as CUDA numbers them (visible ones)."""
    try:
        found = sorted(os.listdir(os.path.join(proc, "driver/nvidia/gpus")))
    except OSError:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    picked = []
    for entry in visible.split(","):
        item = entry.strip()
        if not item.isdigit() or int(item) >= len(found):
            break  # as CUDA: the list ends at the first entry it cannot use
        picked.append(found[int(item)])
    return picked


def _node_of(sysfs: str, pci: str) -> int:
    try:
        return max(int(_read(os.path.join(sysfs, "bus/pci/devices", pci.lower(), "numa_node"))), 0)
    except (OSError, ValueError):
        return 0


def _node_cpus(sysfs: str, node: int) -> list[int]:
    try:
        return parse_cpu_list(_read(os.path.join(sysfs, f"devices/system/node/node{node}/cpulist")))
    except (OSError, ValueError):
        raise ConfigError(f"{FLAG}: cannot read the CPUs of NUMA node {node}") from None


def _cpu_file(sysfs: str, cpu: int, name: str) -> str:
    return _read(os.path.join(sysfs, f"devices/system/cpu/cpu{cpu}", name))


def _socket_cpus(sysfs: str, node: int) -> list[int]:
    cpus = _node_cpus(sysfs, node)
    try:
        socket = _cpu_file(sysfs, cpus[0], "topology/physical_package_id")
        nodes = parse_cpu_list(_read(os.path.join(sysfs, "devices/system/node/possible")))
    except (OSError, ValueError, IndexError):
        return cpus
    out: set[int] = set()
    for n in nodes:
        with_cpus = (
            _node_cpus(sysfs, n)
            if os.path.exists(os.path.join(sysfs, f"devices/system/node/node{n}/cpulist"))
            else []
        )
        if with_cpus and _cpu_file(sysfs, with_cpus[0], "topology/physical_package_id") == socket:
            out.update(with_cpus)
    return sorted(out)


def _groups(sysfs: str, cpus: list[int], name: str) -> list[list[int]]:
    """``cpus`` grouped by a shared list in sysfs (a core's threads, a cache's
    CPUs), in the order of their first CPU; a CPU without it is its own group."""
    groups: dict[str, list[int]] = {}
    for c in cpus:
        try:
            key = _cpu_file(sysfs, c, name)
        except OSError:
            key = str(c)
        groups.setdefault(key, []).append(c)
    return sorted(groups.values(), key=lambda g: g[0])


def _last_cache(sysfs: str, cpu: int) -> str:
    base = os.path.join(sysfs, f"devices/system/cpu/cpu{cpu}/cache")
    try:
        levels = [e for e in os.listdir(base) if e.startswith("index") and e[5:].isdigit()]
        best = max(levels, key=lambda e: int(_read(os.path.join(base, e, "level"))))
    except (OSError, ValueError):
        return "index0"
    return f"cache/{best}/shared_cpu_list"


def numa_cpus(
    mode: str | None, nproc: int, *, sysfs: str = "/sys", proc: str = "/proc"
) -> dict[int, str]:
    """Each local rank's CPUs for ``mode`` ({} when ``mode`` is None).
    Raises ConfigError naming what the machine lacks."""
    if mode is None:
        return {}
    if mode not in NUMA_MODES:
        raise ConfigError(f"{FLAG}: must be one of {', '.join(NUMA_MODES)}, got {mode!r}")
    gpus = _gpus(proc)
    if not gpus:
        raise ConfigError(
            f"{FLAG}: binds each worker to the CPUs near its GPU, and this machine has no "
            "visible NVIDIA GPU (none under /proc/driver/nvidia/gpus, or CUDA_VISIBLE_DEVICES "
            "hides them all); leave the flag out"
        )
    if shutil.which("numactl") is None:
        raise ConfigError(
            f"{FLAG}: numactl is not installed (e.g. apt install numactl); torchrun needs it too"
        )
    if nproc > len(gpus):
        raise ConfigError(
            f"{FLAG}: {nproc} workers but {len(gpus)} visible GPUs: local rank N is bound "
            "near GPU N"
        )
    nodes = [_node_of(sysfs, gpus[lr]) for lr in range(nproc)]
    out: dict[int, list[int]] = {}
    for lr, node in enumerate(nodes):
        if mode == "node":
            out[lr] = _node_cpus(sysfs, node)
        elif mode == "socket":
            out[lr] = _socket_cpus(sysfs, node)
        else:
            sharing = [r for r, n in enumerate(nodes) if n == node]
            cpus = _node_cpus(sysfs, node)
            if mode == "exclusive":
                cores = _groups(sysfs, cpus, "topology/thread_siblings_list")
                share = max(1, len(cores) // len(sharing))
                i = sharing.index(lr)
                picked = cores[i * share : (i + 1) * share] or cores[-1:]
            else:
                caches = _groups(sysfs, cpus, _last_cache(sysfs, cpus[0]))
                picked = [caches[sharing.index(lr) % len(caches)]]
            out[lr] = [c for group in picked for c in group]
    return {lr: format_cpu_list(cpus) for lr, cpus in out.items()}
