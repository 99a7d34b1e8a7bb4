"""Swapping saved activations to host memory and back ([Note: swapping] in activations.py): host
buffers come from a size-class pool (pinned in place on CUDA), and autograd's in-place version
check survives the saved-tensor hooks.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from protrain_core.memtrack import on_host
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.host_pool import PageLocked


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of 8 sizes per power of two (at most 12.5 % more)."""
    step = max(64, 1 << max(0, nbytes.bit_length() - 4))  # 1/8 of the power of two below nbytes
    return -(-nbytes // step) * step


class HostBuffers:
    """Host byte buffers for swapped storages on ``ctx``, reused across iterations: requests are
    rounded up to a ``size_class``; ``trim()`` frees the buffers no request used since the last."""

    def __init__(self, ctx: DeviceContext) -> None:
        self.ctx = ctx
        self.pin = ctx.is_cuda
        self._free: dict[int, list[Tensor]] = {}
        self._all: dict[int, Tensor] = {}  # id -> buffer
        self._locked: dict[int, PageLocked] = {}  # id -> its page-locking (CUDA)
        self._used: set[int] = set()  # ids handed out since the last trim
        self.nbytes = 0

    def get(self, nbytes: int) -> Tensor:
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
        else:
            self.ctx.check_host_memory(size, "swapped activations")
            if self.pin:  # its own pages, unpinned before they are freed ([Note: page-locking in place])
                locked = PageLocked(size, device=self.ctx.device, what="swapped activations")
                buf = locked.tensor
                self._locked[id(buf)] = locked
            else:
                with on_host():
                    buf = torch.empty(size, dtype=torch.uint8, device=self.ctx.host)
            self._all[id(buf)] = buf
            self.nbytes += size
        self._used.add(id(buf))
        return buf

    def put(self, buf: Tensor) -> None:
        if id(buf) in self._all:
            self._free.setdefault(buf.numel(), []).append(buf)

    def trim(self) -> None:
        idle = [b for bufs in self._free.values() for b in bufs if id(b) not in self._used]
        if idle:
            self.ctx.synchronize_stream(self.ctx.swap_stream)  # no copy may still read them
            for buf in idle:
                self._release(buf)
        self._used.clear()

    def _release(self, buf: Tensor) -> None:
        bufs = self._free[buf.numel()]
        bufs.pop(next(k for k, b in enumerate(bufs) if b is buf))
        del self._all[id(buf)]
        self.nbytes -= buf.numel()
        locked = self._locked.pop(id(buf), None)
        if locked is not None:
            locked.close()

    def storages(self) -> list[StorageWeakRef]:
        return [StorageWeakRef(b.untyped_storage()) for b in self._all.values()]

    def close(self) -> None:
        for locked in self._locked.values():
            locked.close()
        self._locked.clear()
        self._all.clear()
        self._free.clear()
        self._used.clear()
        self.nbytes = 0


class SwapRecord:
    """One device storage copied to host memory (and, in backward, back to the device)."""

    __slots__ = ("host", "nbytes", "in_buf", "in_event", "__weakref__")

    def __init__(self, host: Tensor, nbytes: int) -> None:
        self.host = host  # a pool buffer of at least nbytes
        self.nbytes = nbytes
        self.in_buf: Tensor | None = None
        self.in_event = None


class Packed:
    """What autograd keeps for one swapped saved tensor: a view of a swapped storage."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "original", "version")

    def __init__(self, record: SwapRecord, t: Tensor) -> None:
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.original = weakref.ref(t)
        self.version = t._version


class Counted:
    """A saved tensor ``t`` that stays where it is. A non-leaf is held detached (a saved *output*
    itself would make a reference cycle through its grad_fn); a leaf (a parameter) is held as is,
    like autograd does, so it reads whatever its ``.data`` is when backward runs."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: Tensor) -> None:
        self.tensor = t if t.grad_fn is None else t.detach()
        self.version = t._version


def check_version(t: Tensor | None, version: int) -> None:
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead. (Raised by ProTrain's activation hooks; the in-place operation is a "
            "bug in the model that plain PyTorch reports too.)"
        )
