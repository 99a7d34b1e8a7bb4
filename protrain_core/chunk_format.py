"""The chunk format record: what one chunk stores, where each part lives, and the only byte
formula. It sits below the runtime, which allocates by it, and the planner, whose profile
carries one record per chunk and whose cost model charges each chunk by its record.

[Note: chunk storage]
A chunk of ``S`` elements (the layout's chunk size; ``c`` = compute dtype, ``m`` = master dtype:
fp32, or bf16 in bf16-true) has its frozen parameters first (the frozen span, ``F`` elements)
and its trainable ones after them (structure/layout.py), so the trainable ones form one span of
``T`` elements, ending at the last trainable member. Only that span trains. With ``W``
processes (``W = 1`` in one process) both spans are sharded separately: rank ``r`` keeps piece
``r`` of each, ``s_f = ceil(F / W)`` and ``s_t = ceil(T / W)`` elements rounded up to the
layout's alignment (``s_t`` to the 8-bit block with 8-bit moments), ``s_c = s_f + s_t``
([Note: sharded chunks] in runtime/sharding.py):

  tensor          elements   dtype  persistent chunk        streamed chunk
  compute copy    s_c * W    c      device, always          device buffer while resident
  host copy       s_c        c      --                      host (page-locked)
  master          s_t        m      device                  host (pageable)
  grad. accum.    s_t        m      device                  host (page-locked where c = m:
                                                            gradients land in it)
  grad. buffer    s_t * W    c      W > 1: before the       device, during backward
                                    reduce-scatter
  Adam states     k * s_t    m      device                  host (pageable) (k = 2, 3 with amsgrad)

A streamed chunk keeps no accumulator where its format says so (``ChunkFormat.accumulator``,
``ProTrainConfig.grad_accumulator``; [Note: gradients consumed where they land] in
runtime/worker.py). The moments take another dtype in the formats of ``ChunkFormat.state_format``
(bf16; 8-bit, with fp32 block scales and fp32 moments for small members: [Note: optimizer-state
formats] in runtime/state_formats.py); the master and the accumulator keep ``m``.

A frozen parameter costs its compute-dtype copy alone -- or, with ``frozen_dtype``, a frozen
weight matrix of a streamed chunk about one byte in the chunk's host store, which then holds the
frozen span instead of the host copy ([Note: quantised frozen chunks] in runtime/frozen_formats.py).
A chunk with no trainable member (``T = 0``) holds the compute copy only, is uploaded and never
offloaded. The waste after the last trainable member is not stored. The master is a tensor of
its own only when its dtype differs from the compute dtype (the mixed modes); otherwise it *is*
this rank's piece of the trainable span of the compute copy where it rests. ``ShardLayout``
(runtime/storage.py) answers where a member is in each tensor on this rank; one process is rank
0 of ``W = 1``, whose pieces are whole members at their layout offsets.

Everything that needs a chunk's size asks its ``ChunkFormat``: the engine's allocation
(``chunk_formats`` in runtime/storage.py), a streamed chunk's host buffer, the runtime's
device-memory bound, and the cost model, which knows of a chunk only its record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

# Parameter offsets inside a chunk, and shards, are multiples of ALIGN elements (>= 16-byte
# aligned views in every dtype we use), so vectorised kernels see aligned rows.
ALIGN = 16
BLOCK = 256  # bitsandbytes' block-wise block: 8-bit moments keep one fp32 scale per block


def align(n: int, unit: int = ALIGN) -> int:
    return (n + unit - 1) // unit * unit


def moment_dtype(name: str, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a chunk's moment tensors in format ``name``."""
    return {"fp32": master_dtype, "bf16": torch.bfloat16, "8bit": torch.uint8}[name]


@dataclass(frozen=True, kw_only=True)
class ChunkFormat:
    """What one chunk stores (see [Note: chunk storage])."""

    numel: int  # the layout's chunk size S, in elements
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    trainable_start: int = 0  # where the trainable span begins (elements)
    trainable_numel: int | None = None  # T; None: the whole chunk trains
    # Elements of the parameters the optimizer updates (of the trainable span, which also holds
    # the alignment between them; None: all of it); what the cost model charges an update
    updated_numel: int | None = None
    # Optimizer state tensors of the trainable span: Adam's 2, or 3 with amsgrad; another
    # elementwise optimizer's 0-3 ([Note: elementwise optimizers] in runtime/elementwise.py).
    adam_states: int = 2
    world_size: int = 1  # processes the chunk is sharded over
    # The moments' format ([Note: optimizer-state formats] in runtime/state_formats.py); "8bit" also
    # keeps fp32 block scales (``quant_blocks`` per moment) and the fp32 moments of its small
    # members (``wide_numel`` elements per moment: all of them, a bound of any rank's pieces).
    state_format: str = "fp32"
    wide_numel: int = 0
    # Frozen weight matrices in 8 bits on the host, "int8" or "fp8" (None: the compute dtype), and
    # the bytes of the host store that then holds the frozen span ([Note: quantised frozen chunks]).
    frozen_format: str | None = None
    store_bytes: int = 0
    # Streamed, the chunk keeps its gradient accumulator in host memory (False: the CPU worker
    # lends one per update); a persistent chunk always keeps it, on the device.
    accumulator: bool = True

    def __post_init__(self) -> None:
        if self.trainable_numel is None:
            object.__setattr__(self, "trainable_numel", self.numel - self.trainable_start)
        if self.updated_numel is None:
            object.__setattr__(self, "updated_numel", self.trainable_numel)
        checks = {
            "no size is negative": min(self.numel, self.wide_numel, self.store_bytes) >= 0,
            "the trainable span lies in the chunk": 0 <= self.trainable_start <= self.trainable_start
            + self.trainable_numel <= self.numel and 0 <= self.updated_numel <= self.trainable_numel,
            "0-3 optimizer states, at least one process": self.adam_states in (0, 1, 2, 3) and self.world_size >= 1,
            "a chunk with no trainable member has no optimizer state": self.trainable_numel or not self.adam_states,
            "only 8-bit moments keep small members wide": self.state_format == "8bit" or not self.wide_numel,
            "a quantised frozen span has a store": (self.frozen_format is None) == (self.store_bytes == 0),
        }
        broken = [what for what, holds in checks.items() if not holds]
        if broken:  # a record built by hand, or read from an edited profile cache
            raise ValueError(f"not a chunk format ({'; '.join(broken)}): {self}")

    @property
    def trains(self) -> bool:
        return self.trainable_numel > 0

    @property
    def whole(self) -> bool:
        """One process holds the chunk whole (``W = 1``): no all-gather, reduce-scatter or
        gradient buffer of a persistent chunk, and the parameters can point at a streamed chunk's
        host copy at rest ([Note: sharded chunks])."""
        return self.world_size == 1

    def _shard(self, n: int, unit: int = ALIGN) -> int:
        return align(-(-n // self.world_size), unit)

    @property
    def quant_blocks(self) -> int:
        """Block scales per moment in format "8bit": one per block of the trainable shard."""
        return -(-self.state_numel // BLOCK) if self.eight_bit else 0

    @property
    def frozen_numel(self) -> int:
        """F: the span before the trainable one (the whole chunk when nothing in it trains)."""
        return self.trainable_start if self.trains else self.numel

    @property
    def frozen_shard(self) -> int:
        """s_f: elements of this rank's piece of the frozen span (``F`` rounded up to the
        alignment in one process)."""
        return self._shard(self.frozen_numel)

    @property
    def quantised(self) -> bool:
        """The frozen span lives in the host store, in 8 bits (not in the host copy)."""
        return self.store_bytes > 0

    @property
    def host_copy_numel(self) -> int:
        """Elements of a streamed chunk's host copy (the frozen shard only where not quantised)."""
        return (0 if self.quantised else self.frozen_shard) + self.state_numel

    @property
    def state_numel(self) -> int:
        """s_t: elements of this rank's shard of the master, accumulator and Adam states (with
        8-bit moments a multiple of their block, so that every rank's piece of a member starts
        at a block boundary: [Note: optimizer-state formats])."""
        return self._shard(self.trainable_numel, BLOCK if self.eight_bit else ALIGN)

    @property
    def shard_numel(self) -> int:
        """s_c: elements of this rank's shard of the compute copy."""
        return self.frozen_shard + self.state_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered compute copy (``s_c * W``)."""
        return self.shard_numel * self.world_size

    @property
    def trainable_device_start(self) -> int:
        """Where the trainable span begins in the gathered compute copy."""
        return self.frozen_shard * self.world_size

    @property
    def grad_buffer_numel(self) -> int:
        """Elements of the device gradient buffer: the trainable span, padded to ``s_t * W``."""
        return self.state_numel * self.world_size

    @property
    def separate_master(self) -> bool:
        return self.trains and self.compute_dtype != self.master_dtype

    @property
    def moment_dtype(self) -> torch.dtype:
        return moment_dtype(self.state_format, self.master_dtype)

    @property
    def eight_bit(self) -> bool:
        return self.state_format == "8bit" and self.adam_states > 0

    @property
    def host_accumulator(self) -> bool:
        """Streamed, the chunk keeps an accumulator in host memory."""
        return self.trains and self.accumulator

    @property
    def persistent_device_bytes(self) -> int:
        """Device bytes of the chunk when it is persistent (with ``W`` processes, its gradient
        buffer during backward included)."""
        grads = 0 if self.whole else self.grad_buffer_numel
        states = [t[1:] for t in self.state_tensors(streamed=False)]
        return (self.padded_numel + grads) * self.compute_dtype.itemsize + _nbytes(states)

    @property
    def streamed_host_bytes(self) -> int:
        """Host bytes of the chunk when it is streamed (before the pool's 64-byte alignment)."""
        return _nbytes(self.host_tensors())

    @property
    def buffer_device_bytes(self) -> int:
        """Device bytes of a streamed chunk while resident: its compute copy, plus the gradient
        buffer of its trainable span during backward (and, quantised, the staging of its host
        store while it uploads)."""
        return (self.padded_numel + self.grad_buffer_numel) * self.compute_dtype.itemsize + self.store_bytes

    @property
    def upload_bytes(self) -> int:
        """Bytes one fetch copies host -> device (this rank's shard; the gather does the rest)."""
        return self.host_copy_numel * self.compute_dtype.itemsize + self.store_bytes

    @property
    def frozen_upload_bytes(self) -> int:
        """Of ``upload_bytes``, those of the frozen span (the host store when quantised)."""
        return self.store_bytes or self.frozen_shard * self.compute_dtype.itemsize

    @property
    def offload_bytes(self) -> int:
        """Bytes of gradients one offload copies device -> host (0 for a frozen chunk)."""
        return self.state_numel * self.compute_dtype.itemsize

    @property
    def gather_bytes(self) -> int:
        """Bytes one all-gather of the compute copy assembles (0 in one process)."""
        return 0 if self.whole else self.padded_numel * self.compute_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes of gradients one reduce-scatter reads (0 in one process)."""
        return 0 if self.whole else self.grad_buffer_numel * self.compute_dtype.itemsize

    def sharded(self, world_size: int) -> ChunkFormat:
        return replace(self, world_size=world_size)

    def to_dict(self) -> dict:
        """The record as JSON values (dtypes by name): what a profile's cache file holds."""
        dtypes = {"compute_dtype": dtype_name(self.compute_dtype), "master_dtype": dtype_name(self.master_dtype)}
        return {**asdict(self), **dtypes}

    @classmethod
    def from_dict(cls, d: dict) -> ChunkFormat:
        dtypes = {k: getattr(torch, d[k]) for k in ("compute_dtype", "master_dtype")}
        if not all(isinstance(t, torch.dtype) for t in dtypes.values()):
            raise ValueError(f"not a chunk format: dtypes {d['compute_dtype']!r}, {d['master_dtype']!r}")
        return cls(**{**d, **dtypes})

    def state_tensors(self, *, streamed: bool) -> list[tuple[str, int, torch.dtype, bool]]:
        """(its ``ChunkStorage`` attribute, elements, dtype, moves) of each tensor the chunk keeps
        besides a persistent chunk's compute copy and the gradient buffer, in allocation order;
        ``streamed``: the host buffer's. ``moves``: a copy engine reads or writes it, so it is
        page-locked on CUDA ([Note: what is page-locked] in runtime/host_pool.py): the host copy,
        the accumulator where gradients land in it (no separate master), the quantised store."""
        s, m, f32, separate = self.state_numel, self.master_dtype, torch.float32, self.separate_master
        out = [("master", s, m, False)] if separate else []
        if streamed:
            out.append(("host_copy", self.host_copy_numel, self.compute_dtype, True))
        if self.trains and (self.accumulator or not streamed):
            out.append(("grad_acc", s, m, not separate))
        slots = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:self.adam_states]  # or another optimizer's states
        out += [(name, s, self.moment_dtype, False) for name in slots]
        if self.eight_bit:  # each moment's block scales, and the fp32 moments of small members
            out += [("absmax", 2 * self.quant_blocks, f32, False), ("wide", 2 * self.wide_numel, f32, False)]
        if streamed and self.quantised:
            out.append(("frozen_store", self.store_bytes, torch.uint8, True))
        return out

    def host_tensors(self) -> list[tuple[int, torch.dtype, bool]]:
        """(elements, dtype, moves) of a streamed chunk's host tensors (``state_tensors``)."""
        return [t[1:] for t in self.state_tensors(streamed=True)]

    @property
    def streamed_pinned_bytes(self) -> int:
        """Of ``streamed_host_bytes``, those page-locked on CUDA (before alignment)."""
        return _nbytes([t for t in self.host_tensors() if t[2]])


def _nbytes(tensors) -> int:
    """The bytes of ``tensors``: (elements, dtype, ...) each."""
    return sum(t[0] * t[1].itemsize for t in tensors)


def timed_formats(chunks) -> tuple[str, str | None]:
    """(the updated chunks' moment format, the quantised chunks' frozen format) of ``chunks``
    (records): the formats the profiler times the CPU update and the dequantisation in."""
    moments = next((c.state_format for c in chunks if c.adam_states), "fp32")
    return moments, next((c.frozen_format for c in chunks if c.quantised), None)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
