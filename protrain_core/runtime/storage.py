"""One chunk's storage: the tensors its format gives it ([Note: chunk storage] in chunk_format.py),
where this rank's pieces of its members are in them (``ShardLayout``), and the records of a
model's chunks (``chunk_formats``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor, nn

from protrain_core.chunk_format import BLOCK, ChunkFormat, moment_dtype
from protrain_core.config import ProTrainConfig
from protrain_core.memtrack import on_host, untracked
from protrain_core.precision import Precision
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.elementwise import state_slots
from protrain_core.runtime.frozen_formats import FrozenPlaces, frozen_places
from protrain_core.runtime.host_pool import HostPool
from protrain_core.runtime.sharding import ONE_PROCESS, Sharding, piece
from protrain_core.runtime.state_formats import MIN_8BIT, QuantPlaces
from protrain_core.structure.layout import ChunkLayout, ParamSlot


@dataclass(frozen=True)
class ShardLayout:
    """Where this ``rank``'s pieces of a chunk of format ``fmt`` are ([Note: sharded chunks] in
    sharding.py; in one process they are whole members). A *piece* is ``(offset in the member's
    flattened elements, offset in the tensor, length)``, or None where this rank holds none."""

    fmt: ChunkFormat
    rank: int = 0

    def device_offset(self, m: ParamSlot) -> int:
        """Member ``m``'s offset in the gathered compute copy."""
        fmt = self.fmt
        return fmt.trainable_device_start + m.offset - fmt.trainable_start if m.trainable else m.offset

    def span_offset(self, m: ParamSlot) -> int:
        """Member ``m``'s offset in the whole trainable span (the gradient buffer)."""
        return m.offset - self.fmt.trainable_start

    def state_piece(self, m: ParamSlot) -> tuple[int, int, int] | None:
        """Member ``m``'s piece in this rank's shard of the trainable span (master, states)."""
        return self._piece(self.span_offset(m), m.numel, self.fmt.state_numel)

    def _piece(self, start: int, numel: int, shard: int) -> tuple[int, int, int] | None:
        """``piece``, with an empty member given (whole) to rank 0."""
        if not numel:
            return (0, min(start, shard), 0) if self.rank == 0 else None
        return piece(start, numel, shard, self.rank)

    def frozen_piece(self, m: ParamSlot) -> tuple[int, int, int] | None:
        """Frozen member ``m``'s piece in this rank's piece of the frozen span."""
        return self._piece(m.offset, m.numel, self.fmt.frozen_shard)

    def host_piece(self, m: ParamSlot) -> tuple[int, int, int] | None:
        """Member ``m``'s piece in this rank's shard of the compute copy (a streamed chunk's host
        copy: ``[frozen piece | trainable piece]``)."""
        fmt = self.fmt
        if not m.trainable:
            return None if fmt.quantised else self.frozen_piece(m)
        part = self.state_piece(m)
        return None if part is None else (part[0], fmt.host_copy_numel - fmt.state_numel + part[1], part[2])

    def compute_span(self, persistent: bool) -> tuple[int, int]:
        """(start, length) of this rank's piece of the trainable span in the compute copy where
        it rests (the host shard, or the gathered device copy of a ``persistent`` chunk)."""
        fmt = self.fmt
        start = fmt.host_copy_numel - fmt.state_numel if not persistent else \
            fmt.trainable_device_start + self.rank * fmt.state_numel
        return start, fmt.state_numel

    @cached_property
    def upload_places(self) -> tuple[tuple[int, int, int], ...]:
        """(start in the host shard, start in the device copy, length) of each span a fetch
        uploads: this rank's non-empty frozen and trainable pieces, as one copy where they are
        adjacent in the device copy too (one process)."""
        fmt, r = self.fmt, self.rank
        sf, st = fmt.frozen_shard, fmt.state_numel
        hf = fmt.host_copy_numel - st  # the frozen shard in the host copy (none when quantised)
        frozen, trainable = (0, r * sf, hf), (hf, fmt.trainable_device_start + r * st, st)
        if hf and st and r * sf + sf == trainable[1]:
            return ((0, r * sf, sf + st),)
        return tuple(p for p in (frozen, trainable) if p[2])


class ChunkStorage:
    """The tensors of one chunk, allocated by ``ChunkFormat`` ([Note: chunk storage]). A streamed
    chunk's ``device_copy`` memory is freed and re-allocated in place ([Note: parameter access] in
    chunk.py), and its host tensors live in one exact-size host buffer of its own. The master, the
    accumulator, the gradient buffer and the Adam states cover the trainable span only."""

    _STATES = ("grad_acc", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "absmax", "wide")

    def __init__(self, fmt: ChunkFormat, *, persistent: bool, ctx: DeviceContext, pin: bool,
                 n_members: int, sharding: Sharding = ONE_PROCESS, frozen: FrozenPlaces | None = None,
                 touch=None) -> None:
        """``ctx``: the device; ``touch(t)``: zeroes a streamed chunk's new pageable host region
        where the CPU worker runs (None: here)."""
        assert sharding.world == fmt.world_size
        assert (frozen is None) == (not fmt.quantised)
        self.fmt = fmt
        self.frozen = frozen  # where the frozen members are in a streamed chunk's ``frozen_store`` (quantised)
        self.sharding = sharding
        self.shards = ShardLayout(fmt, sharding.rank)
        self.ctx = ctx
        self.device = ctx.device
        self.host = ctx.host  # where host tensors live (the meta device in a size-only simulation)
        self.pin = pin
        self.touch = touch
        self.pool: HostPool | None = None
        self.spare_pool: HostPool | None = None  # a persistent chunk's host buffer kept for the next offload
        self.grad_buffer: Tensor | None = None  # streamed: this backward's gradients, on the device
        # An update consumed gradients since zero_grad ([Note: gradients consumed where they land]).
        self.gradients_consumed = False
        self.persistent = persistent
        with torch.no_grad():
            if persistent:
                self._allocate_persistent()
            else:
                self._allocate_streamed()
        self.steps = [torch.zeros((), dtype=torch.float32, device=self._steps_device()) for _ in range(n_members)]

    def _steps_device(self) -> torch.device:
        """Where the step counters are: beside the master (torch's fused kernel reads them there),
        on the CPU in format "8bit" (bitsandbytes takes the step as a number)."""
        if self.fmt.eight_bit:
            return torch.device("cpu")
        home = self.master if self.master is not None else self.compute_home
        return home.device

    def _allocate_persistent(self) -> None:
        fmt, dev = self.fmt, self.device
        self.device_copy = torch.zeros(fmt.padded_numel, dtype=fmt.compute_dtype, device=dev)
        self._allocate_states(lambda n, dtype: torch.zeros(n, dtype=dtype, device=dev))

    def _allocate_streamed(self, parked: bool = False) -> None:
        """The host buffer and the streamed tensors in it; ``parked``: see ``make_streamed``. A
        kept buffer (``make_persistent(keep_host=True)``) serves a parked chunk again."""
        fmt = self.fmt
        pool, self.spare_pool = self.spare_pool, None
        if pool is not None and not parked:
            pool.close()
            pool = None
        if pool is None:
            tensors = [(n, dtype, moves or parked) for n, dtype, moves in fmt.host_tensors()]
            pool = HostPool(tensors, pin=self.pin, device=self.host, cuda=self.device, touch=self.touch)
        else:
            pool.rewind()
        self.pool = pool
        self._allocate_states(pool.take)
        self.device_copy = torch.empty(fmt.padded_numel, dtype=fmt.compute_dtype, device=self.device)
        self.free_device_copy()

    def _allocate_states(self, make) -> None:
        """The tensors of ``ChunkFormat.state_tensors``, by ``make(elements, dtype)``; the others None
        (a streamed chunk without an accumulator borrows one per update: ``borrow_accumulator``)."""
        fmt = self.fmt
        for name in ("master", "host_copy", "frozen_store", *self._STATES):
            setattr(self, name, None)
        for name, n, dtype, _ in fmt.state_tensors(streamed=not self.persistent):
            setattr(self, name, make(n, dtype))
        if fmt.trains and not fmt.separate_master:  # the master is this rank's piece of the compute copy
            self.master = self.compute_span()
        self._scratch_view: tuple[Tensor, Tensor] | None = None  # (the worker's scratch, this chunk's view of it)

    # ----- moving between the device and the host (a re-plan) ----------------------------------
    def make_persistent(self, *, keep_host: bool = False, copy=None) -> None:
        """Streamed -> persistent: every tensor allocated on the device and copied there (by
        ``copy(dst, src)``), then the host buffer given up, or kept for the next ``make_streamed``
        (``keep_host``: pinning a new buffer every time would cost more than the copy)."""
        assert not self.persistent and self.grad_buffer is None
        assert copy is None or keep_host, "a copy in flight reads the host buffer: keep it"
        old = self._snapshot()
        with torch.no_grad():
            self.persistent = True
            self._allocate_persistent()
            self._restore(old, copy)
        if keep_host:
            self.spare_pool = self.pool
        else:
            self.pool.close()
        self.pool = None

    def make_streamed(self, copy=None, *, gradients: bool = False, parked: bool = False) -> None:
        """Persistent -> streamed: every tensor copied to a host buffer by ``copy(dst, src)`` (None:
        at once). ``gradients``: gradients not cleared yet, kept even without an accumulator.
        ``parked``: a new host buffer is page-locked whole ([Note: what is page-locked])."""
        assert self.persistent
        old = self._snapshot()
        with torch.no_grad():
            self.persistent = False
            self._allocate_streamed(parked)
            if gradients and self.borrows_accumulator:
                self.borrow_accumulator(None)
            self._restore(old, copy)

    def _snapshot(self) -> dict:
        tensors = {name: getattr(self, name) for name in self._STATES}
        tensors["master"] = self.master if self.fmt.separate_master else None  # (else a view of the compute copy)
        return tensors | {"compute": self.compute_home, "steps": self.steps, "store": self.frozen_store}

    def _restore(self, old: dict, copy=None) -> None:
        copy = copy or Tensor.copy_  # (at once)
        if self.persistent:  # from the host shard: uploaded, then gathered (W processes)
            for host, device in self.shard_places(old["compute"]):
                copy(device, host)
            if old["store"] is not None:  # uploaded, then dequantised on the compute stream (which waits for it)
                staging = torch.empty_like(old["store"], device=self.device)
                copy(staging, old["store"])
                self._unpack(staging)
            self.gather()
        else:  # the rank's pieces of the gathered copy
            for host, device in self.shard_places(device_copy=old["compute"]):
                copy(host, device)
            if self.frozen_store is not None:  # quantised on the device (exactly: a projection), then copied
                staging = torch.empty_like(self.frozen_store, device=self.device)
                self.frozen.pack(old["compute"], staging)
                copy(self.frozen_store, staging)
        for name in ("master", *self._STATES):
            if old[name] is not None and getattr(self, name) is not None:  # (a streamed chunk may keep no accumulator)
                copy(getattr(self, name), old[name])
        self.steps = [torch.empty_like(t, device=self._steps_device()) for t in old["steps"]]
        for new, t in zip(self.steps, old["steps"]):
            copy(new, t)

    # ----- an accumulator lent per update ([Note: gradients consumed where they land]) ---------
    @property
    def borrows_accumulator(self) -> bool:
        """A streamed chunk that keeps no accumulator of its own."""
        return not self.persistent and self.fmt.trains and not self.fmt.accumulator

    def borrow_accumulator(self, scratch: Tensor | None) -> None:
        """Give this chunk (``borrows_accumulator``) an accumulator for a job of the CPU worker,
        unless it holds one: a view of the worker's ``scratch`` for a job that lands and updates
        (the same view every time: the update's cached views stay valid), or (None) a tensor of
        its own that keeps a partial landing until the update."""
        if self.grad_acc is not None:
            return
        n = self.fmt.state_numel
        if scratch is None:
            with on_host():
                self.grad_acc = torch.empty(n, dtype=self.fmt.master_dtype, device=self.host)
            return
        if self._scratch_view is None or self._scratch_view[0] is not scratch:
            self._scratch_view = (scratch, scratch[:n])
        self.grad_acc = self._scratch_view[1]

    def return_accumulator(self, *, consumed: bool) -> bool:
        """After the update (``consumed``: its gradients are gone until zero_grad) or at zero_grad:
        a lent accumulator given back; True when it was a tensor of its own (cached views must go)."""
        self.gradients_consumed = consumed and self.borrows_accumulator
        if not self.borrows_accumulator or self.grad_acc is None:
            return False
        own = self._scratch_view is None or self.grad_acc is not self._scratch_view[1]
        self.grad_acc = None
        return own

    # ----- where the compute copy is --------------------------------------------------------
    @property
    def compute_home(self) -> Tensor:
        """Where the up-to-date compute copy rests (the device copy of a persistent chunk)."""
        return self.device_copy if self.persistent else self.host_copy

    def compute_span(self) -> Tensor:
        """This rank's piece of the trainable span of the compute copy where it rests (a view)."""
        start, n = self.shards.compute_span(self.persistent)
        return self.compute_home[start:start + n]

    # ----- shards (W processes: [Note: sharded chunks] in sharding.py) --------------------------
    def shard_places(self, host_copy: Tensor | None = None, device_copy: Tensor | None = None):
        """(span of ``host_copy``, its place in ``device_copy``) for each span a fetch uploads."""
        host = self.host_copy if host_copy is None else host_copy
        device = self.device_copy if device_copy is None else device_copy
        return [(host[h:h + n], device[d:d + n]) for h, d, n in self.shards.upload_places]

    def upload_frozen(self, ctx, label: str):
        """A quantised chunk's fetch: its host store copied to a staging buffer and dequantised
        into the device copy on the upload stream; the event to wait on."""
        staging = torch.empty(self.fmt.store_bytes, dtype=torch.uint8, device=self.device)
        ctx.copy_async(staging, self.frozen_store, stream=ctx.h2d_stream, span=("host->device", label))
        event = ctx.run_on(ctx.h2d_stream, lambda: self._unpack(staging),
                           span=("compute", f"{label}: dequantise (upload stream)"))
        ctx.record_stream(staging, ctx.h2d_stream)  # freed in stream order, after the dequantisation
        return event

    def _unpack(self, staging: Tensor) -> None:
        """The host store (``staging``: on the device) dequantised into this rank's piece of the device copy."""
        start = self.frozen.piece_start
        self.frozen.unpack(staging, self.device_copy[start:start + self.frozen.piece_numel])

    def piece_values(self) -> Tensor:
        """This rank's piece of a streamed quantised chunk's frozen span, dequantised on the host."""
        out = torch.zeros(self.frozen.piece_numel, dtype=self.fmt.compute_dtype, device=self.frozen_store.device)
        self.frozen.unpack(self.frozen_store, out)
        return out

    def gather(self, *, frozen: bool = True) -> None:
        """All-gather the device copy's trainable span, and its ``frozen`` span (not after a
        persistent chunk's update), in place (in one process: the identity)."""
        tds = self.fmt.trainable_device_start
        if frozen:
            self.sharding.gather_(self.device_copy[:tds])
        self.sharding.gather_(self.device_copy[tds:])

    def allocate_device_copy(self) -> None:
        self.ctx.resize(self.device_copy.untyped_storage(), self.device_copy.numel() * self.device_copy.element_size())

    def free_device_copy(self) -> None:
        self.ctx.resize(self.device_copy.untyped_storage(), 0)

    @property
    def device_copy_allocated(self) -> bool:
        return self.device_copy.untyped_storage().nbytes() > 0

    def allocate_grad_buffer(self, zero: tuple[tuple[int, int], ...]) -> Tensor:
        """The gradient buffer of a backward pass, zero in the ranges ``zero`` (start, end) and
        uninitialised elsewhere, where each member's gradient is written whole."""
        with untracked():  # chunk memory: counted by device_bytes(), not as activations
            self.grad_buffer = self.empty(self.fmt.grad_buffer_numel, self.fmt.compute_dtype)
        for start, end in zero:
            self.grad_buffer[start:end].zero_()
        return self.grad_buffer

    def free_grad_buffer(self, after=None) -> None:
        """Drop the gradient buffer; it is read until ``after`` (an event)."""
        self.free(self.grad_buffer, after)
        self.grad_buffer = None

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A transient device tensor (uninitialised): from a CPU device's block cache, if any."""
        if self.ctx.blocks is None:
            return torch.empty(numel, dtype=dtype, device=self.device)
        return self.ctx.blocks.empty(numel, dtype)

    def free(self, t: Tensor | None, after=None) -> None:
        """``t`` (from ``empty``) is not read once ``after`` is over: back to the block cache."""
        if t is not None and self.ctx.blocks is not None:
            self.ctx.blocks.free(t, after)

    # ----- accounting -------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes of device memory this chunk holds right now, read from the storages."""
        tensors = [self.device_copy, self.grad_buffer]  # (a quantised upload's staging is transient)
        if self.persistent:
            tensors += [getattr(self, name) for name, *_ in self.fmt.state_tensors(streamed=False)]
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)

    @property
    def host_bytes(self) -> int:
        return sum(p.nbytes for p in (self.pool, self.spare_pool) if p is not None)

    @property
    def host_locked_bytes(self) -> int:
        """Of ``host_bytes``, those page-locked now."""
        return sum(p.locked_bytes for p in (self.pool, self.spare_pool) if p is not None)


def chunk_formats(model: nn.Module, optimizer: torch.optim.Optimizer, layout: ChunkLayout, precision: Precision,
                  config: ProTrainConfig, *, world_size: int = 1) -> list[ChunkFormat]:
    """The format of every chunk of ``layout`` of ``model`` as ``config`` asks (each rank's of
    ``world_size``, in ``precision``; with ``optimizer``'s states): what the engine allocates."""
    state_format, params = config.optimizer_state_format, dict(model.named_parameters())
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    adam = state_slots(optimizer)
    if moment_dtype(state_format, precision.master_dtype) == precision.master_dtype:
        state_format = "fp32"  # bf16 moments in bf16-true: what torch keeps there anyway
    formats = []
    for spec in layout.chunks:
        updated = sum(m.numel for m in spec.members if m.trainable and id(params[m.name]) in optimized)
        trains = config.optimizer_states and updated > 0
        fmt = ChunkFormat(
            numel=layout.chunk_size, compute_dtype=precision.compute_dtype, master_dtype=precision.master_dtype,
            trainable_start=spec.trainable_start if spec.trainable_numel else 0,
            trainable_numel=spec.trainable_numel, updated_numel=updated if trains else 0,
            adam_states=adam if trains else 0, world_size=world_size,
            state_format=state_format if trains else "fp32",
            wide_numel=sum(m.numel for m in spec.members if m.trainable and m.numel < MIN_8BIT)
            if trains and state_format == "8bit" else 0,
            accumulator=config.keeps_accumulators or not trains,  # (a chunk the optimizer never steps accumulates only)
        )
        # quantised frozen members ([Note: quantised frozen chunks]): a store of one size on every rank
        frozen = frozen_places(spec.members, config.frozen_dtype, (0, fmt.frozen_shard))
        formats.append(fmt if frozen is None else replace(fmt, frozen_format=frozen.fmt,
                                                           store_bytes=frozen.store_bytes(precision.compute_dtype)))
    return formats


def rank_quant_places(spec, shards: ShardLayout) -> QuantPlaces:
    """Where ``spec``'s members keep their 8-bit block scales and small fp32 moments on ``shards``'s rank."""
    blocks, wide, nw = [], [], 0
    for m in spec.members:
        part = shards.state_piece(m) if m.trainable else None
        if part is None:
            blocks.append(None)
            wide.append(None)
        elif m.numel < MIN_8BIT:
            blocks.append(None)
            wide.append(nw)
            nw += part[2]
        else:
            assert part[1] % BLOCK == 0, "an 8-bit member's piece starts at a block boundary (block_aligned)"
            blocks.append((part[1] // BLOCK, -(-part[2] // BLOCK)))
            wide.append(None)
    return QuantPlaces(tuple(blocks), tuple(wide))
