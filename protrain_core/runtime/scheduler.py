"""When chunks move: fetch, prefetch and evict; gradient offload; the CPU worker's updates.

[Note: when a chunk is needed]
Forward: the pre-hook of every *unit module* (a transformer block, or a module outside the blocks
that owns parameters) pins the unit's chunks on the device and prefetches the next chunk in
execution order; the post-hook unpins them. Unpinned resident chunks (and prefetches in flight)
stay until their buffer is needed, least recently used first, so the last chunks of the forward
are still resident when backward starts. Backward: when a unit call's backward begins, its
chunks are made resident and join the *current* chunks until its backward ends ([Note: a unit's
backward] in hooks.py); the chunk before them is prefetched.
Gradients: ``register_post_accumulate_grad_hook`` fires once per parameter and backward pass,
after autograd summed every use's contribution; the hook moves the gradient into the chunk's
gradient buffer. When every trainable parameter of a streamed chunk has its gradient (backward
needs none of them after that point), the buffer is offloaded and the CPU worker lands it in
the accumulator and, at a gradient-accumulation boundary, finishes the gradients ([Note:
finishing gradients early] in gradients.py) and runs Adam on the chunk while backward goes on
-- or, under fp16 or norm clipping, leaves Adam to ``step()``. Frozen parameters give no such
signal, so a chunk with some is offloaded only once its units leave the active chain. A chunk
still receiving gradients is evicted only as a last resort: its partial gradients are
accumulated on the host like a micro-batch. So the runtime never needs more buffers than the
units active at once ([Note: plan validity] in plan.py).
In mixed precision the offloaded gradients land in the chunk's host compute-dtype copy, which
the worker rewrites from the fp32 master after the update: while a chunk is UPDATING its
parameters must not be read (its next fetch, ``wait_all`` and every state read wait for it).

[Note: a backward that raised]
With one process, a backward that raised lands the gradients that arrived, unapplied, as torch
leaves them in ``p.grad``; the chunks Adam already updated during it stay updated (a warning names
them). ``step()`` then applies the rest, as torch's would; ``zero_grad()`` is allowed and skips
it; a state read before either is refused (``StateAccess.check_between_steps``). With several
processes it ends without collectives (a rank may have left).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from protrain_core.phase import StepState, TrainingPhase
from protrain_core.runtime.chunk import Chunk, ChunkState
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.optim import ChunkOptimizer, UpdateClip
from protrain_core.runtime.options import RuntimeConfig
from protrain_core.runtime.sharding import Sharding, UsageCheck
from protrain_core.runtime.worker import CpuWorker
from protrain_core.utils import plain_parameters, traced

# Events of the timeline that are also counted in ``Scheduler.stats``.
_COUNTED = {"fetch": "fetches", "offload": "offloads", "evict": "evictions", "cpu_adam_end": "cpu_updates"}


@dataclass(frozen=True)
class UpdatePolicy:
    """When streamed chunks are updated (the engine's decision from ``update.overlap_mode``)."""

    during_backward: bool = True  # as soon as a chunk's gradients are offloaded (else after backward)
    landing_clip: UpdateClip = UpdateClip()  # the clipping of updates during backward (elementwise only)


@dataclass(frozen=True)
class BufferPolicy:
    """Which streamed chunk gives its device buffer up, and whether a prefetch may take one: the
    policy, apart from the mechanism (``Scheduler`` fetches, offloads and evicts what it says)."""

    n_buffer: int  # device buffers for streamed chunks (the plan's)

    def victim(self, streamed: list[Chunk], protect: set[int], ctx: DeviceContext, *, spill: bool) -> Chunk | bool | None:
        """The chunk to evict for a free buffer: None if a buffer is free, False if none can go.
        Preference: a chunk whose offload is issued (one whose copy is done first: [Note:
        streams] in device.py), then the least recently used idle or prefetched chunk not in
        ``protect``, then (only if ``spill``) one holding a partial set of gradients."""
        resident = [c for c in streamed if c.device_resident]
        if len(resident) < self.n_buffer:
            return None
        offloading = [c for c in resident if c.state is ChunkState.OFFLOADING]
        if offloading:
            return min(offloading, key=lambda c: (not c.copy_done(ctx), c.last_use))
        idle = [c for c in resident if c.state in (ChunkState.RESIDENT, ChunkState.FETCHING)
                and c.pins == 0 and c.index not in protect]
        candidates = [c for c in idle if not c.holds_gradient_buffer] or (idle if spill else [])
        return min(candidates, key=lambda c: c.last_use) if candidates else False


class Scheduler:
    def __init__(self, chunks: list[Chunk], ctx: DeviceContext, optim: ChunkOptimizer, phase: StepState,
                 sharding: Sharding, *, n_buffer: int, switches: RuntimeConfig, finisher, placement=None) -> None:
        """``n_buffer``: the plan's; ``finisher(chunk)``: the worker's job finishing a streamed chunk's
        gradients at a boundary, or None; ``placement``: the CPU worker's cores (topology.py), or None."""
        self.chunks = chunks
        self.ctx = ctx
        self.sharding = sharding  # the processes the chunks are sharded over ([Note: sharded chunks])
        self.usage = UsageCheck(sharding, chunks)
        self.optim = optim
        self.phase = phase
        self.policy = UpdatePolicy()  # set_policy
        self.finisher = finisher
        self._after_step: set[int] = set()  # chunks whose update step() handed out and did not wait for
        self.stepped_backward = False  # a backward outside no_sync ran since the last step / zero_grad
        self.failed = False  # a backward raised since the last step / zero_grad ([Note: a backward that raised])
        self._received = False  # a parameter's gradient arrived in the running backward
        self.check_invariants = switches.check_invariants
        self.boundary = True  # this backward is followed by step() (not inside no_sync)
        self.passes = 0  # backward passes begun
        self.hps = None  # hyper-parameters snapshot of the current step
        self.current: set[int] = set()  # the chunks of the active chain
        self._chain: list = []  # the active chain: the hooks.UnitCall whose backward began last, and its ancestors
        self._deferred: set[int] = set()  # chunks with all their gradients and frozen members still in use
        self._in_pass = False  # a forward's graph may use the parameters ([Note: a pass's placeholders])
        self._tick = 0
        self.stats = dict.fromkeys(_COUNTED.values(), 0)
        self.events: list[tuple[str, int, float]] = []  # (what, chunk, time) when recording
        self.record_events = False
        self._host_copies = None  # the event of copies to host tensors still in flight (parking)
        self.worker = CpuWorker(ctx, optim, n_staging=0, staging_numel=0, record=self.record,
                                threaded=ctx.asynchronous or switches.cpu_adam_thread, placement=placement)
        self.reconfigure(n_buffer)

    def set_policy(self, policy: UpdatePolicy) -> None:
        """Between steps (no update in flight reads it)."""
        self.policy = policy

    def set_timeline(self, timeline) -> None:
        """Record into ``timeline`` (None: stop): the device context's, which ``record`` reads too."""
        self.ctx.timeline = timeline

    # ----- called by the hooks (runtime/hooks.py) -------------------------------------------
    def pre_forward(self, idxs: tuple[int, ...], *, unit: bool = True) -> None:
        """The chunks resident and pinned until ``post_forward``; ``unit`` False: a use of their
        parameters outside their units (hooks.py), which prefetches nothing."""
        if torch.is_grad_enabled():
            self._in_pass = True
        with traced("ProTrain::pre_forward" if unit else "ProTrain::use_outside_units"):
            self.acquire(idxs, pin=True)
            if unit:
                self.prefetch(max(idxs) + 1)
            self.check()

    def await_chunk(self, c: Chunk) -> None:
        """No copy or update of ``c`` in flight: its parameters' values are where they point."""
        if c.state is ChunkState.OFFLOADING:
            c.end_offload(self.ctx, in_pass=self._in_pass)
        if c.state is ChunkState.UPDATING:
            c.end_update()

    def post_forward(self, idxs: tuple[int, ...]) -> None:
        for i in idxs:
            if not self.chunks[i].persistent:
                self.chunks[i].unpin()

    def begin_unit_backward(self, call) -> None:
        """A unit call's backward begins ([Note: a unit's backward] in hooks.py); the chunk before it is prefetched."""
        self._check_in_backward()
        if call.began == self.passes:  # (a graph kept with retain_graph=True begins again in the next pass)
            return
        call.began = self.passes
        with traced("ProTrain::pre_backward"):
            if call not in self._chain:
                self._chain = [call, *call.ancestors()]
                self.current = {i for c in self._chain for i in c.idxs}
                for i in sorted(self._deferred - self.current):  # no module of theirs runs any more
                    self._deferred.discard(i)
                    self._offload(self.chunks[i], final=True)
            self.acquire(call.idxs, pin=False)
            self.prefetch(min(call.idxs) - 1)
            self.check()

    def _check_in_backward(self) -> None:
        if self.phase.phase is not TrainingPhase.BACKWARD:
            raise RuntimeError(
                f"A backward reached a ProTrain-managed module during the engine's {self.phase.phase.name.lower()} "
                "(a backward started inside the model's forward, a recomputation or a step): run it after the "
                "forward, as engine.backward(loss) or loss.backward()."
            )

    @plain_parameters
    def on_grad(self, c: Chunk, i: int, p: Tensor) -> None:
        self._check_in_backward()
        self._received = True
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        with traced("ProTrain::post_accumulate_grad"), torch.no_grad():
            if not c.persistent and c.state is not ChunkState.RESIDENT:
                self._make_resident(c, protect=self.current | {c.index})
            complete = c.receive(i, grad)
            if complete and c.persistent and not c.storage.fmt.whole:
                self.usage.reduced(c)
                c.land(self.ctx)  # reduce-scattered into its accumulator now
            elif complete and not c.persistent:
                if c.spec.has_frozen and c.index in self.current:
                    self._deferred.add(c.index)  # its frozen weights may still be read by this backward
                else:
                    self._offload(c, final=True)
            self.check()

    # ----- residency ----------------------------------------------------------------------
    def acquire(self, idxs, *, pin: bool) -> None:
        self._tick += 1
        protect = set(idxs) | self.current
        for i in idxs:
            c = self.chunks[i]
            if c.persistent:
                continue
            self._make_resident(c, protect=protect)
            c.pin(self._tick) if pin else c.touch(self._tick)

    def _make_resident(self, c: Chunk, protect: set[int]) -> None:
        self.await_chunk(c)  # the next use of a chunk waits for its own update only
        if c.state is ChunkState.HOST:
            self._make_room(protect | {c.index})
            self._fetch(c)
        if c.state is ChunkState.FETCHING:
            c.end_fetch(self.ctx)

    def prefetch(self, index: int) -> None:
        if not 0 <= index < len(self.chunks) or self.chunks[index].persistent:
            return
        c = self.chunks[index]
        if c.update_finished() or (not self.sharding.whole and c.state is ChunkState.UPDATING):
            c.end_update()  # sharded: every rank must prefetch alike, whatever the worker's timing
        protect = self.current | {index}
        if c.state is not ChunkState.HOST or self.buffers.victim(self.streamed, protect, self.ctx, spill=False) is False:
            return
        self._make_room(protect)
        self._fetch(c)
        c.touch(self._tick)

    def _make_room(self, protect: set[int]) -> None:
        while (victim := self.buffers.victim(self.streamed, protect, self.ctx, spill=True)) is not None:
            if victim is False:
                busy = [(c.index, c.state.name, c.pins) for c in self.streamed if c.device_resident]
                raise RuntimeError(
                    f"ProTrain needs another device chunk buffer but all {self.buffers.n_buffer} are in use "
                    f"(chunk, state, forward pins): {busy}. Increase Plan.n_buffer (or Plan.n_persist)."
                )
            if victim.state is ChunkState.FETCHING:
                victim.end_fetch(self.ctx)  # an unused prefetch: the compute stream waits for its copy
            if victim.state is ChunkState.RESIDENT and victim.holds_gradient_buffer:
                self._offload(victim, final=False)  # finishes at once on the CPU
            if victim.state is ChunkState.OFFLOADING:
                victim.end_offload(self.ctx, in_pass=self._in_pass)
            elif victim.state is ChunkState.RESIDENT:
                self._evict(victim)

    def _fetch(self, c: Chunk) -> None:
        c.begin_fetch(self.ctx)
        self.record("fetch", c.index)

    def _evict(self, c: Chunk) -> None:
        if c.state is ChunkState.FETCHING:  # a prefetch: its copy is waited for on the host first
            c.end_fetch(self.ctx, wait_on_host=True)
        c.release(in_pass=self._in_pass)
        self.record("evict", c.index)

    def release_all(self) -> None:
        """Free every streamed chunk's device buffer (idle only)."""
        self.wait_all()
        for c in self.streamed:
            if c.state in (ChunkState.FETCHING, ChunkState.RESIDENT):
                self._evict(c)

    # ----- gradients ----------------------------------------------------------------------
    def _offload(self, c: Chunk, *, final: bool) -> None:
        """Send the chunk's gradients to host memory and hand the chunk to the CPU worker;
        ``final``: no more of them come in this pass (at a boundary the worker may update it)."""
        self.usage.reduced(c)
        at_boundary = final and self.boundary
        finish = self.finisher(c) if at_boundary else None
        during = at_boundary and self.policy.during_backward
        update = (self.hps, self.optim.selected(c), self.policy.landing_clip) if during else None
        worker = self.worker
        c.begin_offload(self.ctx, applied=update is not None,
                        landing_for=lambda replace: worker.landing_buffer(c, replace=replace),
                        submit=lambda event, landing, replace: worker.submit(worker.land_and_update, c, event, landing,
                                                                             replace, finish, update))
        self.record("offload", c.index)
        if not self.ctx.asynchronous:
            c.end_offload(self.ctx, in_pass=self._in_pass)

    # ----- passes -------------------------------------------------------------------------
    @contextmanager
    def backward_pass(self, *, boundary: bool, loss: Tensor | None = None):
        """One ``engine.backward`` of ``loss``; ``boundary``: a step follows (not inside ``no_sync``)."""
        with self.phase.entered(TrainingPhase.BACKWARD, leaving=TrainingPhase.IDLE,
                                error="engine.backward() was called while another backward is running."):
            self.boundary, self.passes = boundary, self.passes + 1
            self.hps = self.optim.snapshot()
            self._in_pass = True  # (the chain, current and deferred chunks are empty: reset by every pass)
            self._received = False
            self._after_step.clear()  # from here on, zero_grad waits for every job in flight
            ended = False
            try:
                self.usage.begin(loss)  # W processes: the ranks' losses reach the same parameters
                yield
                ended = True
                self.stepped_backward = boundary and self._received  # (torch.autograd.grad of inputs: no gradient)
            finally:
                try:
                    # A backward that raised ends without the reductions: with several processes
                    # a collective on a failure path meets a rank that has left.
                    if ended or self.sharding.whole:
                        if not ended:  # (its gradients land unapplied, as torch leaves them)
                            self.failed, self.boundary = True, False
                        self._finish_backward()
                        if not ended:
                            _warn_updated([c.index for c in self.streamed if c.applied], len(self.streamed))
                    else:
                        self.sharding.hold_collectives(None)  # its verdict is not waited for
                finally:
                    for c in self.chunks:
                        c.end_pass()
                    self._chain, self.current, self._deferred = [], set(), set()
                    self.settle()
        self.check()

    def _finish_backward(self) -> None:
        self.sharding.check_held()  # (a backward that reached no chunk collective)
        for c in self.chunks:
            if not c.receiving:
                continue
            if c.persistent:  # its gradients of this pass into its accumulator (W processes: reduce-scattered)
                self.usage.reduced(c)
                c.land(self.ctx)
            else:  # some of its parameters got no gradient in this pass
                self._offload(c, final=True)
        for c in self.chunks:
            if c.persistent and not c.storage.fmt.whole:
                c.await_reduction(self.ctx)  # the reduce-scatters ran beside backward

    def copies_pending(self, event) -> None:
        """Copies into host tensors are in flight until ``event`` (a non-blocking offload of the
        states): ``wait_all`` waits for them."""
        self._host_copies = event

    def settle(self) -> None:
        """The pass is over: parameters at placeholders point at rest ([Note: a pass's placeholders])."""
        self._in_pass = False
        for c in self.streamed:
            c.settle()

    def wait_all(self) -> None:
        """Wait for the copies and updates in flight; the states are then readable (the
        parameters at rest too: ``settle``)."""
        if self.phase.phase not in (TrainingPhase.BACKWARD, TrainingPhase.RECOMPUTE):
            self.settle()
        if self._host_copies is not None:
            event, self._host_copies = self._host_copies, None
            self.ctx.synchronize(event)
        for c in self.streamed:
            self.await_chunk(c)

    def step(self, hps, clip: UpdateClip, chunks: list[Chunk]) -> None:
        """Update every chunk of ``chunks`` that has gradients and was not updated during backward,
        clipped by ``clip``: the streamed ones on the CPU worker in forward order (waited for where
        updates run during backward, else overlapping the next forward), then the persistent ones."""
        self.wait_all()
        pending = [c for c in chunks if not c.applied and c.has_gradients]
        # The coefficient's copy to the host (a host wait on CUDA) only when a streamed chunk needs it.
        host_clip = None
        if any(not c.persistent for c in pending):
            host_clip = clip if clip.coef is None else UpdateClip(self.ctx.to_host(clip.coef), clip.value)
        self._after_step.clear()
        for c in pending:
            c.apply()
            if not c.persistent:
                if c.state in (ChunkState.FETCHING, ChunkState.RESIDENT):  # (a prefetch at the end of backward)
                    self._evict(c)  # its device copy would be stale after the update
                job = (hps, self.optim.selected(c), host_clip)
                c.begin_update(lambda c=c, job=job: self.worker.submit(self.worker.update, c, *job))
                self._after_step.add(c.index)
        device_clip = clip.on(self.ctx.device)
        for c in pending:
            if c.persistent:
                c.adopt_rebound()
                with traced("ProTrain::device_adam"), torch.no_grad():
                    self.optim.update(c, hps, self.optim.selected(c), device_clip)
                if not c.storage.fmt.whole:
                    c.gather_updated(self.ctx)  # every rank's updated piece, beside the next updates
        for c in pending:
            if c.persistent and not c.storage.fmt.whole:
                c.await_reduction(self.ctx)  # before the next forward reads the chunk
        if self.policy.during_backward:
            self.wait_all()
        self.finish_step()

    def finish_step(self) -> None:
        self.stepped_backward = self.failed = False
        for c in self.chunks:
            c.finish_step()

    def zero_grad(self, chunks: list[Chunk]) -> None:
        """Clear the gradients of ``chunks``; updates handed out by step() go on. Refused, before
        anything changes, where an update in backward already used them."""
        for c in chunks:
            if c.applied and c.has_gradients and not self.failed:
                raise _cleared_after_update(next(m.name for i, m in enumerate(c.spec.members) if c.has_grad(i)))
        for c in self.streamed:
            if c.state is ChunkState.OFFLOADING:
                c.end_offload(self.ctx, in_pass=self._in_pass)
            if c.state is ChunkState.UPDATING and c.index not in self._after_step:
                c.end_update()
        self.stepped_backward = self.failed = False
        for c in chunks:
            c.zero()

    def clear_grads(self, members: list[tuple[Chunk, int]]) -> bool:
        """``p.grad = None`` of these members (or a submodule's ``zero_grad()``), once their chunks'
        offloads and updates end; refused, before anything changes, as ``zero_grad`` is. True when
        no gradient is left: as after ``zero_grad``, the next backward starts the step afresh."""
        for c, i in members:
            if c.applied and not self.failed:
                raise _cleared_after_update(c.spec.members[i].name)
        for c in {id(c): c for c, _ in members}.values():
            self.await_chunk(c)
        for c, i in members:
            c.clear_grad(i)
        if any(c.has_gradients for c in self.chunks):
            return False
        self.stepped_backward = self.failed = False
        return True

    def reconfigure(self, n_buffer: int) -> None:
        """The streamed chunks (all idle) and the plan's ``n_buffer`` (at most one per streamed
        chunk), when built and after a re-plan moved chunks between the device and the host."""
        self.streamed = [c for c in self.chunks if not c.persistent]
        assert not any(c.device_resident for c in self.streamed)
        n_buffer = min(n_buffer, len(self.streamed))
        self.buffers = BufferPolicy(n_buffer)  # which chunk gives its device buffer up
        staging = max((c.storage.fmt.state_numel for c in self.streamed), default=0)
        self.worker.resize_staging(n_staging=n_buffer, staging_numel=staging)

    def check(self) -> None:
        if self.check_invariants:
            assert_invariants(self)

    def record(self, what: str, index: int) -> None:
        counter = _COUNTED.get(what)
        if counter is not None:
            self.stats[counter] += 1
        if self.record_events:
            self.events.append((what, index, self.ctx.clock()))
        timeline = self.ctx.timeline  # read once: the worker thread records too
        if timeline is not None:
            timeline.event(what, index)


def device_bytes_bound(scheduler: Scheduler) -> int:
    """What the plan lets the model states hold on the device: the persistent chunks, plus
    ``n_buffer`` buffers of the largest streamed chunk."""
    persistent = sum(c.storage.fmt.persistent_device_bytes for c in scheduler.chunks if c.persistent)
    per_buffer = max((c.storage.fmt.buffer_device_bytes for c in scheduler.streamed), default=0)
    return persistent + scheduler.buffers.n_buffer * per_buffer


def assert_invariants(scheduler: Scheduler) -> None:
    """The residency invariants (``RuntimeConfig.check_invariants``): at most ``n_buffer``
    streamed chunks hold device memory, only those that are resident, every parameter points
    where its chunk's state says, and the device bytes are within the plan's bound."""
    n_buffer = scheduler.buffers.n_buffer
    resident = [c for c in scheduler.streamed if c.device_resident]
    assert len(resident) <= n_buffer, f"{len(resident)} chunks resident > n_buffer={n_buffer}"
    for c in scheduler.streamed:
        storage = c.storage
        assert storage.device_copy_allocated == c.device_resident, c
        assert c.device_resident or storage.grad_buffer is None, f"{c} holds device memory"
        home = storage.device_copy if c.state is ChunkState.RESIDENT else None
        if c.at_placeholders:  # released inside a pass: NaN of the device copy's device and dtype
            assert c.state is not ChunkState.RESIDENT, c
            assert all(p.device == storage.device_copy.device and p.stride() == (0,) * p.dim()
                       for p in c.params), f"{c}: placeholders"
        elif not c.device_resident and storage.fmt.whole and storage.frozen is None:  # else some point at NaN
            home = storage.host_copy
        if home is not None:
            for p in c.params:
                assert p.untyped_storage().data_ptr() == home.untyped_storage().data_ptr(), f"{c}: stale .data"
    device = sum(c.storage.device_bytes() for c in scheduler.chunks)
    assert device <= device_bytes_bound(scheduler), "device bytes above the plan's bound"


def _warn_updated(updated: list[int], streamed: int) -> None:
    if updated:
        warnings.warn(
            f"A backward raised after ProTrain had updated {len(updated)} of its {streamed} offloaded chunks "
            f"({updated[:8]}) with this step's gradients (the CPU update overlaps backward); those updates stay. "
            "engine.step() now applies the other gradients that arrived, as torch's step would; zero_grad() skips "
            "the rest of the step, where in plain PyTorch the failed backward changed no weight. To be able to skip "
            "a failed batch exactly, call engine.clipping.expect_late() before training (every update waits for "
            "step()), or reload the last checkpoint.", RuntimeWarning, stacklevel=2)


def _cleared_after_update(name: str) -> RuntimeError:
    return RuntimeError(
        f"The gradient of {name} was cleared (zero_grad(), p.grad = None) between backward and step, but ProTrain "
        "had already updated its (offloaded) chunk during backward with it: a step skipped so would be taken for "
        "the offloaded chunks only. Clear gradients after the step; or, to clear them (or skip a step) between "
        "backward and step, say so before training: engine.clipping.expect_late() (with gradient accumulators, "
        "the default), which holds every update until step().")
