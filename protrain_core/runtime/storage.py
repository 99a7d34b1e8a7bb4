"""One chunk's storage: the tensors it holds, where they live, and the only byte formula.

[Note: chunk storage]
A chunk of ``S`` elements (the layout's chunk size; ``c`` = compute dtype, ``m`` = master dtype:
fp32, or bf16 in bf16-true) holds, when it trains (``ChunkFormat`` with ``keeps_master``):

  tensor         elements  dtype  persistent chunk        streamed chunk
  compute copy   S         c      device, always          device buffer while resident
  host copy      s         c      --                      host (pinned pool)
  master         s         m      device                  host
  grad. accum.   s         m      device (if grads)       host (if grads)
  grad. buffer   S         c      -- (lands in accum.)    device, during backward (if grads)
  Adam states    k * s     m      device                  host          (k = 2, 3 with amsgrad)

``s`` is this rank's shard: ``ceil(S / world)`` rounded up to the layout's alignment (``S``
itself in one process); the compute copy is then padded to ``s * world`` elements so that an
all-gather of equal shards assembles it. The master is a tensor of its own only when its dtype
differs from the compute dtype (the mixed modes); otherwise it *is* the compute copy's own
elements (the host copy of a streamed chunk, this rank's slice of a persistent one's).
A chunk with no trainable member (``keeps_master=False``: frozen weights, LoRA's base model)
holds the compute copy only -- the host copy when streamed -- and no master, accumulator,
buffer for gradients or Adam state.

Everything that needs a chunk's size asks ``ChunkFormat``: the engine's allocation (here), the
host pool's size, the runtime's device-memory bound, and the profiler's static facts, which
are all the cost model knows of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from protrain_core.memtrack import untracked
from protrain_core.precision import Precision
from protrain_core.runtime.host_pool import HostPool
from protrain_core.structure.layout import ChunkLayout, align


@dataclass(frozen=True, kw_only=True)
class ChunkFormat:
    """What one chunk stores (see [Note: chunk storage])."""

    numel: int  # the layout's chunk size, in elements
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    keeps_master: bool = True  # False: the compute copy only (a chunk with no trainable member)
    grads: bool = True  # a gradient accumulator (some member requires gradients)
    adam_states: int = 2  # Adam state tensors next to the master: 0, 2, or 3 with amsgrad
    world_size: int = 1  # processes the states are sharded over

    def __post_init__(self) -> None:
        assert self.keeps_master or (not self.grads and not self.adam_states), "a compute-only chunk trains nothing"
        assert self.adam_states in (0, 2, 3) and self.world_size >= 1

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's shard of the master, accumulator and Adam states."""
        if self.world_size == 1:
            return self.numel
        return align(-(-self.numel // self.world_size))

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered compute copy (``numel`` in one process)."""
        return self.shard_numel * self.world_size

    @property
    def separate_master(self) -> bool:
        return self.keeps_master and self.compute_dtype != self.master_dtype

    def _state_bytes(self) -> int:
        """Master (when separate), accumulator and Adam states of this rank's shard."""
        n = int(self.separate_master) + int(self.grads) + self.adam_states
        return n * self.shard_numel * self.master_dtype.itemsize

    @property
    def persistent_device_bytes(self) -> int:
        """Device bytes of the chunk when it is persistent."""
        return self.padded_numel * self.compute_dtype.itemsize + self._state_bytes()

    @property
    def streamed_host_bytes(self) -> int:
        """Host bytes of the chunk when it is streamed (before the pool's 64-byte alignment)."""
        return self.shard_numel * self.compute_dtype.itemsize + self._state_bytes()

    @property
    def buffer_device_bytes(self) -> int:
        """Device bytes of a streamed chunk while resident: its compute copy, plus the gradient
        buffer of a backward pass when it has gradients."""
        return (1 + int(self.grads)) * self.padded_numel * self.compute_dtype.itemsize

    @property
    def upload_bytes(self) -> int:
        """Bytes one fetch copies host -> device (this rank's shard; the gather does the rest)."""
        return self.shard_numel * self.compute_dtype.itemsize

    def host_tensors(self) -> list[tuple[int, torch.dtype]]:
        """(elements, dtype) of a streamed chunk's host tensors, in allocation order."""
        s, m = self.shard_numel, self.master_dtype
        out = [(s, m)] if self.separate_master else []
        out.append((s, self.compute_dtype))
        out += [(s, m)] * (int(self.grads) + self.adam_states)
        return out


class ChunkStorage:
    """The tensors of one chunk, allocated by ``ChunkFormat`` (see [Note: chunk storage]).

    ``device_copy`` is one permanent tensor; a streamed chunk frees its memory with
    ``untyped_storage().resize_(0)`` and re-allocates it in place (FSDP2's technique), so
    views taken of it stay valid ([Note: parameter access] in chunk.py).
    """

    def __init__(self, fmt: ChunkFormat, *, persistent: bool, device: torch.device, pool: HostPool | None,
                 n_members: int, rank: int = 0) -> None:
        self.fmt = fmt
        self.persistent = persistent
        self.device = device
        self.grad_buffer: Tensor | None = None  # streamed: this backward's gradients, on the device
        with torch.no_grad():
            if persistent:
                self._allocate_persistent(rank)
            else:
                self._allocate_streamed(pool)
        home = self.master if self.master is not None else self.compute_home
        self.steps = [torch.zeros((), dtype=torch.float32, device=home.device) for _ in range(n_members)]

    def _allocate_persistent(self, rank: int) -> None:
        fmt, dev = self.fmt, self.device
        zeros = lambda: torch.zeros(fmt.shard_numel, dtype=fmt.master_dtype, device=dev)  # noqa: E731
        self.device_copy = torch.zeros(fmt.padded_numel, dtype=fmt.compute_dtype, device=dev)
        self.host_copy = None
        own = self.device_copy if fmt.world_size == 1 else self.device_copy[rank * fmt.shard_numel:(rank + 1) * fmt.shard_numel]
        self.master = zeros() if fmt.separate_master else own if fmt.keeps_master else None
        self._allocate_states(zeros)

    def _allocate_streamed(self, pool: HostPool) -> None:
        fmt = self.fmt
        take = lambda: pool.take(fmt.shard_numel, fmt.master_dtype)  # noqa: E731
        master = take() if fmt.separate_master else None
        self.host_copy = pool.take(fmt.shard_numel, fmt.compute_dtype)
        self.master = master if master is not None else self.host_copy if fmt.keeps_master else None
        self._allocate_states(take)
        self.device_copy = torch.empty(fmt.padded_numel, dtype=fmt.compute_dtype, device=self.device)
        self.free_device_copy()

    def _allocate_states(self, make) -> None:
        fmt = self.fmt
        self.grad_acc = make() if fmt.grads else None
        self.exp_avg = make() if fmt.adam_states else None
        self.exp_avg_sq = make() if fmt.adam_states else None
        self.max_exp_avg_sq = make() if fmt.adam_states == 3 else None

    @staticmethod
    def host_pool(formats: list[ChunkFormat], *, pin: bool) -> HostPool:
        """One exact-size pool for the host tensors of these (streamed) chunks."""
        return HostPool([t for fmt in formats for t in fmt.host_tensors()], pin=pin)

    # ----- where the compute copy is --------------------------------------------------------
    @property
    def compute_home(self) -> Tensor:
        """Where the up-to-date compute copy rests: the device copy of a persistent chunk, the
        host copy of a streamed one."""
        return self.device_copy if self.persistent else self.host_copy

    def allocate_device_copy(self) -> None:
        storage = self.device_copy.untyped_storage()
        storage.resize_(self.device_copy.numel() * self.device_copy.element_size())

    def free_device_copy(self) -> None:
        self.device_copy.untyped_storage().resize_(0)

    @property
    def device_copy_allocated(self) -> bool:
        return self.device_copy.untyped_storage().nbytes() > 0

    def allocate_grad_buffer(self) -> Tensor:
        with untracked():  # chunk memory: counted by device_bytes(), not as activations
            self.grad_buffer = torch.zeros(self.fmt.padded_numel, dtype=self.fmt.compute_dtype, device=self.device)
        return self.grad_buffer

    def free_grad_buffer(self) -> None:
        self.grad_buffer = None

    # ----- accounting -------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes of device memory this chunk holds right now, read from the storages."""
        tensors = [self.device_copy, self.grad_buffer]
        if self.persistent:
            tensors += [self.grad_acc, self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq]
            if self.fmt.separate_master:
                tensors.append(self.master)
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)

    def static_tensors(self) -> list[Tensor]:
        """Tensors whose storages hold model states (never activations)."""
        return [t for t in (self.device_copy, self.host_copy, self.master) if t is not None]


def chunk_formats(model: nn.Module, optimizer: torch.optim.Optimizer, layout: ChunkLayout, precision: Precision, *,
                  optimizer_states: bool = True) -> list[ChunkFormat]:
    """The format of every chunk of ``layout``: what the engine allocates, and what the profiler
    reports to the cost model. Adam states go with chunks holding a trainable parameter the
    optimizer updates (none for an engine that never steps)."""
    params = dict(model.named_parameters())
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    adam = 3 if any(g.get("amsgrad", False) for g in optimizer.param_groups) else 2
    formats = []
    for spec in layout.chunks:
        members = [params[m.name] for m in spec.members]
        trains = optimizer_states and any(p.requires_grad and id(p) in optimized for p in members)
        formats.append(ChunkFormat(
            numel=layout.chunk_size, compute_dtype=precision.compute_dtype, master_dtype=precision.master_dtype,
            grads=any(p.requires_grad for p in members), adam_states=adam if trains else 0,
        ))
    return formats
