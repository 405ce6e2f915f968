"""GPU saves through a stand-in for the GPU (train/host_copy): each slot's
mapping is registered as pinned memory once and unregistered before it is
closed; the device's copies are queued, and the snapshot is hashed and
committed only after they are done (the stand-in runs them only when their
event is waited on, so a commit that did not wait would seal zeros); a
refused registration is said once and the saves go on. Real slot files,
real torch on the CPU; no GPU was used."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from elastrun.train.host_copy import HostCopier  # noqa: E402
from elastrun.train.memory import MemoryCheckpoint  # noqa: E402
from tests.unit.test_memory_snapshot import folder  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("folder")  # a slot folder in ELASTRUN_MEMORY_CHECKPOINT_DIR


class _Queued:
    """Copies the stand-in runs when waited on (as a GPU runs them later)."""

    def __init__(self, device: StandIn, pairs: list[tuple[Any, Any]]) -> None:
        self.device, self.pairs = device, pairs

    def wait(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)
        self.device.calls.append(("done", len(self.pairs)))
        self.pairs = []


class StandIn:
    """A GPU that owns the tensors given to it (CPU tensors in fact)."""

    def __init__(self, owned: list[Any], refuse: str | None = None) -> None:
        self.owned = owned
        self.refuse = refuse
        self.calls: list[tuple[str, Any]] = []
        self.pinned: set[int] = set()

    def owns(self, tensor: Any) -> bool:
        return any(tensor is t for t in self.owned)

    def register(self, ptr: int, size: int) -> str | None:
        self.calls.append(("register", (ptr, size)))
        if self.refuse is None:
            self.pinned.add(ptr)
        return self.refuse

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))
        assert ptr in self.pinned
        self.pinned.remove(ptr)

    def copy_async(self, pairs: list[tuple[Any, Any]]) -> _Queued:
        self.calls.append(("queue", len(pairs)))
        return _Queued(self, pairs)


def _with(mem: MemoryCheckpoint, device: StandIn, lines: list[str] | None = None) -> None:
    mem._copier = HostCopier(None if lines is None else lines.append, device=lambda: device)


def _state(step: int, n: int = 1024) -> tuple[dict[str, Any], list[Any]]:
    gpu = [torch.full((n,), float(step)), torch.arange(n, dtype=torch.bfloat16).reshape(8, -1)]
    return {"w": gpu[0], "b": gpu[1], "cpu": torch.full((3,), -float(step)), "step": step}, gpu


def test_each_slot_is_pinned_once_and_commits_wait_for_the_device_copies() -> None:
    device = StandIn([])
    mem = MemoryCheckpoint(log=None)  # 3 slots
    _with(mem, device)
    for step in range(1, 8):
        state, gpu = _state(step)
        device.owned[:] = gpu
        mem.save(state, step=step)
    mem.close()
    registered = [args for kind, args in device.calls if kind == "register"]
    assert len(registered) == 3 and len({ptr for ptr, _ in registered}) == 3
    assert all(size >= 1024 * 4 for _, size in registered)
    assert [k for k, _ in device.calls].count("queue") == 7
    assert [k for k, _ in device.calls].count("done") == 7
    assert device.pinned == set()  # every slot unregistered before it was closed
    got = MemoryCheckpoint(log=None).load()  # the digest covers what the device copied
    state, _ = _state(7)
    assert got is not None and got["step"] == 7
    for key in ("w", "b", "cpu"):
        assert torch.equal(got[key], state[key]), key


def test_a_slot_remapped_for_a_larger_state_is_unregistered_first() -> None:
    device = StandIn([])
    mem = MemoryCheckpoint(log=None, slots=2)
    _with(mem, device)
    for step, n in ((1, 64), (2, 64), (3, 1 << 16), (4, 1 << 16)):
        state, gpu = _state(step, n)
        device.owned[:] = gpu
        mem.save(state, step=step)
    mem.wait()
    kinds = [k for k, _ in device.calls if k in ("register", "unregister")]
    assert kinds == ["register", "register", "unregister", "register", "unregister", "register"]
    assert len(device.pinned) == 2
    mem.close()
    assert device.pinned == set()
    got = MemoryCheckpoint(log=None).load()
    assert got is not None and got["step"] == 4
    assert torch.equal(got["w"], _state(4, 1 << 16)[0]["w"])


def test_a_refused_registration_is_said_once_and_saves_go_on() -> None:
    device = StandIn([], refuse="cudaHostRegister returned error 2")
    lines: list[str] = []
    mem = MemoryCheckpoint(log=None)
    _with(mem, device, lines)
    for step in range(1, 6):
        state, gpu = _state(step)
        device.owned[:] = gpu
        mem.save(state, step=step)
    mem.close()
    assert len(lines) == 1 and "not pinned (cudaHostRegister returned error 2)" in lines[0]
    assert [k for k, _ in device.calls].count("register") == 3  # once per slot, not per save
    assert [k for k, _ in device.calls].count("unregister") == 0
    got = MemoryCheckpoint(log=None).load()
    assert got is not None and got["step"] == 5 and torch.equal(got["w"], _state(5)[0]["w"])


def test_a_state_without_device_tensors_never_asks_for_a_device() -> None:
    asked: list[int] = []

    def no_gpu() -> None:
        asked.append(1)

    mem = MemoryCheckpoint(log=None)
    mem._copier = HostCopier(None)  # the real one: torch.cuda only for GPU tensors
    mem._copier._device_factory = no_gpu
    mem.save({"w": torch.ones(4)}, step=1)
    mem.close()
    assert asked == []


def test_large_cpu_tensors_copied_by_torch_round_trip_exactly() -> None:
    big = torch.randn(1536, 1536)  # 9 MiB: over LARGE, copied by torch's copy_
    state = {
        "t": big.t(),  # strided
        "h": torch.randn(5 << 20).to(torch.bfloat16),  # 10 MiB
        "b": torch.rand(9 << 20) > 0.5,  # 9 MiB of bools
        "small": torch.arange(7),
    }
    mem = MemoryCheckpoint(log=None)
    mem.save(state, step=3)
    mem.close()
    got = MemoryCheckpoint(log=None).load()
    assert got is not None
    for key, t in state.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
