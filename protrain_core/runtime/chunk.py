"""One chunk of model states: its storage, its residency and its gradients, with the verbs
that move it from state to state.

[Note: chunk lifecycle]
A chunk has two state machines. Every verb checks that it is legal in the current state
(``IllegalTransition`` otherwise, with nothing changed), does its storage work, and sets the
new state last. The scheduler (runtime/scheduler.py) only decides *when* to call a verb.

Residency (``ChunkState``): where the chunk's compute copy is.

  verb          from        to          storage work
  persist       HOST        PERSISTENT  (a re-plan, onloading) every tensor moved to the device
  unpersist     PERSISTENT  HOST        (a re-plan, offloading) every tensor moved to a host buffer
  begin_fetch   HOST        FETCHING    allocate the device copy; copy host -> device (copy stream)
  end_fetch     FETCHING    RESIDENT    compute stream waits for the copy; parameters -> device copy
  release       RESIDENT    HOST        parameters -> host copy; free the device copy
  begin_offload RESIDENT    OFFLOADING  copy the gradient buffer to the host; hand it to the worker
  end_offload   OFFLOADING  UPDATING    parameters -> host copy; free the device copy and buffer
  begin_update  HOST        UPDATING    hand Adam on the host states to the CPU worker
  end_update    UPDATING    HOST        wait for the worker (re-raises its failure)

While a chunk is ``UPDATING`` the worker owns its host tensors: its parameters must not be read
until ``end_update`` (a fetch, ``step()`` or ``wait_all`` waits for it).

Gradients (``GradState``): what the gradient accumulator holds since ``zero_grad``.

  verb          from            to        meaning
  receive       EMPTY           FIRST     the first backward since zero_grad writes gradients
                READY           MORE      a further backward accumulates (no_sync micro-batch)
                FIRST, MORE     (same)    more gradients of the same backward
  land          FIRST, MORE     READY     this backward's gradients are in the accumulator
                                          (a streamed chunk's: begin_offload, by the CPU worker)
  land_applied  FIRST, MORE     APPLIED   begin_offload when Adam overlaps backward: the worker
                                          runs Adam right after landing
  apply         READY           APPLIED   Adam at step()
  finish_step   EMPTY, READY,   READY     step() is over (EMPTY stays EMPTY); the gradients stay
                APPLIED                   until zero_grad, as ``p.grad`` does
  zero          EMPTY, READY,   EMPTY     zero_grad
                APPLIED

``receive`` from ``APPLIED`` is illegal: a second backward after an update would need the
gradients Adam consumed. Which members received a gradient since ``zero_grad`` and which have
Adam state are per-member facts the chunk keeps alongside.

[Note: parameter access]
Every managed parameter's ``.data`` is, at any time, a view of one of two flat tensors of its
chunk: the device copy while the chunk is resident (or persistent), the host copy while it is
not; so it never holds stale or garbage data.

The device copy is one permanent tensor per chunk; releasing frees its memory with
``untyped_storage().resize_(0)`` and fetching re-allocates it with ``resize_`` (FSDP2's
technique). Autograd's saved tensors stay valid: a saved parameter is the parameter object, so
unpacking reads whatever ``.data`` points at in backward, and a saved *view* of one shares the
device copy's storage, which the fetch before that block's backward refills with the same
values. Re-pointing ``.data`` does not touch the version counter, and a parameter the user
rebound (``p.data = t``, which ``points`` tells) keeps its value: whatever points the chunk's
parameters anew takes it into the chunk first (``_take``). A pre-backward hook on each
unit's outputs makes its chunks resident before any of its backward nodes runs (runtime/hooks.py),
including a checkpointed block's recomputation ([Note: block forwards] in activations.py).

[Note: a pass's placeholders]
Autograd keeps one gradient accumulator per parameter for a graph, unless ``.data`` was
re-pointed at a tensor of another device or dtype since its last use: then a parameter used
twice in one forward (tied weights) would deliver its gradient in two parts, and the chunk would
be updated before the last one came. So on a CUDA device (the host copy is on another device)
a chunk released inside a pass (from a training forward's first hooked unit to the end of its
backward) points its parameters at a NaN of their device and dtype expanded to their shapes
(``point_at_placeholders``), and at rest only when the pass is over (``Scheduler.settle``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import Tensor

from protrain_core.memtrack import untracked
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.storage import ChunkStorage
from protrain_core.runtime.values import ChunkValues
from protrain_core.structure.layout import ChunkSpec
from protrain_core.utils import plain_parameters


class ChunkState(enum.Enum):
    """Where a chunk's up-to-date states are and what moves them ([Note: chunk lifecycle])."""

    PERSISTENT = "persistent"  # everything on the device (until a re-plan streams it)
    HOST = "host"  # streamed chunk at rest: host copies are authoritative, no device memory
    FETCHING = "fetching"  # host -> device copy of the compute copy issued
    RESIDENT = "resident"  # device buffer valid; parameters point at it
    OFFLOADING = "offloading"  # backward done; device -> host gradient copy issued
    UPDATING = "updating"  # host copies owned by the CPU worker (grad landing and/or Adam)


class GradState(enum.Enum):
    """What a chunk's gradient accumulator holds in the step ([Note: chunk lifecycle])."""

    EMPTY = "empty"  # nothing since zero_grad: the accumulator holds garbage
    FIRST = "first"  # the first backward since zero_grad is writing gradients
    MORE = "more"  # a further backward is writing gradients to add to the accumulator
    READY = "ready"  # the accumulator holds the gradients; no update used them yet this step
    APPLIED = "applied"  # Adam used them this step; step() completes the step


# (verb, from-state) -> to-state. Anything else is illegal.
TRANSITIONS: dict[tuple[str, ChunkState], ChunkState] = {
    ("persist", ChunkState.HOST): ChunkState.PERSISTENT,
    ("unpersist", ChunkState.PERSISTENT): ChunkState.HOST,
    ("begin_fetch", ChunkState.HOST): ChunkState.FETCHING,
    ("end_fetch", ChunkState.FETCHING): ChunkState.RESIDENT,
    ("release", ChunkState.RESIDENT): ChunkState.HOST,
    ("begin_offload", ChunkState.RESIDENT): ChunkState.OFFLOADING,
    ("end_offload", ChunkState.OFFLOADING): ChunkState.UPDATING,
    ("begin_update", ChunkState.HOST): ChunkState.UPDATING,
    ("end_update", ChunkState.UPDATING): ChunkState.HOST,
}
VERBS = tuple(sorted({verb for verb, _ in TRANSITIONS}))

G = GradState
GRAD_TRANSITIONS: dict[tuple[str, GradState], GradState] = {
    ("receive", G.EMPTY): G.FIRST,
    ("receive", G.READY): G.MORE,
    **{("receive", s): s for s in (G.FIRST, G.MORE)},
    **{("land", s): G.READY for s in (G.FIRST, G.MORE)},
    **{("land_applied", s): G.APPLIED for s in (G.FIRST, G.MORE)},
    ("apply", G.READY): G.APPLIED,
    **{("finish_step", s): G.EMPTY if s is G.EMPTY else G.READY for s in (G.EMPTY, G.READY, G.APPLIED)},
    **{("zero", s): G.EMPTY for s in (G.EMPTY, G.READY, G.APPLIED)},
}
GRAD_VERBS = tuple(sorted({verb for verb, _ in GRAD_TRANSITIONS}))


class IllegalTransition(RuntimeError):
    """A lifecycle verb called on a chunk in a state it does not leave that way (nothing changed)."""


def _next(table: dict, verb: str, state, index: int):
    target = table.get((verb, state))
    if target is None:
        legal = [v for v, s in table if s is state]
        raise IllegalTransition(f"chunk {index}: cannot {verb} in state {state.name} (legal: {legal or 'none'})")
    return target


class Chunk:
    """Flat storage of one chunk and the verbs of its lifecycle (see [Note: chunk lifecycle])."""

    def __init__(self, spec: ChunkSpec, *, params: list[torch.nn.Parameter], storage: ChunkStorage,
                 opt_members: dict[int, list[int]]) -> None:
        self.spec = spec
        self.index = spec.index
        self.params = params  # aligned with spec.members
        self.storage = storage
        self.values = ChunkValues(spec, storage)  # where each member is, and its values
        self.opt_members = opt_members  # param group -> members the optimizer updates
        self.grad_members = tuple(i for i, p in enumerate(params) if p.requires_grad)
        self.state = ChunkState.PERSISTENT if storage.persistent else ChunkState.HOST
        self.grad_state = GradState.EMPTY
        self._received = [False] * len(params)  # got a gradient since zero_grad
        self.adam_state = [False] * len(params)  # each member has optimizer state (like torch's optimizer.state)
        self._arrived = 0  # members whose gradient arrived in the current backward pass
        self._written: list[bool] = []  # the members whose gradient is in the gradient buffer
        self._grad_gaps = self.values.span_gaps(self.grad_members)  # zeroed in each new gradient buffer
        self.pins = 0  # forward uses in flight
        self.last_use = 0  # for least-recently-used eviction
        self._event = None  # the fetch or offload copy in flight
        self._future: Future | None = None  # the CPU worker's job on this chunk
        self._reduced: Tensor | None = None  # W processes: this rank's piece of the reduced gradients
        self._pointed = [(0, 0)] * len(params)  # (data_ptr(), _version) of each parameter where the chunk pointed it
        self._form: dict[int, tuple] = {}  # (shape, dtype) of each parameter pointed so
        self.handed: list[tuple[int, Tensor, int]] = []  # (member, tensor, its _version) read out (``hand_out``)
        self.at_placeholders = False  # released inside a pass: parameters at device NaN ([Note: a pass's placeholders])
        self._nan: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def __repr__(self) -> str:
        return f"Chunk({self.index}, {self.state.value}, grads {self.grad_state.value})"

    # ----- residency ------------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return self.state is ChunkState.PERSISTENT

    def _moved(self, verb: str) -> ChunkState:
        return _next(TRANSITIONS, verb, self.state, self.index)

    def persist(self, *, keep_host: bool = False, copy=None) -> None:
        """A re-plan keeps this streamed chunk on the device from now on (``keep_host``, ``copy``:
        ``ChunkStorage.make_persistent``)."""
        target = self._moved("persist")
        self.values.forget_views()
        self.storage.make_persistent(keep_host=keep_host, copy=copy)
        self.point_params_at(self.storage.device_copy)
        self.state = target

    def unpersist(self, copy=None, *, parked: bool = False) -> None:
        """A re-plan streams this persistent chunk from now on, or ``offload_states`` parks it
        (``parked``, ``copy``: ``ChunkStorage.make_streamed``)."""
        target = self._moved("unpersist")
        self.values.forget_views()
        self.storage.make_streamed(copy, gradients=self.has_gradients, parked=parked)
        self.point_at_rest()
        self.state = target

    def begin_fetch(self, ctx: DeviceContext) -> None:
        """Upload the compute copy (with ``W`` processes: this rank's shard, then all-gather it)."""
        target = self._moved("begin_fetch")
        storage = self.storage
        storage.allocate_device_copy()
        for host, device in storage.shard_places():
            self._event = ctx.copy_async(device, host, stream=ctx.h2d_stream, span=("host->device", f"chunk {self.index}"))
        if storage.frozen_store is not None:  # the same stream: this event comes after the copies above
            self._event = storage.upload_frozen(ctx, f"chunk {self.index} (8-bit frozen)")
        if not storage.fmt.whole:
            self._event = ctx.collective(storage.gather, after=self._event,
                                         span=("collectives", f"all-gather chunk {self.index}"))
        self.state = target

    def end_fetch(self, ctx: DeviceContext, *, wait_on_host: bool = False) -> None:
        """The compute stream waits for the copy (``wait_on_host``: the calling thread does)."""
        target = self._moved("end_fetch")
        ctx.synchronize(self._event) if wait_on_host else ctx.wait_on_compute(self._event)
        self._event = None
        self.point_params_at(self.storage.device_copy)
        self.state = target

    def release(self, *, in_pass: bool = False) -> None:
        """Free the device copy; ``in_pass``: the parameters point at device placeholders until
        ``settle`` ([Note: a pass's placeholders])."""
        target = self._moved("release")
        self.point_at_placeholders() if in_pass else self.point_at_rest()
        self.storage.free_device_copy()
        self.state = target

    def begin_offload(self, ctx: DeviceContext, *, applied: bool, landing_for: Callable[[bool], Tensor],
                      submit: Callable[[object, Tensor, bool], Future]) -> None:
        """Copy the gradient buffer (with ``W`` processes: this rank's piece of its reduced mean)
        to the host tensor ``landing_for(replace)`` and hand the chunk to the CPU worker, which
        lands the gradients (and runs Adam when ``applied``): ``submit(event, landing, replace)``
        returns its future. ``replace``: the first pass since zero_grad (replacing the garbage)."""
        self.adopt_rebound()
        target = self._moved("begin_offload")
        grad_target = self._grad_moved("land_applied" if applied else "land")
        replace = self.grad_state is GradState.FIRST
        self._zero_missing()
        landing = landing_for(replace)
        storage = self.storage
        buffer = source = storage.grad_buffer
        after = None
        if not storage.fmt.whole:  # this rank's piece of the gradients' mean, reduce-scattered
            self._reduced = source = storage.empty(storage.fmt.state_numel, buffer.dtype)
            after = ctx.collective(lambda: storage.sharding.reduce_scatter_mean(source, buffer, scaled=True),
                                   span=("collectives", f"reduce-scatter chunk {self.index}"))
        self._event = ctx.copy_async(landing, source, stream=ctx.d2h_stream, after=after,
                                     span=("device->host", f"chunk {self.index}"))
        self._future = submit(self._event, landing, replace)
        self.grad_state = grad_target
        self.state = target

    def end_offload(self, ctx: DeviceContext, *, in_pass: bool = False) -> None:
        """Free the device memory in stream order, without waiting for the copy ([Note: streams]
        in device.py): the CPU worker alone waits for it. ``in_pass``: as in ``release``."""
        target = self._moved("end_offload")
        storage = self.storage
        for t in (storage.grad_buffer, self._reduced):
            if t is not None:
                ctx.record_stream(t, ctx.d2h_stream)
                if not storage.fmt.whole:
                    ctx.record_stream(t, ctx.comm_stream)
        copied, self._event = self._event, None
        self.point_at_placeholders() if in_pass else self.point_at_rest()
        storage.free(self._reduced, after=copied)
        self._reduced = None
        storage.free_grad_buffer(after=copied)
        storage.free_device_copy()
        self.state = target

    def copy_done(self, ctx: DeviceContext) -> bool:
        """The fetch or offload copy in flight (if any) has completed."""
        return ctx.done(self._event)

    def begin_update(self, submit: Callable[[], Future]) -> None:
        """Hand Adam on the host states to the CPU worker: ``submit()`` returns its future."""
        target = self._moved("begin_update")
        self._future = submit()
        self.state = target

    def end_update(self) -> None:
        target = self._moved("end_update")
        future, self._future = self._future, None
        future.result()  # re-raises a failure of the worker
        self.state = target

    def update_finished(self) -> bool:
        """An UPDATING chunk whose worker job is done (``end_update`` will not block)."""
        return self.state is ChunkState.UPDATING and self._future.done()

    @property
    def device_resident(self) -> bool:
        return self.state in (ChunkState.FETCHING, ChunkState.RESIDENT, ChunkState.OFFLOADING)

    def pin(self, tick: int) -> None:
        self.pins += 1
        self.last_use = tick

    def unpin(self) -> None:
        self.pins -= 1

    def touch(self, tick: int) -> None:
        self.last_use = tick

    # ----- gradients --------------------------------------------------------------------------
    def _grad_moved(self, verb: str) -> GradState:
        return _next(GRAD_TRANSITIONS, verb, self.grad_state, self.index)

    def receive(self, i: int, grad: Tensor) -> bool:
        """Member ``i``'s gradient of this backward, into the accumulator (persistent) or the
        gradient buffer; True when every member with gradients has its gradient of this pass."""
        target = self._grad_moved("receive")
        if self.persistent and self.storage.fmt.whole:
            dst = self.values.state_view(self.storage.grad_acc, i)
            dst.add_(grad) if self._received[i] else dst.copy_(grad)
        else:  # a streamed chunk (resident), or any chunk sharded over W processes
            assert self.state in (ChunkState.RESIDENT, ChunkState.PERSISTENT), self
            buffer = self.storage.grad_buffer
            if buffer is None:
                buffer = self.storage.allocate_grad_buffer(zero=self._grad_gaps)
                self._written = [False] * len(self.params)
            dst, scale = self.values.span_view(buffer, i), self.storage.sharding.pre_scale
            if scale is None:
                dst.copy_(grad)
            elif grad.dtype == dst.dtype:
                torch.mul(grad, scale, out=dst)  # the copy and the mean's scaling in one pass
            else:
                dst.copy_(grad).mul_(scale)
            self._written[i] = True
        self._received[i] = True
        self._arrived += 1
        self.grad_state = target
        return self._arrived == len(self.grad_members)

    @property
    def receiving(self) -> bool:
        return self.grad_state in (GradState.FIRST, GradState.MORE)

    @property
    def holds_gradient_buffer(self) -> bool:
        return self.storage.grad_buffer is not None

    def land(self, ctx: DeviceContext | None = None) -> None:
        """A persistent chunk's gradients of this pass are in its accumulator (with ``W`` processes,
        reduce-scattered into it on the communication stream: ``await_reduction``; ``ctx``)."""
        assert self.persistent, self
        target = self._grad_moved("land")
        storage = self.storage
        if not storage.fmt.whole and storage.grad_buffer is not None:
            self._zero_missing()
            buffer, first = storage.grad_buffer, self.grad_state is GradState.FIRST
            direct = first and storage.grad_acc.dtype == buffer.dtype  # reduced into the accumulator itself
            reduced = []

            def reduce() -> None:
                out = storage.grad_acc if direct else storage.empty(storage.fmt.state_numel, buffer.dtype)
                reduced.append(out)
                storage.sharding.reduce_scatter_mean(out, buffer, scaled=True)

            def accumulate() -> None:
                storage.grad_acc.copy_(reduced[0]) if first else storage.grad_acc.add_(reduced[0])
                storage.free(reduced[0])

            self._event = ctx.collective(reduce, then=None if direct else accumulate,
                                         span=("collectives", f"reduce-scatter chunk {self.index}"))
            ctx.record_stream(buffer, ctx.comm_stream)
            storage.free_grad_buffer(after=self._event)
        self.grad_state = target

    def await_reduction(self, ctx: DeviceContext) -> None:
        """The compute stream waits for ``land``'s or ``gather_updated``'s collective."""
        ctx.wait_on_compute(self._event)
        self._event = None

    def gather_updated(self, ctx: DeviceContext) -> None:
        """With ``W`` processes, after a persistent chunk's update: its trainable span all-gathered
        on the communication stream (``await_reduction`` waits for it)."""
        self._event = ctx.collective(lambda: self.storage.gather(frozen=False),
                                     span=("collectives", f"all-gather chunk {self.index}"))

    def apply(self) -> None:
        self.grad_state = self._grad_moved("apply")

    def finish_step(self) -> None:
        self.grad_state = self._grad_moved("finish_step")

    def end_pass(self) -> None:
        self._arrived = 0

    def _zero_missing(self) -> None:
        """Before the gradient buffer is read: zero the places of the members whose gradient is
        not in it (none in this pass, or in an earlier buffer of the pass: a chunk evicted)."""
        for i in self.grad_members:
            if not self._written[i]:
                self.values.span_view(self.storage.grad_buffer, i).zero_()

    def zero(self) -> None:
        target = self._grad_moved("zero")
        self._received = [False] * len(self.params)
        if self.state is not ChunkState.UPDATING and self.storage.return_accumulator(consumed=False):
            self.values.forget_views()  # a partial landing's own accumulator, no longer needed
        self.grad_state = target

    def clear_grad(self, i: int) -> None:
        """Member ``i``'s gradient is gone (``p.grad = None``): its place in the accumulator is zeroed."""
        if self.storage.fmt.accumulator:
            self.values.state_view(self.storage.grad_acc, i).zero_()
        self._received[i] = False
        if not any(self._received):
            self.zero()

    @property
    def applied(self) -> bool:
        return self.grad_state is GradState.APPLIED

    def has_grad(self, i: int) -> bool:
        """Member ``i`` received a gradient since zero_grad (torch: ``p.grad is not None``)."""
        return self._received[i]

    @property
    def has_gradients(self) -> bool:
        return any(self._received)

    # ----- parameters ------------------------------------------------------------------------
    @plain_parameters
    def point_at_rest(self, members=None) -> None:
        """Point the parameters (of ``members``: default all) of a streamed chunk that is not
        resident at its host copy; at a NaN expanded to their shapes where it holds no value (``W``
        processes: [Note: sharded chunks]; quantised members: [Note: quantised frozen chunks])."""
        storage = self.storage
        self._take(self.rebound())  # (a parameter the user rebound keeps its value: [Note: parameter access])
        for i in range(len(self.params)) if members is None else members:
            p = self.params[i]
            # one process: every member but a quantised one has its value at rest
            at_rest = self.values.at_rest(i) if storage.fmt.whole else None
            if at_rest is None:
                at_rest = self._nan_of(storage.host, storage.fmt.compute_dtype).expand(p.shape)
            p.data = at_rest
            self._mark(i)
        self.at_placeholders = False

    @plain_parameters
    def point_at_placeholders(self) -> None:
        """Point the parameters at a NaN of their device and dtype ([Note: a pass's placeholders])."""
        self._take(self.rebound())
        for i, p in enumerate(self.params):
            p.data = self._nan_of(p.device, p.dtype).expand(p.shape)
            self._mark(i)
        self.at_placeholders = True

    def _nan_of(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """One NaN element of ``device`` and ``dtype``, made once per chunk."""
        nan = self._nan.get((device, dtype))
        if nan is None:
            with untracked():  # chunk memory (one element), not an activation
                nan = self._nan[(device, dtype)] = torch.full((), float("nan"), dtype=dtype, device=device)
        return nan

    def settle(self) -> None:
        """After a pass: parameters left at the placeholders point at rest."""
        if self.at_placeholders:
            self.point_at_rest()

    @plain_parameters
    def materialise(self) -> None:
        """Point the quantised frozen members of a streamed chunk at rest at their values until
        the chunk next moves (``module.state_dict()``: [Note: quantised frozen chunks])."""
        if self.storage.frozen is None or self.device_resident or self.persistent:
            return
        for i, *_ in self.storage.frozen.quantised:
            self.params[i].data = self.values.member_value(i)
            self._mark(i)

    @plain_parameters
    def point_params_at(self, flat: Tensor, members=None) -> None:
        """Re-point the parameters (of ``members``) at their slots in ``flat`` ([Note: parameter access])."""
        self._take(self.rebound())
        for i in range(len(self.params)) if members is None else members:
            p = self.params[i]
            p.data = self.values.view(flat, i)
            self._mark(i)
        self.at_placeholders = False

    @plain_parameters
    def holds_value(self, i: int) -> bool:
        """Member ``i``'s parameter points at its value, not at a NaN placeholder."""
        ptr = self.params[i].untyped_storage().data_ptr()
        return all(ptr != nan.untyped_storage().data_ptr() for nan in self._nan.values())

    @plain_parameters
    def points(self, i: int) -> bool:
        """Member ``i``'s parameter points where the chunk pointed it (not rebound by the user)."""
        return self.params[i].data_ptr() == self._pointed[i][0]

    @plain_parameters
    def rebound(self) -> list[int]:
        """The members whose ``.data`` the user rebound, or wrote in place through the parameter (a
        module's own ``weight.clamp_()`` in its forward, ``nn.Embedding(max_norm=...)``) or through
        a tensor read out of it (``hand_out``), since the chunk last pointed them."""
        moved = {i for i, p in enumerate(self.params) if (p.data_ptr(), p._version) != self._pointed[i]}
        return sorted(moved | {i for i, t, version in self.handed if t._version != version})

    def hand_out(self, i: int, t: Tensor) -> Tensor:
        """What a read of member ``i`` outside the units returns for ``t`` (its ``p.data``, or a copy
        of a resident streamed chunk's member): a tensor sharing ``t``'s version counter, so that a
        write into it (``p.data.copy_(x)``, as Lightning's weight averaging swaps weights) is taken
        into the chunk at the next ``adopt_rebound``; ``t`` is kept until then."""
        self.handed.append((i, t, t._version))
        return t.detach()

    def _mark(self, i: int) -> None:
        """Member ``i``'s parameter is pointed where the chunk holds its value."""
        p = self.params[i]
        self._pointed[i] = (p.data_ptr(), p._version)
        self._form[i] = (p.shape, p.dtype)

    def adopt_rebound(self) -> None:
        """What was rebound or written in place (``rebound``) into the chunk: before an update
        reads the masters (the device Adam of a persistent chunk, a streamed chunk's offload),
        and between steps (``StateAccess.adopt_rebound``). Tensors read out before are let go."""
        if members := self.rebound():
            self.adopt(members)
        self.handed.clear()

    @plain_parameters
    def adopt(self, members: list[int] | None = None) -> None:
        """Take these members' values (rebound, or written in place; None: every member's) into the
        chunk, and point their parameters (only theirs) back at it."""
        self._take(range(len(self.params)) if members is None else members)
        if self.persistent or self.device_resident:
            self.point_params_at(self.storage.device_copy, members)
        else:
            self.point_at_rest(members)

    @plain_parameters
    def _take(self, members) -> None:
        """These members' values as their parameters hold them, into the chunk (and a resident
        streamed chunk's device copy); each is pointed anew next, by the caller."""
        written = {i: t for i, t, version in self.handed if t._version != version}  # (the last one read)
        with torch.no_grad():
            for i in members:
                value = written[i] if i in written and self.points(i) else self.params[i].detach()
                self._check_form(i, value)
                self.values.set_member(i, value, in_place=self.points(i))
                if not self.persistent and self.device_resident:  # as stored (a quantised member's round trip)
                    self.values.view(self.storage.device_copy, i).copy_(self.values.member_value(i))
                self._mark(i)
        self.handed = [r for r in self.handed if r[0] not in members]

    def _check_form(self, i: int, value: Tensor) -> None:
        """A parameter rebound to another shape or dtype after wrap is refused: its chunk holds it
        as it was (plain PyTorch's step fails on it too)."""
        form = self._form.get(i)
        if form is not None and (value.shape, value.dtype) != form:
            raise RuntimeError(
                f"The parameter {self.spec.members[i].name!r} now holds a tensor of shape {tuple(value.shape)} and "
                f"{value.dtype}, where its ProTrain chunk holds {tuple(form[0])} and {form[1]}: it was given another "
                "shape or dtype after wrap (resize_token_embeddings(), model.to(dtype), .half(), p.data = ...). Make "
                "such changes before wrap (the precision argument sets the dtypes), or close the engine and wrap anew.")

    @plain_parameters
    def detach_params(self) -> None:
        """Point the parameters at their whole authoritative values for good (the engine closes)."""
        values = self.values.gathered_values()
        for p, value in zip(self.params, values):
            p.data = value if self.persistent else value.to(self.storage.host)
        self.at_placeholders = False

