"""Block-wise activation management: keep, checkpoint or swap each transformer block.

[Note: activation layout]
Every transformer block is in one of three modes (``plan.BlockMode``) (paper §3.1, Fig. 2):
  KEEP        autograd keeps the block's saved tensors on the device until its backward;
  CHECKPOINT  only the block's inputs are kept; backward re-runs the block's forward
              (``torch.utils.checkpoint``, non-reentrant) to rebuild the saved tensors;
  SWAP        the saved tensors are copied to host memory during forward and brought back
              before the block's backward.
The layout is interleaved: the ``n_swap`` swapped blocks take the first positions (their
backward comes last, so their copies back have the most time to hide), the ``n_checkpoint``
checkpointed blocks are spread evenly over the rest, and the last block keeps its activations
(its backward comes first). See ``plan.interleaved_modes``; [Note: block forwards] and [Note:
swapping] are next to the code they explain.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from protrain_core.phase import Observers, StepState, TrainingPhase
from protrain_core.plan import BlockMode
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.swap import Counted, HostBuffers, Packed, SwapRecord, check_version
from protrain_core.utils import is_compile_wrapper, iter_tensors, restore_forward

# Smaller storages stay on the device: a copy this small costs more in latency than it frees.
MIN_SWAP_BYTES = 1024

_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")


@dataclass(frozen=True)
class BlockActivations:
    """Activation memory of one block, measured in the last forward pass with gradients.

    Attributes:
        index: block position in forward order.
        mode: how the block's activations are managed.
        saved_bytes: bytes of the distinct storages autograd saves for the block's backward
            (parameters, buffers and inputs without gradient excluded): what the block holds on
            the device when kept. None when not measured (a checkpointed block, or a kept block
            before ``measure_next_forward``).
        input_bytes: bytes of the distinct storages of the block's tensor inputs: what a
            checkpointed block keeps on the device.
        device_bytes: bytes held on the device between this block's forward and backward in
            its current mode (0 for a kept block that was never measured).
        host_bytes: bytes this block copied to host memory (swapped blocks).
    """

    index: int
    mode: BlockMode
    saved_bytes: int | None
    input_bytes: int
    device_bytes: int
    host_bytes: int


@dataclass(eq=False, slots=True)
class _BlockCall:
    """One forward call of one block: its measurements (bytes) and (swap) its records."""

    saved: int = 0
    input: int = 0
    device: int = 0
    host: int = 0
    seen: set[StorageWeakRef] = field(default_factory=set)  # storages counted in this call (and shared ones)
    shared: set[StorageWeakRef] = field(default_factory=set)  # inputs without gradient: never swapped
    records: list[weakref.ref] = field(default_factory=list)  # swap records first made by this call
    copied: object = None  # the event of its last copy out (swapped blocks; until waited for)


class ActivationManager:
    """Applies a per-block activation layout to the blocks of one model."""

    def __init__(self, blocks: list[nn.Module], modes: tuple[BlockMode, ...], ctx: DeviceContext, phase: StepState, *,
                 observers: Observers, warn_on_cache: bool, on_recompute) -> None:
        """``observers``: ``observer(block_index, begin)`` around every recomputation;
        ``on_recompute()``: a recomputation's first act ([Note: loss.backward()] in backward.py)."""
        assert len(blocks) == len(modes)
        self.blocks = blocks
        self.modes = modes
        self.ctx = ctx
        self.phase = phase
        self.host = HostBuffers(ctx)
        self._static: set[StorageWeakRef] = set()  # parameter storages: never swapped
        self._swapped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._calls: list[_BlockCall | None] = [None] * len(blocks)  # the latest call of each block
        self._open: list[list] = [[] for _ in blocks]  # per block: (call, saved-tensor hooks) of calls running
        self._rng_anchor = torch.empty(0, device=ctx.device)
        self._measure = True  # count kept blocks' saved tensors in the next forward
        self._warn_on_cache = warn_on_cache
        self._handles: list = []
        self._originals: dict[int, object] = {}  # checkpointed blocks' own forward attribute (restore_forward)
        self._recompute_observers, self._on_recompute = observers, on_recompute
        self.stats = {"swap_out_bytes": 0, "swap_in_bytes": 0, "recomputed_blocks": 0}

    # ----- installation -------------------------------------------------------------------
    def install(self, static_tensors: list[Tensor]) -> None:
        """Manage every block; ``static_tensors``: tensors whose storage never swaps."""
        self._static = {StorageWeakRef(t.untyped_storage()) for t in static_tensors}
        for i, block in enumerate(self.blocks):
            if self.modes[i] is BlockMode.CHECKPOINT:
                self._originals[i] = block.__dict__.get("forward")
                # Bound to the block: a deep copy of the model binds it to the copied block.
                block.forward = types.MethodType(self._checkpointed_forward(i, block.forward), block)
            else:
                signature = _forward_signature(block)
                self._handles.append(block.register_forward_pre_hook(self._pre_forward(i, signature), with_kwargs=True))
                # Prepended: its prefetch hooks go on the outputs before the runtime's, so swapped
                # activations start coming back before the block's chunks are fetched.
                self._handles.append(block.register_forward_hook(self._post_forward(i), always_call=True, prepend=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for i, own in self._originals.items():
            restore_forward(self.blocks[i], own)
        self._originals.clear()
        self._on_recompute = None
        self.ctx.synchronize_device()  # no copy may still read a host buffer
        self.host.close()

    # [Note: block forwards]
    # Kept and swapped blocks are managed with public hooks: a forward pre-hook enters the block's
    # ``saved_tensors_hooks`` (counting or swapping what autograd saves) and, for a swapped block,
    # drops the key/value cache arguments; the forward hook leaves it and registers the prefetch
    # hooks on the outputs. A checkpointed block needs its forward to run *inside*
    # ``torch.utils.checkpoint.checkpoint``, which no public hook can do, and a wrapper module
    # would rename the block's parameters and modules (names the chunk layout, the optimizer and
    # PEFT read). So it gets an *instance* ``forward`` that calls the original inside
    # ``checkpoint`` (``remove()`` restores it). The runtime's forward pre-hook makes the chunks
    # resident before the wrapper runs, the recomputation calls the original ``forward`` (no hook
    # runs again), and the runtime's pre-backward hook on the outputs makes the chunks resident
    # before the recomputation, which the block's first backward node triggers ([Note: parameter
    # access] in chunk.py); it runs as ``TrainingPhase.RECOMPUTE``.
    # Buffers a checkpointed block updates in forward (BatchNorm's running statistics) would be
    # updated again: when the forward changed any, the recomputation runs on fresh copies of
    # their values from before it (``_BufferState``), so the buffers end as one forward left them
    # and recomputed activations equal the forward's. Checkpointed calls get a zero-size device
    # tensor as their first positional argument: checkpoint saves the device RNG state (dropout)
    # only for devices among positional arguments.
    # Caches: a block that writes a key/value cache would write it twice under recomputation, and
    # a swapped block's cache would pin its activations on the device. With gradients enabled,
    # checkpointed and swapped blocks therefore run with the cache arguments None and
    # ``use_cache=False`` (as Hugging Face's gradient checkpointing does), and a warning says so
    # once. Without gradients every block runs its plain forward.

    # ----- kept and swapped blocks: hooks ----------------------------------------------------
    def _pre_forward(self, i: int, signature: inspect.Signature):
        mode = self.modes[i]

        def hook(module, args, kwargs):
            if module is not self.blocks[i]:  # a deep copy of the block shares this hook
                return
            self._throttle(i)
            if not torch.is_grad_enabled() or (mode is BlockMode.KEEP and not self._measure):
                self._open[i].append(None)
                return None
            if mode is BlockMode.SWAP:
                args, kwargs = self._without_cache(i, signature, args, kwargs)
            call = self._new_call(args, kwargs)
            pack = self._pack_swap if mode is BlockMode.SWAP else self._pack_count
            hooks = saved_tensors_hooks(functools.partial(pack, call), self._unpack)
            hooks.__enter__()
            self._open[i].append((call, hooks))
            return args, kwargs

        return hook

    def _post_forward(self, i: int):
        def hook(module, _args, output):
            if module is not self.blocks[i] or not self._open[i]:
                return  # an earlier pre-hook raised: this one never ran
            call, hooks = self._open[i].pop() or (None, None)
            if hooks is not None:
                hooks.__exit__(None, None, None)
            if torch.is_grad_enabled() and output is not None:  # None: the forward raised
                self._after_call(i, call, output)

        return hook

    # ----- checkpointed blocks: the forward wrapper ([Note: block forwards]) -------------------
    def _checkpointed_forward(self, i: int, forward):
        signature = _forward_signature(self.blocks[i])

        def recompute(buffers, _anchor, *args, **kwargs):
            if not buffers.ran:  # the first run, in forward
                buffers.ran = True
                with buffers.forward():
                    return forward(*args, **kwargs)
            if self._on_recompute is not None:
                self._on_recompute()
            # A recomputation (it may stop early, by an exception, once backward has what it needs).
            self.stats["recomputed_blocks"] += 1
            with self.phase.entered(TrainingPhase.RECOMPUTE, leaving=TrainingPhase.BACKWARD,
                                    error="a recomputation inside a recomputation"):
                self._recompute_observers.notify(lambda observer: observer(i, True))
                try:
                    with buffers.recompute():
                        return forward(*args, **kwargs)
                finally:
                    self._recompute_observers.notify(lambda observer: observer(i, False))

        @functools.wraps(forward)
        def wrapped(module, *args, **kwargs):
            if module is not self.blocks[i]:  # a copy of the block: a plain module
                return type(module).forward(module, *args, **kwargs)
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            self._throttle(i)
            args, kwargs = self._without_cache(i, signature, args, kwargs)
            call = self._new_call(args, kwargs)
            call.device = call.input
            buffers = _BufferState(self.blocks[i])
            out = checkpoint(recompute, buffers, self._rng_anchor, *args, use_reentrant=False,
                             context_fn=self.ctx.checkpoint_contexts, **kwargs)
            self._after_call(i, call, out)
            return out

        return wrapped

    # ----- every managed call -------------------------------------------------------------------
    def _new_call(self, args, kwargs) -> _BlockCall:
        call = _BlockCall()
        inputs = list(iter_tensors((args, kwargs)))
        call.shared = {k for t in inputs if not t.requires_grad and (k := self._storage_key(t)) is not None}
        call.seen = set(call.shared)  # shared inputs are never counted
        call.input = self._distinct_bytes(inputs, set(call.shared))
        return call

    def _after_call(self, i: int, call: _BlockCall | None, out) -> None:
        """Record the call and register the prefetch hooks on its outputs (a swapped block, or
        the block after one: its backward brings back its own and the previous block's)."""
        previous = self._calls[i - 1] if i > 0 else None  # the previous block, this forward
        if call is not None:
            call.seen = set()
            self._calls[i] = call
        if self.modes[i] is BlockMode.SWAP or (i > 0 and self.modes[i - 1] is BlockMode.SWAP):
            def hook(_grad):  # this call's backward begins: its records come back, and the previous block's
                self._prefetch(call)
                self._prefetch(previous)

            for t in iter_tensors(out):
                if t.requires_grad:
                    t.register_hook(hook)

    def _without_cache(self, i: int, signature: inspect.Signature, args, kwargs):
        if getattr(self.blocks[i], "_can_checkpoint_with_cache", False) and self.modes[i] is BlockMode.CHECKPOINT:
            return args, kwargs
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return args, kwargs
        extra = next((bound.arguments[p.name] for p in signature.parameters.values()
                      if p.kind is p.VAR_KEYWORD and p.name in bound.arguments), {})
        changed = []
        for where in (bound.arguments, extra):
            for name in _CACHE_ARGS:
                if where.get(name) is not None:
                    where[name] = None
                    changed.append(f"{name}=None")
            if where.get("use_cache"):
                where["use_cache"] = False
                changed.append("use_cache=False")
        if not changed:
            return args, kwargs
        if self._warn_on_cache:
            self._warn_on_cache = False
            warnings.warn(
                "ProTrain: a key/value cache cannot be used by checkpointed or swapped blocks "
                "(recomputation would write it twice; a swapped block's cache would pin its activations "
                f"on the device). With gradients enabled these blocks run with {', '.join(dict.fromkeys(changed))}, "
                "as with Hugging Face gradient checkpointing. Pass use_cache=False to the model to "
                "silence this warning.",
                stacklevel=4,
            )
        return bound.args, bound.kwargs

    # [Note: swapping]
    # Saved tensors are swapped per *storage*: the pack hook copies the whole storage of a saved
    # tensor to a host buffer once and returns a small record; views of it saved later (``q``,
    # ``k``, ``v`` of one projection) reuse the record. Tensors that alias parameters or buffers,
    # of other devices or below ``MIN_SWAP_BYTES`` stay; so do the block's inputs without
    # gradients (attention masks: shared by every block, copying them frees nothing), which no
    # block's activation bytes count either.
    # On CUDA the copies run on the swap stream, after the compute stream, which does not wait for
    # them, except that a block's forward begins only once the copies out of the block before the
    # previous one are done (``_throttle``). ``record_stream(swap_stream)`` makes the allocator
    # reuse a storage only after its copy. Copies back are allocated on the compute stream, run on
    # the swap stream and waited for at unpack. A host buffer returns to the pool when its record
    # dies; its next use is a copy on the same stream, so it cannot overtake the copy back that
    # reads it. When block ``i``'s backward begins, the copies back of that call and of the previous
    # block's call are issued; records belong to the call that made them, so each backward brings
    # back its own. Autograd does not check the version of saved tensors that go through hooks:
    # the records keep a weak reference to the original and raise autograd's error at unpack.

    # ----- saved-tensor hooks -------------------------------------------------------------
    def _storage_key(self, t: Tensor) -> StorageWeakRef | None:
        """The storage of a saved activation, or None for parameters, buffers and odd tensors."""
        if type(t) not in (Tensor, nn.Parameter) or t.layout is not torch.strided or t.device != self.ctx.device:
            return None
        key = StorageWeakRef(t.untyped_storage())
        return None if key in self._static else key

    def _distinct_bytes(self, tensors, seen: set) -> int:
        total = 0
        for t in tensors:
            key = self._storage_key(t)
            if key is not None and key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def _pack_count(self, call: _BlockCall, t: Tensor):
        nbytes = self._distinct_bytes([t], call.seen)
        call.saved += nbytes
        call.device += nbytes
        return Counted(t)

    def _pack_swap(self, call: _BlockCall, t: Tensor):
        key = self._storage_key(t)
        if key is None or key in call.shared:
            return Counted(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < MIN_SWAP_BYTES:
            return self._pack_count(call, t)
        call.saved += self._distinct_bytes([t], call.seen)
        record = self._swapped.get(key)
        if record is None:
            record, call.copied = self._swap_out(storage, nbytes)
            self._swapped[key] = record
            call.records.append(weakref.ref(record))
            call.host += nbytes
        return Packed(record, t)

    def _unpack(self, packed):
        if isinstance(packed, Counted):
            check_version(packed.tensor, packed.version)
            return packed.tensor
        check_version(packed.original(), packed.version)
        record = packed.record
        self._swap_in(record)
        if record.in_event is not None:
            self.ctx.wait_on_compute(record.in_event)
            record.in_event = None
        with torch.no_grad():
            return torch.empty(0, dtype=packed.dtype, device=self.ctx.device).set_(
                record.in_buf.untyped_storage(), packed.offset, packed.size, packed.stride
            )

    # ----- copies -------------------------------------------------------------------------
    def _swap_out(self, storage, nbytes: int) -> tuple[SwapRecord, object]:
        """(the record of ``storage`` copied out, the copy's event)."""
        with torch.no_grad():
            src = torch.empty(0, dtype=torch.uint8, device=self.ctx.device).set_(storage)
            host = self.host.get(nbytes)
            event = self.ctx.copy_async(host[:nbytes], src, stream=self.ctx.swap_stream,
                                        span=("device->host", "activations"))
            self.ctx.record_stream(src, self.ctx.swap_stream)  # reused only once the copy is done
        record = SwapRecord(host, nbytes)
        weakref.finalize(record, self.host.put, host)
        self.stats["swap_out_bytes"] += nbytes
        return record, event

    def _throttle(self, i: int) -> None:
        """Before block ``i``'s forward, the compute stream waits for the copies out of block
        ``i - 2``: at most the previous block's may still be copying, as the memory model
        assumes (eq. 9); else a copy slower than compute would pile activations up."""
        call = self._calls[i - 2] if i >= 2 else None
        if call is not None and call.copied is not None:
            self.ctx.wait_on_compute(call.copied)
            call.copied = None

    def _swap_in(self, record: SwapRecord) -> None:
        if record.in_buf is not None:
            return
        with torch.no_grad():
            record.in_buf = torch.empty(record.nbytes, dtype=torch.uint8, device=self.ctx.device)
            record.in_event = self.ctx.copy_async(record.in_buf, record.host[: record.nbytes], stream=self.ctx.swap_stream,
                                                 span=("host->device", "activations"))
            # Freed unread (a prefetched tensor whose node never runs), it still waits for the copy.
            self.ctx.record_stream(record.in_buf, self.ctx.swap_stream)
        self.stats["swap_in_bytes"] += record.nbytes

    def _prefetch(self, call: _BlockCall | None) -> None:
        if call is not None:
            for ref in call.records:
                record = ref()
                if record is not None:
                    self._swap_in(record)

    # ----- passes -------------------------------------------------------------------------
    @contextmanager
    def backward_pass(self):
        if self._measure and any(c is not None for c in self._calls):
            self._measure = False
        if self.modes and self.modes[-1] is BlockMode.SWAP:
            self._prefetch(self._calls[-1])  # needed first; nothing to hide it behind
        try:
            yield
        finally:
            self.host.trim()

    def measure_next_forward(self) -> None:
        """Count the saved tensors of kept blocks in the next forward pass with gradients."""
        self._measure = True

    # ----- report -------------------------------------------------------------------------
    def report(self) -> tuple[BlockActivations, ...]:
        out = []
        for i, (mode, call) in enumerate(zip(self.modes, self._calls)):
            s = call or _BlockCall()
            measured = mode is not BlockMode.CHECKPOINT and call is not None
            out.append(BlockActivations(index=i, mode=mode, saved_bytes=s.saved if measured else None,
                                        input_bytes=s.input, device_bytes=s.device, host_bytes=s.host))
        return tuple(out)

class _BufferState:
    """The buffers of one call of a checkpointed block, for its recomputation ([Note: block
    forwards]): their values from before the forward, kept only if the forward changed them."""

    def __init__(self, block: nn.Module) -> None:
        self.places = [(m, name, b) for m in block.modules() for name, b in m.named_buffers(recurse=False)
                       if b is not None]  # (module, buffer name, buffer)
        self.before: list[Tensor] | None = None
        self.ran = False  # the forward ran (a later run is the recomputation)

    @contextmanager
    def forward(self):
        versions = [b._version for _, _, b in self.places]
        with torch.no_grad():
            before = [b.clone() for _, _, b in self.places]
        yield
        if any(b._version != v for (_, _, b), v in zip(self.places, versions)):
            self.before = before

    @contextmanager
    def recompute(self):
        if self.before is None:  # the forward left its buffers alone
            yield
            return
        with torch.no_grad():
            stand_ins = [b.clone() for b in self.before]
        for (module, name, _), stand_in in zip(self.places, stand_ins):
            setattr(module, name, stand_in)
        try:
            yield
        finally:
            for module, name, buffer in self.places:
                setattr(module, name, buffer)


def _forward_signature(block: nn.Module) -> inspect.Signature:
    """The signature a block's cache arguments are found by (``_without_cache``); a
    ``torch.compile`` wrapper's is its module's (its own forward takes ``*args, **kwargs``, where
    a cache passed by position, as GPT-2's blocks get theirs, would not be found)."""
    return inspect.signature((block._orig_mod if is_compile_wrapper(block) else block).forward)
