"""Which tensors are alive: a dispatch-mode tracker of storages created by operators.

On the CPU there is no device allocator to ask (on CUDA, ``torch.cuda.memory_allocated``), so
activation memory is measured by watching the operators: every storage an operator allocates
(an output that aliases none of its inputs) is recorded with its size, and a finalizer on the
storage object (PyTorch keeps one Python object per storage) subtracts it when it is freed.
Not recorded: the engine's chunk buffers, which it counts itself (made inside ``untracked()``),
and host memory -- host pools, staging and swap buffers, in the same memory on a CPU "device" --
made inside ``on_host()``, which also tells a simulated device that they are not its memory.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from protrain_core.utils import iter_tensors, when_freed

_local = threading.local()


@contextmanager
def untracked():
    """Allocations made inside are not recorded by any LiveStorageTracker (this thread)."""
    previous = getattr(_local, "skip", False)
    _local.skip = True
    try:
        yield
    finally:
        _local.skip = previous


@contextmanager
def on_host():
    """Allocations made inside are host memory: no LiveStorageTracker records them, and a
    simulated device does not count them as its own (this thread)."""
    previous = getattr(_local, "host", False)
    _local.host = True
    try:
        with untracked():
            yield
    finally:
        _local.host = previous


def allocating_on_host() -> bool:
    return getattr(_local, "host", False)


class LiveStorageTracker(TorchDispatchMode):
    """Records the storages that operators run under it allocate.

        with LiveStorageTracker() as tracker:
            out = model(x)
        tracker.live        # bytes of those storages alive now (running total, O(1) per operator)
        tracker.peak        # the most that were alive at once (after any operator)
        tracker.live_bytes()  # recomputed from the recorded storages

    ``on_op(func, before, after, seconds)``, if given, is called after every operator with the
    live bytes before it ran and right after it (its new outputs included), and its run time.
    """

    def __init__(self, device: torch.device | str | None = None, *, on_op=None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.on_op = on_op
        self._sizes: dict[StorageWeakRef, int] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.live
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        if not getattr(_local, "skip", False):
            inputs = {StorageWeakRef(t.untyped_storage()) for t in iter_tensors((args, kwargs)) if t.layout is torch.strided}
            for t in iter_tensors(out):
                if t.layout is not torch.strided or (self.device is not None and t.device != self.device):
                    continue
                storage = t.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in inputs and key not in self._sizes:
                    nbytes = storage.nbytes()
                    self._sizes[key] = nbytes
                    self.live += nbytes
                    when_freed(storage, self._freed, key, nbytes)
            self.peak = max(self.peak, self.live)
        if self.on_op is not None:
            self.on_op(func, before, self.live, seconds)
        return out

    def _freed(self, key: StorageWeakRef, nbytes: int) -> None:
        self.live -= nbytes
        self._sizes.pop(key, None)

    def live_bytes(self, exclude=()) -> int:
        """Bytes of recorded storages still alive, leaving out the storages in ``exclude``."""
        exclude = set(exclude)
        return sum(n for key, n in list(self._sizes.items()) if not key.expired() and key not in exclude)
