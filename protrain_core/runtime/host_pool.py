"""Host memory page-locked in place, and an exact-size pool of it for each streamed chunk (paper
appendix B.2): PyTorch's pinned-memory allocator rounds every request up to a power of two, so
the pool allocates one ordinary host buffer of exactly the bytes needed, page-locks it in place
with ``cudaHostRegister`` on CUDA, and carves chunk tensors out of it as typed views.

[Note: page-locking in place]
``cudaHostRegister`` works on whole pages, and fails for a page already registered (error 712).
So a registered buffer owns its pages: ``PageLocked`` allocates a page more than it needs and
registers the page-aligned whole pages inside (a ``malloc`` buffer can share its first or last
page with a registered neighbour). And memory is never freed while registered (a later
allocation at the same addresses could not be registered): the buffer is a NumPy array that its
views keep alive, and a ``weakref.finalize`` on it unregisters the pages when the last view is
gone, before NumPy frees the memory. ``close()`` unregisters earlier, once. A failed cudart call
also leaves CUDA's "last error", which PyTorch's next kernel launch on that thread would raise
as its own; ``_consume_cuda_error`` takes it first.

[Note: what is page-locked]
Only what a copy engine reads or writes is page-locked: a streamed chunk's host compute copy,
its accumulator where gradients land in it (no separate master), a quantised chunk's host
store, the worker's staging buffers and swapped activations. The master, a mixed-precision
accumulator and the optimizer states only the CPU worker touches stay pageable: in the mixed
modes with fp32 moments 2 of the 18 bytes per trainable parameter are locked
(``ChunkFormat.host_tensors``). Locked memory cannot be swapped by the OS and its registration
costs time at ``wrap`` (about 8 GB/s on the H200); a copy that touches pageable memory (a
re-plan) is slower but rare. ``offload_states`` is not rare (reinforcement learning parks the
engine at every rollout), so the host buffer it parks a chunk in is page-locked whole.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import weakref

import torch
from torch import Tensor

from protrain_core.memtrack import on_host

_ALIGN_BYTES = 64
_PAGE = mmap.PAGESIZE


class PageLocked:
    """``nbytes`` of zeroed host memory page-locked in place on CUDA ``device`` for ``what`` ([Note:
    page-locking in place]): ``tensor`` views it; ``close()`` unregisters it before its last view."""

    def __init__(self, nbytes: int, *, device: torch.device, what: str) -> None:
        import numpy

        span = -(-nbytes // _PAGE) * _PAGE
        if span == 0:  # nothing to lock
            self.tensor, self._finalizer = torch.zeros(0, dtype=torch.uint8), None
            return
        owner = numpy.zeros(span + _PAGE, dtype=numpy.uint8)  # calloc: zeroed pages, touched when registered
        start = -owner.ctypes.data % _PAGE
        ptr = owner.ctypes.data + start
        err = torch.cuda.cudart().cudaHostRegister(ptr, span, 0)
        if int(err) != 0:
            _consume_cuda_error(device)
            raise RuntimeError(f"cudaHostRegister of {span} bytes for {what} failed with CUDA error {int(err)} "
                               f"({_error_string(err)}).")
        self.tensor = torch.from_numpy(owner[start : start + nbytes])  # keeps ``owner`` alive
        self._finalizer = weakref.finalize(owner, _unregister, ptr, device)
        self._finalizer.atexit = False  # at exit the process's registrations end with it

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # once: a second call, or the array's end later, does nothing


def _unregister(ptr: int, device: torch.device) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0 and not sys.is_finalizing():
        _consume_cuda_error(device)


def _error_string(err) -> str:
    try:
        return torch.cuda.cudart().cudaGetErrorString(err)
    except Exception:  # noqa: BLE001 - an error code the binding cannot name: the number says it
        return "see cudaError_t"


def _consume_cuda_error(device: torch.device) -> None:
    """Take CUDA's last error on this thread (see the Note): a kernel launch raises it here."""
    with contextlib.suppress(RuntimeError), torch.cuda.device(device):
        torch.ones(1, device=device).add_(1)


class HostPool:
    def __init__(self, tensors: list[tuple[int, torch.dtype, bool]], *, pin: bool,
                 device: torch.device = torch.device("cpu"), cuda: torch.device | None = None, touch=None) -> None:
        """Reserve room for ``tensors`` of ``(numel, dtype, moves)``, carved in that order by
        ``take``: those that ``moves`` page-locked for CUDA device ``cuda`` (None: the current one)
        when ``pin``, the others pageable ([Note: what is page-locked]). ``device``: the host;
        ``touch(t)``: zeroes the pageable region, its pages' first touch (None: here)."""
        self._order = [moves for _, _, moves in tensors]
        self.pinned_nbytes, self.pageable_nbytes = (pool_bytes([(n, dtype) for n, dtype, m in tensors if m == moves])
                                                    for moves in (True, False))
        self.nbytes = self.pinned_nbytes + self.pageable_nbytes
        self._locked = None
        with on_host():  # the moving region (page-locked when ``pin``), then the pageable one
            if pin and self.pinned_nbytes > 0:
                cuda = cuda or torch.device("cuda", torch.cuda.current_device())
                self._locked = PageLocked(self.pinned_nbytes, device=cuda, what="the streamed chunks' host memory")
                moving = self._locked.tensor
            else:
                moving = torch.zeros(self.pinned_nbytes, dtype=torch.uint8, device=device)  # Adam moments start at 0
            if touch is None or device.type == "meta":
                pageable = torch.zeros(self.pageable_nbytes, dtype=torch.uint8, device=device)
            else:
                pageable = torch.empty(self.pageable_nbytes, dtype=torch.uint8, device=device)
                touch(pageable)
        self._regions = {True: moving, False: pageable}
        self.rewind()

    @property
    def locked_bytes(self) -> int:
        """Bytes page-locked now."""
        return self.pinned_nbytes if self._locked is not None else 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The next tensor of the order given, from its region."""
        moves = self._order[self._next]
        self._next += 1
        start = _round(self._offsets[moves])
        end = start + numel * dtype.itemsize
        region = self._regions[moves]
        assert end <= region.numel(), "host pool overflow"
        self._offsets[moves] = end
        return region[start:end].view(dtype)

    def rewind(self) -> None:
        """Carve the same tensors again, from the start (their old values stay)."""
        self._offsets, self._next = {True: 0, False: 0}, 0

    def close(self) -> None:
        """Unpin now (the memory stays until its last view is gone)."""
        if self._locked is not None:
            self._locked.close()
            self._locked = None


def pool_bytes(sizes: list[tuple[int, torch.dtype]]) -> int:
    """The bytes of a pool holding tensors of ``(numel, dtype)``, each at a 64-byte boundary."""
    total = 0
    for numel, dtype in sizes:
        total = _round(total) + numel * dtype.itemsize
    return _round(total)


def _round(n: int) -> int:
    return (n + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
