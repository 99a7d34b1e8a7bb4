"""One exact-size host memory pool for all streamed chunks (paper appendix B.2).

PyTorch's pinned-memory allocator rounds every request up to a power of two, which can waste
almost half of the host RAM that holds offloaded model states. The pool instead allocates one
ordinary host buffer of exactly the bytes needed and, on CUDA, page-locks it in place with
``cudaHostRegister``; chunk tensors are carved out of it as typed views.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ALIGN_BYTES = 64


class HostPool:
    def __init__(self, sizes: list[tuple[int, torch.dtype]], *, pin: bool, device: torch.device = torch.device("cpu")) -> None:
        """Reserve room for tensors of ``(numel, dtype)``; carve them in order with ``take``.
        ``device``: the host (the meta device in a size-only simulation)."""
        self.nbytes = pool_bytes(sizes)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)  # Adam moments start at 0
        self.pinned = False
        if pin and self.nbytes > 0:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with error {int(err)}")
            self.pinned = True
        self._offset = 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        start = _round(self._offset)
        end = start + numel * dtype.itemsize
        assert end <= self.nbytes, "host pool overflow"
        self._offset = end
        return self.buffer[start:end].view(dtype)

    def rewind(self) -> None:
        """Carve the same tensors again, from the start (a pool kept for reuse: their old
        values stay until overwritten)."""
        self._offset = 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False


def pool_bytes(sizes: list[tuple[int, torch.dtype]]) -> int:
    """The bytes of a pool holding tensors of ``(numel, dtype)``, each at a 64-byte boundary."""
    total = 0
    for numel, dtype in sizes:
        total = _round(total) + numel * dtype.itemsize
    return _round(total)


def _round(n: int) -> int:
    return (n + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES

