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
checkpointed blocks are spread evenly over the remaining positions, and the last block keeps
its activations (its backward comes first, right after the forward). See ``plan.interleaved_modes``.

The notes on how blocks are run are next to the code they explain: [Note: block forwards]
(above the manager's block hooks) and [Note: swapping] (above its saved-tensor hooks).
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from protrain_core.phase import Observers, RecomputeObserver, StepState, TrainingPhase
from protrain_core.plan import BlockMode
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.swap import Counted, HostBuffers, Packed, SwapRecord, check_version
from protrain_core.utils import iter_tensors

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
            (parameters, buffers and inputs without gradient -- shared by all blocks --
            excluded): what the block holds on the device when kept,
            and what its recomputation rebuilds when checkpointed. None when not measured
            (a checkpointed block, or a kept block before ``measure_next_forward``).
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


class _BlockCall:
    """One forward call of one block: its measurements and (swap) its records."""

    __slots__ = ("saved", "input", "device", "host", "seen", "shared", "records", "previous", "copied")

    def __init__(self) -> None:
        self.saved = 0
        self.input = 0
        self.device = 0
        self.host = 0
        self.seen: set[StorageWeakRef] = set()  # storages counted in this call (and shared ones)
        self.shared: set[StorageWeakRef] = set()  # inputs without gradient: never swapped
        self.records: list[weakref.ref] = []  # swap records first made by this call
        self.previous: _BlockCall | None = None  # the previous block's call in the same forward
        self.copied = None  # the event of its last copy out (swapped blocks; until waited for)


class ActivationManager:
    """Applies a per-block activation layout to the blocks of one model."""

    def __init__(
        self,
        blocks: list[nn.Module],
        modes: tuple[BlockMode, ...],
        ctx: DeviceContext,
        phase: StepState,
        *,
        observers: Observers | None = None,
        warn_on_cache: bool = True,
        min_swap_bytes: int = MIN_SWAP_BYTES,
        on_recompute=None,
    ) -> None:
        assert len(blocks) == len(modes)
        self.blocks = blocks
        self.modes = modes
        self.ctx = ctx
        self.phase = phase
        self.min_swap_bytes = min_swap_bytes
        self.host = HostBuffers(ctx)
        self._static: set[StorageWeakRef] = set()  # parameter storages: never swapped
        self._swapped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._calls: list[_BlockCall | None] = [None] * len(blocks)  # the latest call of each block
        self._open: list[list] = [[] for _ in blocks]  # per block: (call, saved-tensor hooks) of calls running
        self._rng_anchor = torch.empty(0, device=ctx.device)
        self._measure = True  # count kept blocks' saved tensors in the next forward
        self._warn_on_cache = warn_on_cache
        self._handles: list = []
        self._originals: dict[int, tuple[bool, object]] = {}  # checkpointed blocks' own forward attribute
        # observer(block_index, begin) around every recomputation (the owner's registry).
        self._recompute_observers = Observers(RecomputeObserver) if observers is None else observers
        # on_recompute(): a recomputation's first act; it may be the first of a backward the user
        # started ([Note: loss.backward()] in backward.py). Dropped by remove (no cycle).
        self._on_recompute = on_recompute
        self.stats = {"swap_out_bytes": 0, "swap_in_bytes": 0, "recomputed_blocks": 0}

    @property
    def measuring(self) -> bool:
        """Kept blocks' saved tensors are counted in the next forward pass with gradients."""
        return self._measure

    # ----- installation -------------------------------------------------------------------
    def install(self, static_tensors: list[Tensor]) -> None:
        """Manage every block; ``static_tensors``: tensors whose storage never swaps."""
        self._static = {StorageWeakRef(t.untyped_storage()) for t in static_tensors}
        for i, block in enumerate(self.blocks):
            if self.modes[i] is BlockMode.CHECKPOINT:
                self._originals[i] = ("forward" in block.__dict__, block.__dict__.get("forward"))
                # Bound to the block: a deep copy of the model (an EMA, Lightning's weight
                # averaging) binds it to the copied block, which then runs its own forward.
                block.forward = types.MethodType(self._checkpointed_forward(i, block.forward), block)
            else:
                signature = inspect.signature(block.forward)
                self._handles.append(block.register_forward_pre_hook(self._pre_forward(i, signature), with_kwargs=True))
                # Prepended: its prefetch hooks go on the outputs before the runtime's, so swapped
                # activations start coming back before the block's chunks are fetched.
                self._handles.append(block.register_forward_hook(self._post_forward(i), always_call=True, prepend=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for i, (had, prev) in self._originals.items():
            if had:
                self.blocks[i].forward = prev
            else:
                del self.blocks[i].forward
        self._originals.clear()
        self._on_recompute = None
        self.ctx.synchronize_device()  # no copy may still read a host buffer
        self.host.close()

    # [Note: block forwards]
    # Kept and swapped blocks are managed with public hooks: a forward pre-hook (``with_kwargs``)
    # enters the block's ``saved_tensors_hooks`` (counting or swapping what autograd saves) and, for
    # a swapped block, drops the key/value cache arguments; the forward hook (``always_call``) leaves
    # it and registers the prefetch hooks on the outputs. A checkpointed block needs its forward to
    # run *inside* ``torch.utils.checkpoint.checkpoint``, and no public hook can do that (the
    # composable ``checkpoint`` API lives in a private module). A wrapper module, as
    # ``checkpoint_wrapper`` makes, keeps state-dict keys (its hooks strip the wrapper's prefix), but
    # it changes what else names the block: ``named_parameters()`` and ``named_modules()`` of the
    # root gain the wrapper's prefix (names the chunk layout, the optimizer's parameter names, PEFT
    # and the user's code read), and every re-plan that checkpoints another block would swap modules
    # in their parents under code that holds references to them. So the manager gives a checkpointed
    # block an *instance* ``forward`` attribute that calls the original inside ``checkpoint`` (the
    # class, the module tree and every name stay as they are; ``remove()`` restores it). Module hooks stay
    # outside: the chunk runtime's forward pre-hook makes the block's chunks resident before the
    # wrapper runs, and checkpoint recomputation calls the original ``forward`` directly, so the
    # hooks do not run again during backward. What makes the chunks resident for the recomputation
    # is the runtime's pre-backward hook on the block's outputs: it fires when the gradient of an
    # output is complete, before any backward node of the block -- and so before the recomputation,
    # which the first of those nodes triggers (see [Note: parameter access] in chunk.py); the
    # manager marks the recomputation as ``TrainingPhase.RECOMPUTE``.
    # Buffers a checkpointed block updates in forward (BatchNorm's running statistics and
    # ``num_batches_tracked``) would be updated again by the recomputation. The first run keeps a copy
    # of the block's buffers from before its forward when the forward changed any of them (their
    # version counters moved; the copy is dropped otherwise); the recomputation runs on fresh copies
    # of those values (it reads what the forward read), put in the buffers' places for its duration,
    # and the buffers themselves are put back untouched afterwards (``_BufferState``): the buffers end
    # as one forward left them, as without checkpointing, and recomputed activations equal the
    # forward's.
    # Checkpointed calls get a zero-size device tensor as their first positional argument: non-
    # reentrant checkpoint saves and restores the device RNG state (dropout) only for devices it sees
    # among positional arguments, and a block may be called with keyword arguments only.
    # Caches: a block that writes a key/value cache (Hugging Face ``past_key_values``) would write
    # it twice under recomputation, and a swapped block's cache would pin its activations on the
    # device. With gradients enabled, checkpointed and swapped blocks therefore run with the cache
    # arguments set to None and ``use_cache=False`` -- what Hugging Face does with its own gradient
    # checkpointing -- and a warning says so once. Without gradients (evaluation, generation) every
    # block runs its plain forward, cache included.

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
            entry = self._open[i].pop()
            call = None
            if entry is not None:
                call, hooks = entry
                hooks.__exit__(None, None, None)
            if torch.is_grad_enabled() and output is not None:  # None: the forward raised
                self._after_call(i, call, output)

        return hook

    # ----- checkpointed blocks: the forward wrapper ([Note: block forwards]) -------------------
    def _checkpointed_forward(self, i: int, forward):
        signature = inspect.signature(forward)
        recompute = self._recomputing(i, forward)

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
            # The anchor is a positional tensor on the device, so that checkpoint saves and
            # restores the device's RNG state (it only looks at positional arguments).
            buffers = _BufferState.of(self.blocks[i])
            out = checkpoint(recompute, buffers, self._rng_anchor, *args, use_reentrant=False,
                             context_fn=self.ctx.checkpoint_contexts, **kwargs)
            self._after_call(i, call, out)
            return out

        return wrapped

    def _recomputing(self, i: int, forward):
        def run(buffers, _anchor, *args, **kwargs):
            if not buffers.ran:  # the first run, in forward
                buffers.ran = True
                with buffers.forward():
                    return forward(*args, **kwargs)
            if self._on_recompute is not None:
                self._on_recompute()
            # A recomputation (it may stop early, by an exception, once the last saved tensor
            # backward needs was rebuilt).
            self.stats["recomputed_blocks"] += 1
            with self.phase.entered(TrainingPhase.RECOMPUTE, leaving=TrainingPhase.BACKWARD,
                                    error="a recomputation inside a recomputation"):
                self._notify(i, begin=True)
                try:
                    with buffers.recompute():
                        return forward(*args, **kwargs)
                finally:
                    self._notify(i, begin=False)

        return run

    def _notify(self, i: int, *, begin: bool) -> None:
        self._recompute_observers.notify(lambda observer: observer(i, begin))

    # ----- every managed call -------------------------------------------------------------------
    def _new_call(self, args, kwargs) -> _BlockCall:
        call = _BlockCall()
        inputs = list(iter_tensors((args, kwargs)))
        call.shared = {k for t in inputs if not t.requires_grad and (k := self._storage_key(t)) is not None}
        call.seen = set(call.shared)  # shared inputs are never counted
        call.input = self._distinct_bytes(inputs, set(call.shared))
        return call

    def _after_call(self, i: int, call: _BlockCall | None, out) -> None:
        """Record the call and register the prefetch hooks on its outputs: a swapped block's
        backward brings back its own activations and those of a swapped block before it; so
        does the block after the last swapped one."""
        if call is not None:
            call.seen = set()
        previous = self._calls[i - 1] if i > 0 else None  # the previous block, this forward
        if call is not None:
            self._calls[i] = call
        if self.modes[i] is BlockMode.SWAP or (i > 0 and self.modes[i - 1] is BlockMode.SWAP):
            if call is not None:
                call.previous = previous
            hook = self._pre_backward_hook(call, previous)
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
    # tensor to a host buffer once and returns a small record; views of that storage saved later
    # (``q``, ``k``, ``v`` split from one projection, a transpose, a tensor saved by two blocks) reuse
    # the record and are rebuilt as views of the same restored storage, so nothing is copied twice.
    # Tensors that alias parameters or buffers (``weight.t()`` in ``linear``), tensors of other
    # devices and storages below ``MIN_SWAP_BYTES`` are returned unchanged: they stay attached to the
    # parameter (or buffer) whose storage they view. So are the block's inputs that do not require
    # gradients (attention masks, LLaMA's rotary cos/sin): they are made once per forward pass and
    # passed to every block, so copying them would free nothing; they are not counted in any
    # block's activation bytes either.
    # On CUDA the copies run on the device context's swap stream, which first waits for the compute
    # stream (the tensor was just produced there). The compute stream does not wait for them, except
    # that a block's forward begins only after the copies out of the block before the previous one
    # are done (``_throttle``): where the link is slower than compute, swapped activations would
    # otherwise pile up on the device beyond what the memory model counts (eq. 9: the previous
    # block's copy may still run). The device storage is marked with
    # ``record_stream(swap_stream)``: when autograd drops it, the caching allocator hands its memory
    # to another tensor only after the copy has completed -- no host thread waits for it. Copies
    # back are allocated on the compute stream, run on the swap stream and are waited for by the
    # compute stream (an event) at unpack; they are marked the same way, for a prefetched tensor that
    # is freed without being read. A host buffer returns to the manager's pool when its record dies;
    # its next use is a copy issued on the same swap stream, so it cannot overtake the copy back
    # that reads it. Prefetch: when the backward of block ``i`` begins (a hook on the outputs of that
    # forward call), the copies back of that call and of the previous block's call in the same
    # forward pass are issued, one block ahead, so one swapped block's activations are on the
    # device beside those of the block running backward. Records belong to the call that made them,
    # so with several forward passes before a backward each backward brings back only its own.
    # On the CPU the copies are synchronous and the "device" and "host" buffers are separate
    # tensors in the same memory.
    # Autograd does not check the version counter of saved tensors that go through hooks; the
    # records keep a weak reference to the original tensor and raise autograd's error at unpack if it
    # was modified in place (when it is still alive to tell).

    # ----- saved-tensor hooks -------------------------------------------------------------
    def _storage_key(self, t: Tensor) -> StorageWeakRef | None:
        """The storage of a saved activation, or None for parameters, buffers and odd tensors."""
        if type(t) not in (Tensor, nn.Parameter) or t.layout is not torch.strided or t.device != self.ctx.device:
            return None
        key = StorageWeakRef(t.untyped_storage())
        if key in self._static:
            return None
        return key

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
        first_in_call = key not in call.seen
        call.seen.add(key)
        if first_in_call:
            call.saved += nbytes
        if nbytes < self.min_swap_bytes:
            call.device += nbytes if first_in_call else 0
            return Counted(t)
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
        ``i - 2`` (this forward pass's call): a swapped block's activations leave the device
        by the time the block after next runs, as the memory model assumes (eq. 9: at most
        the previous block's may still be copying). Without it a copy slower than compute
        would let swapped activations pile up on the device."""
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

    def _pre_backward_hook(self, call: _BlockCall | None, previous: _BlockCall | None):
        """Backward of this call begins: bring back its records and the previous block's."""

        def hook(_grad):
            self._prefetch(call)
            self._prefetch(previous)

        return hook

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
        for i, mode in enumerate(self.modes):
            s = self._calls[i] or _BlockCall()
            measured_saved = mode is not BlockMode.CHECKPOINT and self._calls[i] is not None
            out.append(
                BlockActivations(
                    index=i,
                    mode=mode,
                    saved_bytes=s.saved if measured_saved else None,
                    input_bytes=s.input,
                    device_bytes=s.device,
                    host_bytes=s.host,
                )
            )
        return tuple(out)


class _BufferState:
    """The buffers of one call of a checkpointed block, for its recomputation ([Note: block
    forwards]): their values from before the forward, kept only if the forward changed them."""

    def __init__(self, places: list[tuple[nn.Module, str, Tensor]]) -> None:
        self.places = places  # (module, buffer name, buffer)
        self.before: list[Tensor] | None = None
        self.ran = False  # the forward ran (a later run is the recomputation)

    @staticmethod
    def of(block: nn.Module) -> _BufferState:
        return _BufferState([(m, name, b) for m in block.modules() for name, b in m.named_buffers(recurse=False)
                             if b is not None])

    @contextmanager
    def forward(self):
        if not self.places:
            yield
            return
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
