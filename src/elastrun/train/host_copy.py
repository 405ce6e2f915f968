"""Copying a state's tensors into a slot (:mod:`elastrun.train.memory`): on the
CPU a plain memory copy; from a GPU, copies that do not hold the training
thread.

* CPU tensors: the small ones copied in the calling thread
  (:func:`~elastrun.train.state_codec.copy_into`: a plain memory copy each),
  those of ``LARGE`` bytes or more by torch's ``copy_``, which spreads one
  copy over its threads (as fast as a plain copy of the same bytes by
  torch; measured in ``bench/memory_save.py``).
* GPU tensors: the slot's mapping is registered once as pinned host memory
  (``cudaHostRegister``: the GPU copies into it by DMA, at the bus's speed,
  with no staging buffer; unregistered before the mapping is closed). The
  copies are queued ``non_blocking`` on a side stream, after the work
  already queued on the tensors' stream, and an event is recorded after
  them. ``save`` returns at once; the training stream waits for that event
  on the GPU (not the CPU), so no kernel queued after the save changes a
  tensor before its copy is done. The thread that hashes and commits the
  snapshot waits for the event first (:meth:`Pending.wait`): the next
  ``save`` waits for that commit, and the agent reads only committed slots.

A registration the driver refuses (a memlock limit, an old driver) is said
once and the copies go on into pageable memory: correct, slower.

Not measured on a GPU yet (docs/benchmarks.md). The tests drive this code
with a stand-in for the GPU (:class:`Device`): tensors on the CPU that it
treats as device tensors, and copies it runs only when their event is waited on.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from typing import Any, Protocol

from elastrun.train.log import Log, say
from elastrun.train.state_codec import Flat, copy_into

__all__ = ["Device", "HostCopier", "Pending"]

LARGE = 8 << 20  # a CPU tensor of this many bytes or more is copied by torch, on its threads


class Pending(Protocol):
    """Copies queued on a device: ``wait`` returns once they are done."""

    def wait(self) -> None: ...


class Device(Protocol):
    """What the copier needs of the GPU (torch.cuda; a stand-in in tests)."""

    def owns(self, tensor: Any) -> bool:
        """Whether ``tensor`` lives on this device (its copies are queued)."""
        ...

    def register(self, ptr: int, size: int) -> str | None:
        """Pin ``size`` bytes at ``ptr``; None, or why it could not."""
        ...

    def unregister(self, ptr: int) -> None: ...

    def copy_async(self, pairs: list[tuple[Any, Any]]) -> Pending:
        """Queue ``dst.copy_(src)`` for each pair; the training stream waits
        for them on the device."""
        ...


class _Done:
    def wait(self) -> None:
        pass


class _Held:
    """Queued copies, with their tensors kept alive until they are done."""

    def __init__(self, events: list[Any], keep: list[Any]) -> None:
        self._events = events
        self._keep = keep

    def wait(self) -> None:
        try:
            for e in self._events:
                e.synchronize()
        finally:
            self._keep.clear()


class Cuda:
    """:class:`Device` over torch.cuda: a side stream per device."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._streams: dict[Any, Any] = {}

    def owns(self, tensor: Any) -> bool:
        return bool(tensor.device.type == "cuda")

    def register(self, ptr: int, size: int) -> str | None:
        cudart = self._torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(ptr, size, 0)  # cudaHostRegisterDefault
        code = int(getattr(err, "value", err))
        return None if code == 0 else f"cudaHostRegister returned error {code}"

    def unregister(self, ptr: int) -> None:
        self._torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]

    def copy_async(self, pairs: list[tuple[Any, Any]]) -> Pending:
        torch = self._torch
        by_device: dict[Any, list[tuple[Any, Any]]] = {}
        for dst, src in pairs:
            by_device.setdefault(src.device, []).append((dst, src))
        events, keep = [], []
        for device, group in by_device.items():
            current = torch.cuda.current_stream(device)
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)  # the tensors' values as the work queued so far leaves them
            with torch.cuda.stream(side):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(side)
                event = torch.cuda.Event()
                event.record(side)
            current.wait_event(event)  # later kernels change the tensors only after their copy
            events.append(event)
            keep += [t for pair in group for t in pair]
        return _Held(events, keep)


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` is mapped (the buffer export is released at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class HostCopier:
    """Copies a flattened state into slot mappings (see the module doc);
    registers each mapping with the device once, and lets go of it
    (:meth:`unmapping`) before the mapping is closed."""

    def __init__(self, log: Log, device: Callable[[], Device | None] | None = None) -> None:
        self.log = log
        self._device_factory = device or _cuda
        self._stand_in = device is not None  # a test's device: asked about every tensor
        self._device: Device | None = None
        self._looked = False
        self._pinned: dict[int, int] = {}  # slot -> its mapping's address, registered
        self._refused: set[int] = set()  # slots whose registration was refused
        self._warned = False

    def device(self) -> Device | None:
        if not self._looked:
            self._device, self._looked = self._device_factory(), True
        return self._device

    def copy(self, flat: Flat, slot: int, mm: mmap.mmap, start: int) -> Pending:
        """Copy ``flat``'s tensors into ``mm`` at ``start`` (each at its entry's
        offset): the CPU ones now, the device ones queued (wait on the result)."""
        on_device = self._stand_in or any(_on_gpu(t) for _, t in flat.tensors)
        device = self.device() if on_device else None
        here = [(k, t, e) for (k, t), e in zip(flat.tensors, flat.entries, strict=True)]
        queued = [(k, t, e) for k, t, e in here if device is not None and device.owns(t)]
        host = [(k, t, e) for k, t, e in here if device is None or not device.owns(t)]
        small = [(k, t, e) for k, t, e in host if e.nbytes < LARGE]
        for _, t, e in host:
            if e.nbytes >= LARGE:  # torch's copy: spread over its threads
                dst = _host_view(mm, start + e.offset, t)
                dst.copy_(t.detach())
                del dst
        copy_into(
            Flat([(k, t) for k, t, _ in small], flat.tree, tuple(e for *_, e in small)), mm, start
        )
        if device is None or not queued:
            return _Done()
        self._pin(device, slot, mm)
        pairs = [
            (_host_view(mm, start + e.offset, t), t.detach()) for _, t, e in queued if e.nbytes
        ]
        return device.copy_async(pairs) if pairs else _Done()

    def _pin(self, device: Device, slot: int, mm: mmap.mmap) -> None:
        if slot in self._pinned or slot in self._refused:
            return
        ptr = _address(mm)
        why = device.register(ptr, len(mm))
        if why is None:
            self._pinned[slot] = ptr
            return
        self._refused.add(slot)
        if not self._warned:
            self._warned = True
            say(
                self.log,
                f"=> warning: memory checkpoint slots are not pinned ({why}); GPU copies go "
                "through pageable memory (slower). A container needs IPC_LOCK and a memlock "
                "limit above the slots' size (docs/training.md: memory checkpoints)",
            )

    def unmapping(self, slot: int) -> None:
        """The mapping of ``slot`` is about to be closed: unregister it."""
        self._refused.discard(slot)
        ptr = self._pinned.pop(slot, None)
        if ptr is not None and self._device is not None:
            self._device.unregister(ptr)


def _on_gpu(t: Any) -> bool:
    return bool(t.device.type != "cpu")


def _host_view(mm: mmap.mmap, at: int, like: Any) -> Any:
    import torch

    dst = torch.frombuffer(mm, dtype=like.dtype, count=like.numel(), offset=at)
    return dst.view(like.shape)


def _cuda() -> Device | None:
    import torch

    return Cuda() if torch.cuda.is_available() else None
