"""How many workers ``--nproc-per-node=cpu|gpu|xpu|auto`` means: the CPUs,
NVIDIA GPUs and Intel GPUs this process may use, counted without importing
torch (or starting anything but, where the driver's folder is missing,
``nvidia-smi -L``)."""

from __future__ import annotations

import os
import re

__all__ = ["count_cpus", "count_gpus", "count_xpus"]


def count_cpus() -> int:
    """The CPUs this process may run on."""
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
