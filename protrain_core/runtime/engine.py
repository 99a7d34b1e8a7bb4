"""The engine: a model's parameters and optimizer states in ProTrain chunks, and the training
API (forward through ``engine.module``, then ``backward``, ``step``, ``zero_grad``).

``protrain_core.wrap`` (api.py) builds one from a model, an optimizer and a plan; the profiler
builds one that never steps (``EngineOptions(optimizer_states=False)``) and drives it through
the same public methods: ``set_block_modes``, ``on_recompute``, ``autocast``, ``device_bytes``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from protrain_core.phase import PhaseTracker, TrainingPhase
from protrain_core.plan import BlockMode, Plan, as_plan, check_plan, describe_modes
from protrain_core.precision import LossScaler, Precision
from protrain_core.runtime.activations import ActivationManager, BlockActivations
from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.device import DeviceContext, as_context
from protrain_core.runtime.gradients import StepGradients
from protrain_core.runtime.hooks import RuntimeHooks
from protrain_core.runtime.optim import ChunkOptimizer
from protrain_core.runtime.options import EngineOptions
from protrain_core.runtime.scheduler import Scheduler, UpdatePolicy
from protrain_core.runtime.sharding import Sharding, broadcast_module
from protrain_core.runtime.storage import ChunkFormat, ChunkStorage, chunk_formats
from protrain_core.runtime.timeline import Timeline
from protrain_core.structure.blocks import block_modules
from protrain_core.structure.layout import ChunkLayout, unit_chunks
from protrain_core.update import ClipAlgorithm, GradientClipping, Overlap, overlap_mode, parse_gradient_clipping
from protrain_ops import onepass


class Engine:
    """Runs a wrapped model: forward through ``engine.module``, then backward, step, zero_grad."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, layout: ChunkLayout, plan: Plan,
                 precision: Precision, device: torch.device | DeviceContext, options: EngineOptions | None = None,
                 sharding: Sharding | None = None) -> None:
        """``device``: a torch device, or a DeviceContext (a simulated device: protrain_core/simulator).
        ``sharding``: the processes the chunks are sharded over (``Sharding.resolve``; None:
        one process). Every rank builds its engine alike, with the same plan."""
        check_plan(plan, layout.limits())
        options = options or EngineOptions()
        self.ctx = as_context(device)
        device = self.ctx.device
        if sharding is not None:
            sharding.check_device(device)
        self.sharding = sharding
        self.module, self.optimizer, self.layout, self.plan = module, optimizer, layout, plan
        self.precision, self.device, self.options = precision, device, options
        self.optimizer_states = options.optimizer_states
        self.phase = PhaseTracker()
        self.scaler = LossScaler() if precision is Precision.FP16_MIXED else None
        self._optim = ChunkOptimizer(optimizer, one_pass_kernel=options.runtime.one_pass_kernel)
        if self._optim.one_pass_kernel and precision in (Precision.BF16_MIXED, Precision.FP16_MIXED) \
                and self._optim.kind is None:
            onepass.kernel()  # built (once per machine) and checked now, not in the first backward
        self._no_sync = False
        self._manual = False  # Lightning manual optimization (set_manual_optimization)
        self._closed = False
        self._autocast_depth = 0
        self.chunks = self._allocate(chunk_formats(module, optimizer, layout, precision,
                                                   optimizer_states=options.optimizer_states,
                                                   world_size=self.world_size))
        self._slot_of: dict[int, tuple[Chunk, int]] = {id(p): (c, i) for c in self.chunks for i, p in enumerate(c.params)}
        n_buffer = min(plan.n_buffer, len(self.chunks) - plan.n_persist)
        self.grads = StepGradients(self._optim, self.scaler, self.chunks, self.ctx)
        self.scheduler = Scheduler(self.chunks, self.ctx, self._optim, self.phase, n_buffer=n_buffer,
                                   switches=options.runtime, finisher=self.grads.finisher)
        self._set_update_mode()
        self.hooks = self._runtime_hooks()
        self.activations: ActivationManager | None = None
        self._recompute_observers: OrderedDict[int, object] = OrderedDict()  # RemovableHandle needs a weakref-able dict
        self._step_observers: OrderedDict[int, object] = OrderedDict()
        self._batch_begun = False  # begin_batch ran for the micro-batch now running
        self._batch_hook = module.register_forward_pre_hook(self._on_module_call, with_kwargs=True, prepend=True)
        self.set_block_modes(plan.block_modes(layout.n_blocks))
        self._autocast_handles = self._register_autocast() if precision.is_mixed else []
        if optimizer.state and options.optimizer_states:
            # The optimizer already stepped: carry its state into the chunks.
            osd = optimizer.state_dict()
            optimizer.state.clear()
            self.load_optimizer_state_dict(osd)
        # model.state_dict() (save_pretrained, torch.save) reads the parameters: wait for their updates.
        # Every module's: a LightningModule's self.model.state_dict() does not run the root's hooks.
        self._state_dict_hooks = [m.register_state_dict_pre_hook(self._before_module_state_dict)
                                  for m in module.modules()]
        self._managed = {id(m) for m in module.modules()}
        self._step_hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._in_step = False  # engine.step() runs the optimizer's own step (its hooks, LR schedulers)
        self._reading_states = False  # Engine.state_dict is reading the module's
        module._protrain_engine = self
        self.profile = None  # the Profile a searched plan came from (set by wrap)
        self.choice = None  # the search's PlanChoice (set by wrap)

    # ----- construction -------------------------------------------------------------------
    def _allocate(self, formats: list[ChunkFormat]) -> list[Chunk]:
        """Chunk storages (a streamed one in an exact-size host buffer of its own) holding the
        parameters' values; the parameters then point into them."""
        n_persist, dev = self.plan.n_persist, self.device
        streamed = [fmt for i, fmt in enumerate(formats) if i >= n_persist]
        host_bytes = sum(fmt.streamed_host_bytes for fmt in streamed)
        # A CPU "device" is host memory too.
        device_bytes = 0 if dev.type != "cpu" else sum(fmt.persistent_device_bytes for fmt in formats[:n_persist])
        self.ctx.check_host_memory(host_bytes + device_bytes, "offloaded model states")
        params = dict(self.module.named_parameters())
        if self.sharding is not None:  # every rank starts from rank 0's values, as DDP does
            broadcast_module(self.module, self.sharding, dev)
        chunks, pin = [], self.options.runtime.pins(self.ctx)
        for spec, fmt in zip(self.layout.chunks, formats):
            members = [params[m.name] for m in spec.members]
            storage = ChunkStorage(fmt, persistent=spec.index < n_persist, device=dev, pin=pin,
                                   n_members=len(members), sharding=self.sharding, host=self.ctx.host)
            opt_members = self._optim.members_by_group(members) if self.optimizer_states else {}
            chunk = Chunk(spec, params=members, storage=storage, opt_members=opt_members)
            chunk.load_params()
            chunks.append(chunk)
        for b in self.module.buffers():
            # bf16-true runs the module as model.to(torch.bfloat16) would: floating buffers too.
            low = self.precision is Precision.BF16_TRUE and b.is_floating_point()
            b.data = b.data.to(dev, dtype=self.precision.compute_dtype if low else b.dtype)
        return chunks

    def _runtime_hooks(self) -> RuntimeHooks:
        """The runtime's hooks on every unit (they act for units with a streamed chunk: which
        those are changes with ``replan``), and on every trainable parameter."""
        return RuntimeHooks(self.scheduler, unit_chunks(self.module, self.layout), self.chunks)

    def replan(self, plan: Plan | dict) -> None:
        """Run with ``plan`` from the next step on, keeping every state (weights, gradients not yet
        cleared, Adam states, the loss scaler): chunks move between the device and the host,
        the buffers and the blocks' activation modes change. Call it between steps. Chunks leave
        the device before others join it, so the device never holds more model states than the
        larger of the two plans does, and no chunk is ever in two places for longer than its move."""
        plan = as_plan(plan)
        check_plan(plan, self.layout.limits())
        self._check_open()
        if self.phase.phase is not TrainingPhase.IDLE or any(c.applied or c.receiving for c in self.chunks):
            raise RuntimeError("engine.replan() was called within a step; call it after engine.step().")
        self.scheduler.wait_all()
        self.scheduler.release_all()
        old, new = self.plan.n_persist, plan.n_persist
        leaving = self.chunks[new:old]
        self.ctx.check_host_memory(sum(c.storage.fmt.streamed_host_bytes for c in leaving), "offloaded model states")
        for c in leaving:
            c.unpersist()
        for c in self.chunks[old:new]:
            c.persist()
        self.plan = plan
        self.scheduler.reconfigure(min(plan.n_buffer, len(self.chunks) - new))
        self.set_block_modes(plan.block_modes(self.layout.n_blocks))

    def set_block_modes(self, modes: tuple[BlockMode, ...]) -> None:
        """Manage the blocks' activations with these modes (replacing the current ones; the
        profiler times its engine's blocks both checkpointed and swapped)."""
        if self.activations is not None:
            self.activations.remove()
        blocks = block_modules(self.module, self.layout.block_path)
        self.block_modes = modes
        self.activations = ActivationManager(blocks, modes, self.ctx, self.phase, observers=self._recompute_observers,
                                             warn_on_cache=self.options.warn_on_cache)
        static = [t for c in self.chunks for t in c.storage.static_tensors()]
        self.activations.install(static + list(self.module.buffers()))

    def on_recompute(self, observer) -> RemovableHandle:
        """``observer(block_index, begin)`` when a checkpointed block's recomputation begins and
        ends (the profiler's timeline); it stays across ``set_block_modes``."""
        handle = RemovableHandle(self._recompute_observers)
        self._recompute_observers[handle.id] = observer
        return handle

    def observe(self, observer) -> RemovableHandle:
        """``observer`` hears of the training steps through whichever of these methods it has:
        ``batch_begins(batch)`` before a training micro-batch's forward (``begin_batch``),
        ``backward_begins()`` and ``backward_ends()`` around every ``backward``, ``step_ends()``
        after every ``step``, ``engine_closes()``. All but the last come when no forward or
        backward is running, so the observer may ``replan``. The live profiler and planner use
        this; ``remove()`` on the handle stops it."""
        handle = RemovableHandle(self._step_observers)
        self._step_observers[handle.id] = observer
        return handle

    def _notify(self, event: str, *args) -> None:
        for observer in list(self._step_observers.values()):
            callback = getattr(observer, event, None)
            if callback is not None:
                callback(*args)

    def begin_batch(self, batch) -> None:
        """A training micro-batch (its inputs: a tensor, or a collection of them) is about to run.
        Observers may re-plan for its shape, or refuse it, before anything of it runs. The
        module's own forward pre-hook calls this (when gradients are enabled); an adapter that
        runs a step without calling the module itself (the Trainer's ``training_step``) calls it
        first. Once per micro-batch: later calls before its backward are ignored."""
        self._adopt_rebound()
        self._begin_batch(batch)

    def _begin_batch(self, batch) -> None:
        if self._batch_begun or self._closed or self.phase.phase is not TrainingPhase.IDLE:
            return
        self._notify("batch_begins", batch)
        self._batch_begun = True

    def _on_module_call(self, module, args, kwargs) -> None:
        if module is not self.module:  # a deep copy of the model
            return
        self._adopt_rebound()  # every forward, evaluation too
        if torch.is_grad_enabled():
            self._begin_batch((args, kwargs))

    def _adopt_rebound(self) -> None:
        """Parameters whose ``.data`` the user rebound between steps (``p.data = tensor``, as
        Lightning's ModelPruning resets weights) keep the new values: before the next forward
        and before every state dict, they are written into their chunks (after the updates in
        flight) and pointed back at them. In-place writes land in the chunks by themselves."""
        if self._closed or self.phase.phase is not TrainingPhase.IDLE:
            return
        rebound = [(c, members) for c in self.chunks if (members := c.rebound())]
        if not rebound:
            return
        self.scheduler.wait_all()
        for c, members in rebound:
            c.adopt(members)

    @contextmanager
    def autocast(self):
        """Autocast for the mixed modes -- the one place that enters it: the engine's own forward
        hooks on ``engine.module`` and the Lightning adapters' step contexts both use this, and
        an enclosing use makes an inner one a no-op."""
        device_type = self.ctx.autocast_device_type
        if self.precision.autocast_dtype is None or self._autocast_depth or device_type is None:
            yield
            return
        self._autocast_depth += 1
        try:
            with torch.autocast(device_type, dtype=self.precision.autocast_dtype):
                yield
        finally:
            self._autocast_depth -= 1

    def _register_autocast(self):
        stack = []

        def enter(module, _args):
            if module is not self.module:  # a deep copy of the model
                return
            context = self.autocast()
            context.__enter__()
            stack.append(context)

        def leave(module, _args, _output):
            if module is not self.module:
                return
            stack.pop().__exit__(None, None, None)

        return [
            self.module.register_forward_pre_hook(enter),
            self.module.register_forward_hook(leave, always_call=True),
        ]

    # ----- training -----------------------------------------------------------------------
    def backward(self, loss: Tensor, run=None) -> None:
        """Backward through the managed model; streamed chunks are updated while it runs, or
        their gradients are finished for an update at step() (see ``overlap``). ``run(loss)``:
        what starts autograd instead of ``loss.backward()`` (an overridden
        ``LightningModule.backward``), given the loss as scaled for fp16."""
        self._check_open()
        if not self._no_sync:
            self._check_trains("backward() outside no_sync()")
        self._set_update_mode()
        self.scheduler.check_usage(loss)  # W processes: the ranks' losses reach the same parameters
        self._notify("backward_begins")
        try:
            with self.scheduler.backward_pass(boundary=not self._no_sync), self.activations.backward_pass():
                if self.scaler is not None:
                    loss = loss * self.scaler.scale.to(loss.device)
                loss.backward() if run is None else run(loss)
        finally:
            self._batch_begun = False
            self._notify("backward_ends")

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients (non-final micro-batches)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self) -> None:
        """Returns when every parameter holds this step's final value -- except, when the CPU
        Adam overlaps the next forward (``overlap``), the offloaded chunks' parameters: their
        next use in forward, ``wait_for_updates`` and every state dict wait for their update."""
        self._check_open()
        self._check_trains("step()")
        with self.phase.entered(TrainingPhase.STEP, leaving=TrainingPhase.IDLE,
                                error="engine.step() was called during backward."):
            hps = self._optim.snapshot()
            if any(c.applied for c in self.chunks) and hps != self.scheduler.hps:
                raise RuntimeError(
                    "The optimizer's hyper-parameters changed between engine.backward() and "
                    "engine.step(), but ProTrain already applied the backward-time values to the "
                    "offloaded chunks. Change lr (e.g. scheduler.step()) after engine.step()."
                )
            if self.grads.needs_finishing():
                self.scheduler.wait_all()  # every gradient is in its accumulator, none was used yet
                self.grads.finish_all()
            clip, runs = self.grads.step_clip()
            if runs:
                self.scheduler.step(hps, clip, wait=self.scheduler.policy.during_backward)
            else:
                self.scheduler.finish_step()  # fp16 overflow: the step is skipped
            self.grads.end_step()
        # Runs the optimizer's step hooks and LR-scheduler bookkeeping. No parameter holds a
        # .grad (the engine keeps gradients in chunks), so torch's update loop skips them all.
        self._in_step = True
        try:
            self.optimizer.step()
        finally:
            self._in_step = False
        self._batch_begun = False
        self._notify("step_ends")

    @contextmanager
    def record_timeline(self) -> Iterator[Timeline]:
        """Record what runs when in the steps taken inside: compute phases, chunk uploads and
        gradient offloads, activation swaps, collectives and each chunk's CPU Adam
        ([Note: the step timeline] in runtime/timeline.py). On exit every update has ended and
        the timeline's ``spans`` are complete. Recording changes nothing that is computed."""
        self._check_open()
        if self.ctx.timeline is not None:
            raise RuntimeError("engine.record_timeline() is already recording; record one timeline at a time.")
        timeline = Timeline(self.ctx)
        self.scheduler.set_timeline(timeline)
        handle = self.observe(timeline)
        try:
            yield timeline
            self.scheduler.wait_all()
        finally:
            handle.remove()
            self.scheduler.set_timeline(None)
        timeline.finish()  # only after a recording that ended well: an error propagates as it was

    def wait_for_updates(self) -> None:
        """Return when every chunk's update is over (see ``step``): before reading parameters
        directly between ``step()`` and the next forward."""
        self._check_open()
        self.scheduler.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_open()
        self.scheduler.zero_grad()
        self.grads.discard()

    # ----- update configuration -------------------------------------------------------------
    def set_gradient_clipping(self, algorithm: str | None, value: float | None = None, norm_type: float = 2.0) -> None:
        """Clip the gradients before every update exactly as plain PyTorch would with
        ``torch.nn.utils.clip_grad_norm_(params, value, norm_type)`` ("norm") or
        ``clip_grad_value_(params, value)`` ("value") over the optimizer's parameters, on the
        gradients Adam reads (fp32 in mixed precision, after fp16 unscaling); None turns it off.

        "value" is elementwise: each chunk is clamped right before its own Adam, so streamed
        chunks are still updated during backward. "norm" needs the global norm before any
        update: the gradients' norms are taken as they land and the streamed chunks' Adam runs
        after backward, overlapping the next forward (``overlap`` says so); ``last_grad_norm``
        holds the total norm before clipping. Call it between steps; setting the current value
        again is a no-op at any time. To clip between backward and step instead, see
        ``clip_grad_norm_``.
        """
        self._check_open()
        clipping = parse_gradient_clipping(algorithm, value, norm_type)
        if clipping == self.grads.configured:
            return
        if self.phase.phase is not TrainingPhase.IDLE:
            raise RuntimeError("engine.set_gradient_clipping() was called during backward; call it between steps.")
        if any(c.applied for c in self.chunks):
            raise RuntimeError(
                "Gradient clipping changed between engine.backward() and engine.step(), but ProTrain "
                "already updated offloaded chunks during backward with the previous setting. Change "
                "it after engine.step(), before the next backward."
            )
        self.scheduler.wait_all()  # no update in flight reads the setting
        self.grads.set_policy(dataclasses.replace(self.grads.policy, configured=clipping))
        self._set_update_mode()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, called between
        ``backward`` and ``step`` (what ``fabric.clip_gradients`` and Lightning's
        ``configure_gradient_clipping`` do): returns the total norm before clipping; ``step()``
        applies the clipping. Exact when no chunk was updated during this backward: the engine
        holds the updates of its first step, and of every step after one that clipped late
        ([Note: finishing gradients early] in gradients.py). With clipping configured ahead
        (``set_gradient_clipping``), the same setting only returns the norm."""
        clipping = self._late_request("norm", max_norm, norm_type)
        total = self.grads.late_norm(clipping)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total {norm_type:g}-norm of the gradients is non-finite ({total.item()}), so it cannot be "
                "clipped (clip_grad_norm_ with error_if_nonfinite=True). Pass error_if_nonfinite=False to scale "
                "the gradients by it anyway (under fp16 the step is then skipped by the loss scaler)."
            )
        self.grads.accept(clipping)
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` over the optimizer's parameters, between
        ``backward`` and ``step`` (see ``clip_grad_norm_``)."""
        self.grads.accept(self._late_request("value", clip_value))

    def _late_request(self, algorithm: str, value, norm_type: float = 2.0) -> GradientClipping:
        clipping = parse_gradient_clipping(algorithm, value, norm_type)
        self._check_step_gradients(f"engine.clip_grad_{algorithm}_()")
        self.grads.check_request(clipping, updated_in_backward=any(c.applied for c in self.chunks))
        self.scheduler.wait_all()  # every gradient in its accumulator
        self.grads.finish_all()
        return clipping

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The total norm of the gradients over the optimizer's parameters, between ``backward``
        and ``step`` (as ``torch.nn.utils.get_total_norm`` of their ``.grad``; after fp16
        unscaling), without clipping anything. When streamed chunks are updated during backward
        it waits for those updates (the gradients stay in the chunks until ``zero_grad``)."""
        parse_gradient_clipping("norm", 1.0, norm_type)
        self._check_step_gradients("engine.grad_norm()")
        clip = self.grads.configured
        if clip is not None and clip.algorithm is ClipAlgorithm.VALUE and any(c.applied for c in self.chunks):
            raise RuntimeError(
                "engine.grad_norm() is the norm before clipping, but with clipping by value configured ahead "
                "the offloaded chunks' gradients were clamped when they were updated during backward. Request "
                "the clipping between backward and step instead (engine.clip_grad_value_) to measure it first."
            )
        self.scheduler.wait_all()
        self.grads.finish_all()
        return self.grads.total_norm(norm_type)

    def set_manual_optimization(self, enabled: bool = True) -> None:
        """Lightning's manual optimization: every backward runs inside no_sync and the user's
        ``opt.step()`` ends the step, so the step's gradients are complete after any backward
        (clipping and norms are allowed then); otherwise only after a backward outside no_sync."""
        self._manual = enabled

    @property
    def step_gradients_ready(self) -> bool:
        """The step's gradients are complete and not used yet: after a backward outside
        no_sync, or under manual optimization after backwards inside it (nothing was updated
        during them), before ``step()``."""
        if self.phase.phase is not TrainingPhase.IDLE:
            return False
        accumulated = (self._manual and any(c.has_gradients for c in self.chunks)
                       and not any(c.applied for c in self.chunks))
        return self.scheduler.stepped_backward or accumulated

    def _check_step_gradients(self, what: str) -> None:
        self._check_open()
        if not self.step_gradients_ready:
            raise RuntimeError(
                f"{what} reads the step's gradients: call it after engine.backward() of the step's last "
                "micro-batch (outside no_sync) and before engine.step()."
            )

    def expect_late_clipping(self, expected: bool = True, norm_type: float = 2.0) -> None:
        """Say whether gradient clipping will be requested between backward and step
        (``clip_grad_norm_``). True: possibly at any step, not every one: every step's updates
        wait for step() (the ``norm_type`` norms are taken as gradients land). False: never: no
        step is held for it (a late request is then refused). Not called: the first step is held,
        and every step after one that clipped late."""
        parse_gradient_clipping("norm", 1.0, norm_type)
        self.grads.set_policy(dataclasses.replace(self.grads.policy, expect_late=norm_type if expected else None,
                                                  hold_first=expected))
        self._set_update_mode()

    @property
    def gradient_clipping(self) -> GradientClipping | None:
        """The clipping configured ahead (``set_gradient_clipping``)."""
        return self.grads.configured

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The total norm before clipping of the last step clipped by norm (or of the last
        ``clip_grad_norm_`` call)."""
        return self.grads.last_norm

    def _overlap(self, *, steady: bool = False) -> Overlap:
        return overlap_mode(self.precision, self.grads.configured, late_clipping=self.grads.late_reason(steady=steady))

    def _set_update_mode(self) -> None:
        self.scheduler.set_policy(UpdatePolicy(during_backward=self._overlap().during_backward,
                                               landing_clip=self.grads.landing_clip()))

    def steady_overlap(self) -> Overlap:
        """The schedule after the first step (what plans are searched for)."""
        return self._overlap(steady=True)

    @property
    def overlap(self) -> str:
        """When the CPU Adam runs now, e.g. "cpu-adam-during-backward" (see update.py)."""
        return str(self._overlap())

    # ----- state --------------------------------------------------------------------------
    def _before_module_state_dict(self, module: torch.nn.Module, *_) -> None:
        """``state_dict()`` of the model or of any module in it (torch.save, save_pretrained,
        an EMA callback's ``self.model.state_dict()``) reads the parameters: wait for their
        updates. Sharded over several processes an offloaded chunk's parameters are not whole on
        any rank: refused, with the fix, for every module holding one."""
        if id(module) not in self._managed:  # a deep copy's module: its own tensors
            return
        if self.sharding is not None and not self._reading_states and any(
                not self._slot_of[id(p)][0].persistent for p in module.parameters() if id(p) in self._slot_of):
            name = "model" if module is self.module else f"{type(module).__name__} (a module of the wrapped model)"
            raise RuntimeError(
                f"state_dict() of the {name}, sharded over {self.world_size} processes: the parameters of "
                "offloaded chunks are not whole on any rank, so its values would be wrong. Call "
                "engine.state_dict() (gathered chunk by chunk to rank 0; under Lightning "
                "trainer.strategy.engine.state_dict()) or engine.save_pretrained(directory) on every rank instead."
            )
        if not self._reading_states:
            self._adopt_rebound()
        self.scheduler.wait_all()

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """``optimizer.step()`` by the user instead of ``engine.step()``: refused with the fix."""
        if not self._in_step:
            _refuse_optimizer_step(optimizer)

    def slot_of(self, p: torch.nn.Parameter) -> tuple[Chunk, int]:
        """The chunk holding parameter ``p``, and its member index there."""
        return self._slot_of[id(p)]

    @property
    def world_size(self) -> int:
        """Processes the chunks are sharded over (1: not sharded)."""
        return 1 if self.sharding is None else self.sharding.world

    @property
    def rank(self) -> int:
        return 0 if self.sharding is None else self.sharding.rank

    def state_dict(self, *, rank0_only: bool = True) -> dict[str, Tensor]:
        """Master weights (fp32; bf16 in bf16-true) and buffers under the model's own names, on
        the CPU. Frozen parameters are kept in the compute dtype (rounded once, at wrap, in the
        mixed modes) and returned in the master dtype. Sharded over ``W`` processes, every rank
        calls it: the chunks are gathered one at a time, and (``rank0_only``) only rank 0 keeps
        the result -- the other ranks get an empty dict, and no rank ever holds more than its
        own states, one gathered chunk and (rank 0) the result. A tensor under several names (tied
        weights) is one tensor under each, as in ``module.state_dict()``: saved once."""
        self._adopt_rebound()
        self.scheduler.wait_all()
        keep = not rank0_only or self.rank == 0
        out, seen = {}, {}
        gathered: tuple[Chunk | None, list] = (None, [])  # the last chunk's whole values
        for key, t in self._module_tensors().items():
            if id(t) in seen:
                if keep:
                    out[key] = seen[id(t)]
                continue
            slot = self._slot_of.get(id(t))
            if slot is None:
                value = t.detach().to("cpu", copy=True) if keep else None
            else:
                chunk, i = slot
                if gathered[0] is not chunk:
                    gathered = chunk, chunk.gathered_values()
                # a frozen member's compute copy is returned in the master dtype too
                value = gathered[1][i].detach().to("cpu", dtype=self.precision.master_dtype, copy=True) if keep else None
            seen[id(t)] = value  # on every rank: the gathers must be the same everywhere
            if keep:
                out[key] = value
        return out

    def _module_tensors(self) -> dict[str, Tensor]:
        """The module's own state-dict entries (parameters and buffers as they are: keep_vars)."""
        self._reading_states = True
        try:
            return self.module.state_dict(keep_vars=True)
        finally:
            self._reading_states = False

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        self._check_open()
        expected = self._module_tensors()
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for key, value in state_dict.items():
            if key in expected and tuple(value.shape) != tuple(expected[key].shape):
                raise ValueError(f"load_state_dict: {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
        self.scheduler.release_all()
        with torch.no_grad():
            for key, value in state_dict.items():
                t = expected.get(key)
                if t is None:
                    continue
                slot = self._slot_of.get(id(t))
                if slot is None:
                    t.copy_(value)
                else:
                    slot[0].set_member(slot[1], value)

    def optimizer_state_dict(self, *, rank0_only: bool = True) -> dict:
        """The optimizer state in ``torch.optim.AdamW.state_dict()`` format, on the CPU (sharded:
        gathered chunk by chunk, kept by rank 0 only unless ``rank0_only`` is False)."""
        self.scheduler.wait_all()
        return self._optim.state_dict(self._slot_of, keep=not rank0_only or self.rank == 0)

    @property
    def chunk_optimizer(self) -> ChunkOptimizer:
        """Where the chunks' optimizer states are named and kept (the sharded checkpoint's view)."""
        return self._optim

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self._check_open()
        self.scheduler.wait_all()
        self._optim.load_state_dict(state_dict, self._slot_of)

    def scaler_state_dict(self) -> dict | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_scaler_state_dict(self, state_dict: dict) -> None:
        if self.scaler is None:
            raise ValueError("This engine does not use loss scaling (precision is not '16-mixed').")
        self.scaler.load_state_dict(state_dict)

    # ----- inspection ---------------------------------------------------------------------
    def activation_report(self) -> tuple[BlockActivations, ...]:
        """Per block: mode and activation bytes (saved, inputs, on the device, in host memory),
        from the last forward pass with gradients. Kept blocks are measured in the first such
        forward and after ``measure_activations()``."""
        return self.activations.report()

    def measure_activations(self) -> None:
        """Measure the kept blocks' saved activations in the next forward pass with gradients."""
        self.activations.measure_next_forward()

    def device_bytes(self) -> int:
        """Device memory held by model states right now (persistent chunks + chunk buffers)."""
        return self.scheduler.device_bytes()

    def host_bytes(self) -> int:
        """Host memory of the streamed chunks' model states (their exact-size buffers)."""
        return sum(c.storage.host_bytes for c in self.chunks)

    @property
    def host_pinned(self) -> bool:
        """The streamed chunks' host buffers are page-locked (CUDA), so copies run asynchronously."""
        streamed = [c for c in self.chunks if not c.persistent]
        return bool(streamed) and all(c.storage.host_pinned for c in streamed)

    def explain(self) -> str:
        """Why this plan: predicted step time by phase, memory breakdown, bottleneck
        (for a searched plan; an explicit plan is reported as given)."""
        if self.choice is None:
            text = (f"ProTrain plan: {self.plan} (given explicitly; without a plan, wrap "
                    "profiles the model and searches the fastest plan that fits config.planning.memory_budget)")
        else:
            text = self.choice.explain()
        return text if self.grads.configured is None else f"{text}\n{self._clipping_line()}"

    def _clipping_line(self) -> str:
        clip = self.grads.configured
        if clip is None:
            return "gradient clipping: off" + (" (requested after backward)" if self.grads.late_seen else "")
        if clip.algorithm is ClipAlgorithm.VALUE:
            return (f"gradient clipping by value ({clip.value:g}): elementwise, per chunk before its Adam; "
                    "the CPU Adam still overlaps backward")
        line = (f"gradient clipping by norm (max_norm {clip.value:g}, {clip.norm_type:g}-norm): the norms are "
                "taken as gradients land, and the CPU Adam of offloaded chunks runs after backward, overlapping "
                "the next forward")
        steady = self.steady_overlap().schedule
        if self.choice is not None and self.choice.schedule is not steady:
            line += (f"; this plan was searched for {self.choice.schedule.value}: ProTrainConfig(clipping={{'algorithm': "
                     f"'norm', ...}}) searches for {steady.value}")
        return line

    def summary(self) -> str:
        mib = 2**20
        return "\n".join(
            [
                f"ProTrain engine: {self.plan}, precision={self.precision.value}, device={self.device}",
                f"optimizer: {type(self.optimizer).__name__} per chunk; overlap: {self.overlap}",
                f"CPU worker: {self._worker_line()}",
                self._clipping_line(),
                f"activations per block: {describe_modes(self.block_modes)}",
                f"device model-state bytes now {self.device_bytes() / mib:.2f} MiB "
                f"(bound {self.scheduler.device_bytes_bound() / mib:.2f} MiB); "
                f"host {self.host_bytes() / mib:.2f} MiB ({'pinned' if self.host_pinned else 'pageable'})",
                self.layout.summary(self.precision.compute_dtype.itemsize, self.plan.n_persist),
            ]
        )

    def _worker_line(self) -> str:
        worker = self.scheduler.worker
        line = worker.threads_why if worker.threads is None else \
            f"{worker.threads} thread{'s' if worker.threads > 1 else ''} ({worker.threads_why})"
        if self.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED) and self._optim.kind is None:
            status = onepass.status() if self._optim.one_pass_kernel else "separate passes (one_pass_kernel=False)"
            line += f"; updates of streamed chunks: {status}"
        return line

    # ----- life ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, after_failure: bool = False) -> None:
        """Remove the hooks and stop the worker. The parameters keep their current values, as
        views of the master weights (on the device for persistent chunks, else host).
        ``after_failure``: the run ends with an exception (a Lightning strategy's teardown after
        ``on_exception``); nothing is waited for -- an update or collective in flight may wait
        for a rank that will not come -- and no observer runs: the values are what they are."""
        if self._closed:
            return
        if not after_failure:
            self._notify("engine_closes")
            self._adopt_rebound()
            self.scheduler.wait_all()
            self.scheduler.release_all()
            for c in self.chunks:
                c.detach_params()  # sharded: gathered, a collective per chunk
        self.hooks.remove()
        self.activations.remove()
        for h in self._autocast_handles:
            h.remove()
        self._batch_hook.remove()
        for h in self._state_dict_hooks:
            h.remove()
        self._step_hook.remove()
        self.scheduler.shutdown(wait=not after_failure)
        self.module._protrain_engine = None
        self._closed = True

    def __deepcopy__(self, memo) -> Engine:
        """The engine is not a value: it owns the device, pinned memory, a worker thread and the
        process group. A deep copy of the model (an EMA, Lightning's weight averaging) copies
        its hooks, which refer to the engine: they get this engine, and ignore the copy's
        modules, so the copy is a plain module with the weights of the moment."""
        memo[id(self)] = self
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This ProTrain engine was closed.")

    def _check_trains(self, what: str) -> None:
        if not self.optimizer_states:
            raise RuntimeError(
                f"{what} on an evaluation-only ProTrain engine (wrap(optimizer_states=False)): it holds no optimizer "
                "states. Wrap with optimizer_states=True to train."
            )


def _refuse_optimizer_step(optimizer) -> None:
    """The optimizer's own step would find no gradients (they are in the chunks) and do nothing."""
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() was called on the optimizer of a ProTrain engine; it would update "
        "nothing: the gradients and Adam's states live in the engine's chunks. Call engine.step() (and "
        "engine.zero_grad()) instead; under Lightning or Fabric, optimizer.step() through them does that."
    )
