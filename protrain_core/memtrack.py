"""Which tensors are alive: a dispatch-mode tracker of storages created by operators.

On the CPU there is no device allocator to ask, so memory held by activations is measured by
watching the operators themselves: every storage an operator allocates (an output that does
not alias one of its inputs) is recorded with its size and a weak reference, and
``live_bytes()`` sums the ones still alive. On CUDA ``torch.cuda.memory_allocated`` tells the
same for the device (and also counts what was allocated outside the tracker).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from protrain_core.utils import iter_tensors


class LiveStorageTracker(TorchDispatchMode):
    """Records the storages that operators run under it allocate.

        with LiveStorageTracker() as tracker:
            out = model(x)
        tracker.live_bytes()  # bytes of those storages still alive now
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self._sizes: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {StorageWeakRef(t.untyped_storage()) for t in iter_tensors((args, kwargs)) if t.layout is torch.strided}
        for t in iter_tensors(out):
            if t.layout is not torch.strided or (self.device is not None and t.device != self.device):
                continue
            key = StorageWeakRef(t.untyped_storage())
            if key not in inputs and key not in self._sizes:
                self._sizes[key] = t.untyped_storage().nbytes()
        return out

    def live_bytes(self, exclude=()) -> int:
        """Bytes of recorded storages still alive, leaving out the storages in ``exclude``."""
        exclude = set(exclude)
        return sum(n for key, n in self._sizes.items() if not key.expired() and key not in exclude)
