"""The simulated device's memory: what CUDA's caching allocator would count as allocated.

[Note: simulated device memory]
A size-only simulation holds no bytes, so device memory is counted as the caching allocator
counts ``torch.cuda.memory_allocated``: every storage an operator creates on the device (an
output that aliases none of its inputs, ``torch.empty`` included) is allocated, in whole blocks
of 512 bytes, when the host issues the operator, and freed when its last tensor dies. A storage
the runtime handed to a side stream (``record_stream``) is freed once the work then queued on
that stream has ended, at the next allocation after that time (the allocator queries the
stream's event there, on the host's clock): the stream-ordered frees of streamed chunks and
swapped activations. An allocation the device cannot hold first waits (a host wait,
``ALLOCATOR_WAIT``), as the allocator synchronizes, for every such free; beyond that it raises
``torch.OutOfMemoryError`` (unless the simulated device only counts). ``peak`` is the most
allocated at once since ``reset_peak``.
Host memory is not counted: storages made inside ``memtrack.on_host()`` (the runtime's host
pools, staging and swap buffers), by the CPU worker's jobs, or by operators whose inputs all
live on the host. Not modeled: the allocator's fragmentation, cached free blocks
(``memory_reserved``) and per-stream pools (a freed block counts as free for every stream), and
the CUDA context's memory (the planner's margin covers them).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from protrain_core.memtrack import allocating_on_host
from protrain_core.utils import format_bytes, iter_tensors, when_freed

BLOCK = 512  # the caching allocator's smallest block and rounding
ALLOCATOR_WAIT = "allocator: the side streams' frees"  # a host wait before an allocation the device cannot hold


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


class DeviceMemory:
    """Allocated device bytes of a simulated device (see the Note): ``live`` now, ``peak``
    since ``reset_peak``; ``capacity``: the device's memory (None: counted, never refused);
    ``now()``: the allocating host lane's clock, ``wait(until)`` moves it there (a host wait);
    ``name``: the device in an out-of-memory error."""

    def __init__(self, capacity: int | None, now, wait, name: str) -> None:
        self.capacity, self.now, self.wait, self.name = capacity, now, wait, name
        self.live = self.peak = 0
        self._sizes: dict[StorageWeakRef, int] = {}  # device storages alive
        self._host: set[StorageWeakRef] = set()  # host storages alive
        self._streams: dict[StorageWeakRef, list] = {}  # device storages recorded on side streams
        self._pending: list[tuple[float, int]] = []  # (when a stream-ordered free returns, bytes)

    def operator(self, args, kwargs, out, *, on_host: bool) -> None:
        """Count the storages an operator created (``on_host``: run by a host thread's job)."""
        inputs = {StorageWeakRef(t.untyped_storage()) for t in iter_tensors((args, kwargs))}
        host = on_host or allocating_on_host() or (bool(inputs) and inputs <= self._host)
        for t in iter_tensors(out):
            storage = t.untyped_storage()
            key = StorageWeakRef(storage)
            if key in inputs or key in self._sizes or key in self._host:
                continue
            if host:
                self._host.add(key)
                weakref.finalize(storage, self._host.discard, key)
            else:
                self._allocate(key, storage)

    def adopt(self, tensors) -> None:
        """Count device tensors made before the device was entered (plain PyTorch's parameters)."""
        self.operator((), {}, list(tensors), on_host=False)

    def record_stream(self, t: Tensor, stream) -> None:
        """``t``'s memory is used by work queued on ``stream``: its free waits for that work."""
        key = StorageWeakRef(t.untyped_storage())
        if key in self._sizes:
            self._streams.setdefault(key, []).append(stream)

    def resize(self, storage, nbytes: int) -> None:
        """A device storage freed (``nbytes`` 0) or re-allocated in place (a chunk buffer)."""
        key = StorageWeakRef(storage)
        old = self._sizes.get(key)
        if old is None:
            return
        if nbytes:
            self._reserve(rounded(nbytes) - old)
        else:
            self._release(key, old)
        self._sizes[key] = rounded(nbytes)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _allocate(self, key: StorageWeakRef, storage) -> None:
        nbytes = rounded(storage.nbytes())
        self._reserve(nbytes)
        self._sizes[key] = nbytes
        when_freed(storage, self._free, key)

    def _reserve(self, nbytes: int) -> None:
        """``nbytes`` more allocated now (after the stream-ordered frees whose work has ended)."""
        now = self.now()
        if self.capacity is not None and self._pending and \
                self.live + nbytes - sum(n for t, n in self._pending if t <= now) > self.capacity:
            now = max(t for t, _ in self._pending)
            self.wait(now)  # the allocator synchronizes, and frees them all
        self.live -= sum(n for t, n in self._pending if t <= now)
        self._pending = [(t, n) for t, n in self._pending if t > now]
        if self.capacity is not None and self.live + nbytes > self.capacity:
            raise torch.OutOfMemoryError(
                f"Simulated out of memory on {self.name}: allocating {format_bytes(nbytes)} with "
                f"{format_bytes(self.live)} of {format_bytes(self.capacity)} allocated: the plan does not fit this "
                "device. Plan with a smaller memory budget or batch.")
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: StorageWeakRef) -> None:
        self._release(key, self._sizes.pop(key))

    def _release(self, key: StorageWeakRef, nbytes: int) -> None:
        """``nbytes`` of ``key`` freed: now, or once the work queued on the side streams it was
        recorded on has ended (a later allocation of it starts with no stream recorded)."""
        until = max((s.t for s in self._streams.pop(key, ())), default=0.0)
        if until > self.now():
            self._pending.append((until, nbytes))
        else:
            self.live -= nbytes
