"""The engine: a model's parameters and optimizer states in ProTrain chunks, and the training
API (forward through ``engine.module``, then ``backward``, ``step``, ``zero_grad``).

``protrain_core.wrap`` (api.py) builds one from a model, an optimizer and a plan; the profiler
builds one that never steps (``ProTrainConfig(optimizer_states=False)``) and drives it through
the same public methods and parts: ``set_block_modes``, ``on_recompute``, ``autocast``,
``memory.device_bytes``.

[Note: several optimizers]
An engine trains with several optimizers over disjoint parameters (a GAN's generator and
discriminator) as torch does: each ``step()`` updates only its own parameters, with the
gradients accumulated for them since its ``zero_grad``. ``wrap`` builds one optimizer over all
(``joint_optimizer``), which the chunks' states, the planner and the profiler see, and a layout
in which no chunk holds two optimizers' parameters (``build_layout(owners=)``). No backward knows
which optimizer steps next, so every backward only accumulates (as manual's); ``step(optimizer)``
updates that optimizer's chunks and runs its own ``step`` for its hooks and schedulers, and
``zero_grad(optimizer=)`` clears its chunks; ``p.grad`` reads gradients across steps until they
are cleared. A forward's graph may outlive a step (the DCGAN recipe): until its backward begins
the chunks stay where it found them (``RuntimeHooks.backward_awaited``). Clipping, loss scaling,
moments other than fp32 and ``grad_accumulator=False`` are refused: each spans one step of every
trainable parameter, or is not tested with several yet.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from protrain_core.config import ProTrainConfig
from protrain_core.phase import Observers, RecomputeObserver, StepObserver, StepState, TrainingPhase
from protrain_core.plan import BlockMode, Plan, as_plan, check_plan, describe_modes
from protrain_core.precision import LossScaler, Precision
from protrain_core.runtime.activations import ActivationManager
from protrain_core.runtime.backward import BackwardPasses, check_trains
from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.clipping import Clipping
from protrain_core.runtime.compiled import compile_units
from protrain_core.runtime.device import DeviceContext, as_context, cpu_worker_placement
from protrain_core.runtime.frozen_formats import frozen_places
from protrain_core.runtime.gradients import StepGradients
from protrain_core.runtime.hooks import ManagedParameter, RuntimeHooks, refuse_compiled, refuse_pickling
from protrain_core.runtime.optim import ChunkOptimizer, parameter_owners
from protrain_core.runtime.parking import OffloadedStates, check_between_steps, check_onloaded, offload, onload
from protrain_core.runtime.scheduler import Scheduler
from protrain_core.runtime.sharding import ONE_PROCESS, Sharding, broadcast_tensors
from protrain_core.runtime.states import IncompatibleKeys, StateAccess, StateMemory
from protrain_core.runtime.state_formats import check_layout_for, check_optimizer_for
from protrain_core.runtime.storage import ChunkStorage, chunk_formats
from protrain_core.runtime.timeline import Timeline
from protrain_core.runtime.weights import Weights
from protrain_core.structure.blocks import block_modules
from protrain_core.structure.layout import ChunkLayout, unit_chunks
from protrain_core.utils import has_meta
from protrain_ops import onepass


class RuntimeEngine:
    """Runs a wrapped model: forward through ``engine.module``, then backward, step, zero_grad
    (``protrain_core.Engine``, what ``wrap`` returns, adds the verbs that write files).

    Its parts, each with a small public face: ``engine.clipping`` (gradient clipping and norms),
    ``engine.states`` (model, optimizer and loss-scaler states), ``engine.memory`` (where the
    model states are), ``engine.activations`` (the blocks' activation modes and their report)
    and ``engine.step_state`` (where training stands: phase.py)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, layout: ChunkLayout, plan: Plan,
                 precision: Precision, device: torch.device | DeviceContext, config: ProTrainConfig | None = None,
                 sharding: Sharding = ONE_PROCESS, *, warn_on_cache: bool = True, optimizers: tuple = ()) -> None:
        """The ``module`` and ``optimizer`` in the chunks of ``layout`` and ``plan``, at ``precision``
        with ``config``; ``device``: a torch device, or a DeviceContext (a simulated device);
        ``sharding``: the processes the chunks are sharded over (one process: the group of one);
        ``warn_on_cache``: warn when checkpointed or swapped blocks turn a key/value cache off;
        ``optimizers``: several over disjoint parameters, whose ``joint_optimizer`` is ``optimizer``."""
        check_plan(plan, layout.limits())
        config = config or ProTrainConfig()
        self.ctx, self.sharding = as_context(device), sharding
        sharding.check_device(self.ctx.device)
        self.world_size, self.rank = sharding.world, sharding.rank
        self.module, self.optimizer, self.layout, self.plan = module, optimizer, layout, plan
        self._optim = ChunkOptimizer(optimizer, one_pass_kernel=config.runtime.one_pass_kernel, optimizers=optimizers)
        self.optimizers = self._optim.optimizers
        self.precision, self.device, self.config = precision, self.ctx.device, config
        self._warn_on_cache = warn_on_cache  # (off for the profiler's all-checkpointed engine)
        self.optimizer_states = config.optimizer_states
        self.step_state = StepState()
        self.step_state.set_manual(len(self.optimizers) > 1)  # several: every backward only accumulates
        self._autocast_depth = 0
        self.scaler = LossScaler() if precision is Precision.FP16_MIXED else None
        _check_formats(self, self._optim)
        placement = cpu_worker_placement(self.ctx, self.world_size, config.runtime.worker_cores)
        self.chunks = _allocate(self, self._optim, touch=None if placement is None else placement.touch)
        self.grads = StepGradients(self._optim, self.scaler, self.chunks, self.ctx, sharding)
        self.scheduler = Scheduler(self.chunks, self.ctx, self._optim, self.step_state, sharding,
                                   n_buffer=plan.n_buffer, switches=config.runtime, finisher=self.grads.finisher,
                                   placement=placement)
        self.stats = self.scheduler.stats  # counts of the runtime's events: uploads, offloads, updates
        self.clipping = Clipping(self.grads, self.scheduler, self.chunks, precision, self.step_state)
        self._owned = _owned_chunks(self.chunks, self.optimizers)
        self.states = StateAccess(module, self.chunks, self._optim, self.scaler, self.scheduler, self.step_state,
                                  precision=precision, rank=self.rank, world_size=self.world_size)
        self.memory = StateMemory(self.chunks, self.scheduler)
        self._step_observers = Observers(StepObserver)
        self._passes = BackwardPasses(grads=self.grads, clipping=self.clipping, scheduler=self.scheduler,
                                      observers=self._step_observers, trains=config.optimizer_states)
        self.hooks = RuntimeHooks(self.scheduler, unit_chunks(module, layout),
                                  onloaded=lambda: self.offloaded is None, grad_of=self.clipping.grad_of,
                                  clear_grads=self.clipping.clear_grads, on_backward=self._passes.hook)
        self.compiled = compile_units(module, layout, config.compile)  # (before set_block_modes)
        self.activations: ActivationManager | None = None
        self._recompute_observers = Observers(RecomputeObserver)  # they stay across set_block_modes
        self._handles = [module.register_forward_pre_hook(self._on_module_call, with_kwargs=True, prepend=True),
                         *[o.register_step_pre_hook(self._before_optimizer_step) for o in self.optimizers],
                         *([_ZeroGradRoute(self, o, module) for o in (*self.optimizers, *module.modules())]
                           if config.optimizer_states else []),
                         *(_autocast_hooks(self) if precision.is_mixed else [])]
        self.set_block_modes(plan.block_modes(layout.n_blocks))
        _carry_optimizer_states(self)  # (the optimizer's own state: before the route below)
        if config.optimizer_states:
            self._handles += [h for o in self.optimizers for h in _optimizer_state_route(self, o)]
        module._protrain_engine = self
        self.offloaded: OffloadedStates | None = None  # offload_states() moved the states to the host
        self.profile = self.choice = None  # the Profile and the search's PlanChoice of a searched plan (set by wrap)

    def replan(self, plan: Plan | dict) -> None:
        """Run with ``plan`` from the next step on, keeping every state; call it between steps.
        Chunks leave the device before others join it, so the device never holds more model
        states than the larger of the two plans does."""
        plan = as_plan(plan)
        check_plan(plan, self.layout.limits())
        check_between_steps(self, "engine.replan()")
        check_onloaded(self, "engine.replan()")
        self.scheduler.release_all()  # (it waits for every copy and update first)
        new = plan.persistent()
        leaving = [c for c in self.chunks if c.persistent and c.index not in new]
        self.ctx.check_host_memory(sum(c.storage.fmt.streamed_host_bytes for c in leaving), "offloaded model states")
        for c in leaving:
            c.unpersist()
        for c in self.chunks:
            if not c.persistent and c.index in new:
                c.persist()
        self.plan = plan
        self.scheduler.reconfigure(plan.n_buffer)
        self.set_block_modes(plan.block_modes(self.layout.n_blocks))

    def set_block_modes(self, modes: tuple[BlockMode, ...]) -> None:
        """Manage the blocks' activations with these ``modes`` (replacing the current ones)."""
        if self.activations is not None:
            self.activations.remove()
        blocks = block_modules(self.module, self.layout.block_path)
        self.block_modes = modes
        self.activations = ActivationManager(blocks, modes, self.ctx, self.step_state,
                                             observers=self._recompute_observers,
                                             warn_on_cache=self._warn_on_cache, on_recompute=self._passes.begins)
        self._passes.set_activations(self.activations)
        static = [t for c in self.chunks for t in (c.storage.device_copy, c.storage.host_copy, c.storage.master)]
        self.activations.install([t for t in static if t is not None] + list(self.module.buffers()))  # model states

    def on_recompute(self, observer: RecomputeObserver) -> RemovableHandle:
        """``observer(block_index, begin)`` when a checkpointed block's recomputation begins and
        ends; it stays across ``set_block_modes``."""
        return self._recompute_observers.add(observer)

    def observe(self, observer: StepObserver) -> RemovableHandle:
        """``observer`` hears of the training steps (``protrain_core.StepObserver``: before a
        micro-batch's forward, around every ``backward``, after every ``step``, and when the
        engine closes); ``remove()`` on the handle stops it."""
        return self._step_observers.add(observer)

    def begin_batch(self, batch) -> None:
        """A training micro-batch (``batch``: its inputs) is about to run: observers may re-plan for
        its shape, or refuse it. The module's forward pre-hook calls this; an adapter that runs a
        step without calling the module calls it first. Later calls before its backward are ignored."""
        check_onloaded(self, "A training step")
        changed = self.states.trainables_changed()  # (the chunks hold states for the parameters that trained then)
        if changed is not None:
            raise RuntimeError(
                f"Since this ProTrain engine was built, {changed}; its chunks keep fp32 masters, gradients and "
                "optimizer states only for the parameters that trained then. Wrap anew between the steps, keeping "
                "the optimizer state: osd = engine.states.optimizer(); engine.close(); optimizer.load_state_dict(osd); "
                "engine = protrain_core.wrap(model, optimizer, ...). (The Trainer and Fabric strategies do this "
                "themselves.)")
        self.states.adopt_rebound()
        if self.step_state.awaiting_batch:
            self._step_observers.notify(lambda o: o.batch_begins(batch))
            self.step_state.batch_began()

    @contextmanager
    def autocast(self):
        """Autocast for the mixed modes -- the one place that enters it (the engine's forward hooks
        and the Lightning adapters' step contexts); an enclosing use makes an inner one a no-op."""
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

    # ----- training -----------------------------------------------------------------------
    def backward(self, loss: Tensor, run=None) -> None:
        """Backward through the managed model; streamed chunks are updated while it runs, or
        their gradients are finished for an update at step() (see ``overlap``). ``run(loss)``:
        what starts autograd instead of ``loss.backward()`` (an overridden ``LightningModule.backward``),
        given the loss as scaled for fp16 ([Note: loss.backward()] in backward.py)."""
        self._passes.run(loss, run)

    def no_sync(self):
        """Backward passes inside only accumulate gradients (non-final micro-batches)."""
        return self.step_state.accumulating()

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Returns when every parameter holds this step's final value (except, when the CPU Adam
        overlaps the next forward, the offloaded chunks': their next use waits for their update).
        ``optimizer``: with several optimizers, the one whose parameters to update (None: all)."""
        self._passes.ready()
        stepped, chunks = self._chunks_of(optimizer)
        check_trains(self.optimizer_states, "step()")
        check_onloaded(self, "engine.step()")
        if self.grads.consumed:
            self.scheduler.wait_all()  # every landing done: a chunk's own accumulator is where it is kept
            self.grads.check_consumed(backward=False)
        with self.step_state.entered(TrainingPhase.STEP, leaving=TrainingPhase.IDLE,
                                     error="engine.step() was called during backward."):
            self.grads.take_changes()  # gradients changed through p.grad
            hps = self._optim.snapshot()
            if any(c.applied for c in self.chunks) and hps != self.scheduler.hps:
                raise RuntimeError(
                    "The optimizer's hyper-parameters changed between engine.backward() and "
                    "engine.step(), but ProTrain already applied the backward-time values to the "
                    "offloaded chunks. Change lr (e.g. scheduler.step()) after engine.step()."
                )
            if self.grads.needs_finishing():
                self.scheduler.wait_all()  # every gradient is in its accumulator, none was used yet
                self.grads.finish_all(chunks)
            clip, runs = self.grads.step_clip()
            if runs:
                self.scheduler.step(hps, clip, chunks)
            else:
                self.scheduler.finish_step()  # fp16 overflow: the step is skipped
            self.grads.end_step()
        # The optimizer's step hooks and LR-scheduler bookkeeping; no parameter holds a .grad.
        with self.step_state.in_optimizer_step(), torch._C.DisableTorchFunctionSubclass():
            for o in stepped:
                o.step()
        self.step_state.micro_batch_ended()
        self._step_observers.notify(lambda o: o.step_ends())

    @contextmanager
    def record_timeline(self) -> Iterator[Timeline]:
        """Record what runs when in the steps taken inside ([Note: the step timeline] in
        runtime/timeline.py); on exit the timeline's ``spans`` are complete."""
        self.step_state.check_open()
        if self.ctx.timeline is not None:
            raise RuntimeError("engine.record_timeline() is already recording; record one timeline at a time.")
        timeline = Timeline(self.ctx, threaded=self.scheduler.worker.threaded)
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
        """Return when every chunk's update is over (see ``step``)."""
        self.step_state.check_open()
        self.scheduler.wait_all()

    def offload_states(self, *, non_blocking: bool = False) -> OffloadedStates:
        """Move every byte of the training state this engine holds on the device to the host
        ([Note: parking] in runtime/parking.py). Between steps only; the model cannot run until
        ``onload_states()``, but the state dicts can be read. ``non_blocking``: return while the
        copies run (the handle's ``wait()`` ends them). Offloaded again: the same handle."""
        if self.offloaded is None:
            check_between_steps(self, "engine.offload_states()")
            self.offloaded = offload(self)
        if not non_blocking:
            self.offloaded.wait()
        return self.offloaded

    def onload_states(self) -> None:
        """Back to the device what ``offload_states`` moved; training continues exactly as if it
        had stayed there. With several processes every rank calls it (a collective)."""
        self.step_state.check_open()
        if self.offloaded is None:
            return
        onload(self, self.offloaded)
        self.offloaded = None
        self.set_block_modes(self.block_modes)  # the buffers' and chunks' device tensors are new

    def zero_grad(self, set_to_none: bool = True, optimizer: torch.optim.Optimizer | None = None, *,
                  module: nn.Module | None = None) -> None:
        """Clear the gradients (``set_to_none`` as torch's: either way none is kept) of
        ``optimizer``'s parameters (None: all), or of ``module``'s only (its own ``zero_grad()``)."""
        self._passes.ready()
        if module is not None:
            self.clipping.clear_grads([p.protrain_use[1:] for p in module.parameters()
                                       if isinstance(p, ManagedParameter)])
            return
        self.scheduler.zero_grad(self._chunks_of(optimizer)[1])
        self.grads.discard()

    @property
    def overlap(self) -> str:
        """When the CPU Adam runs now, e.g. "cpu-adam-during-backward" (see update.py)."""
        return str(self.clipping.overlap())

    # ----- state --------------------------------------------------------------------------
    def state_dict(self, *, rank0_only: bool = True) -> dict[str, Tensor]:
        """The model's master weights and buffers on the CPU: ``engine.states.model``."""
        return self.states.model(rank0_only=rank0_only)

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> IncompatibleKeys:
        """``engine.states.load_model``: as ``nn.Module.load_state_dict`` (its return value and errors)."""
        return self.states.load_model(state_dict, strict)

    # ----- inspection ---------------------------------------------------------------------
    def explain(self) -> str:
        """Why this plan: predicted step time by phase, memory breakdown, bottleneck."""
        if self.choice is None:
            text = (f"ProTrain plan: {self.plan} (given explicitly; without a plan, wrap "
                    "profiles the model and searches the fastest plan that fits config.planning.memory_budget)")
        else:
            text = self.choice.explain()
        return text if self.clipping.configured is None else f"{text}\n{self.clipping.describe(self.choice)}"

    def summary(self) -> str:
        return "\n".join([
            f"ProTrain engine: {self.plan}, precision={self.precision.value}, device={self.device}",
            f"optimizer: {type(self.optimizer).__name__} per chunk, moments {self.config.optimizer_state_format}"
            f"{'' if self.config.frozen_dtype is None else ', frozen weights ' + self.config.frozen_dtype}"
            f"{'' if self.config.keeps_accumulators else ', no gradient accumulators on the host'}; "
            f"overlap: {self.overlap}",
            f"CPU worker: {self.scheduler.worker.describe()}{_update_kernel(self)}",
            self.clipping.describe(self.choice),
            f"activations per block: {describe_modes(self.block_modes)}",
            "compiled: no" if self.compiled is None else self.compiled.describe(),
            self.memory.describe(),
            self.layout.summary(self.precision.compute_dtype.itemsize, self.plan.persistent()),
        ])

    # ----- life ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.step_state.closed

    def close(self, *, after_failure: bool = False) -> None:
        """Remove the hooks and stop the worker; the parameters keep their current values, as
        views of the master weights. The optimizer's states stay with the engine (its own
        ``state`` is empty): take ``states.optimizer()`` first to go on in plain PyTorch (Lightning's
        teardown does so). ``after_failure``: the run ends with an exception: nothing
        is waited for (a collective in flight may wait for a rank that will not come), and no
        observer runs."""
        if self.step_state.closed:
            return
        if not after_failure:
            self._step_observers.notify(lambda o: o.engine_closes())
            self.states.adopt_rebound()
            self.scheduler.release_all()
            for c in self.chunks:
                c.detach_params()  # sharded: gathered, a collective per chunk
        self.hooks.remove()
        self.activations.remove()
        if self.compiled is not None:
            self.compiled.remove()
        for h in self._handles:
            h.remove()
        self.states.remove_hooks()
        self.scheduler.worker.shutdown(wait=not after_failure)
        if self.ctx.blocks is not None:  # (a block still read by a collective in flight keeps itself alive)
            self.ctx.blocks.clear()
        self.module._protrain_engine = None
        self.step_state.close()

    __reduce_ex__ = refuse_pickling

    def __deepcopy__(self, memo) -> RuntimeEngine:
        """The engine is not a value: a deep copy of the model (an EMA) copies its hooks, which get
        this engine and ignore the copy's modules (a plain module with the weights of the moment)."""
        memo[id(self)] = self
        return self

    def _on_module_call(self, module, args, kwargs) -> None:
        if module is not self.module:  # a deep copy of the model
            return
        self._passes.ready()
        refuse_compiled()
        check_onloaded(self, "The model's forward")
        if torch.is_grad_enabled():
            self.begin_batch((args, kwargs))
        else:
            self.states.adopt_rebound()  # every forward, evaluation too

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """``optimizer.step()`` by the user instead of ``engine.step()``: refused with the fix."""
        if not self.step_state.optimizer_step:  # (it would find no gradients: they are in the chunks)
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called on the optimizer of a ProTrain engine; it would update "
                "nothing: the gradients and Adam's states live in the engine's chunks. Call engine.step() (and "
                "engine.zero_grad()) instead; under Lightning or Fabric, optimizer.step() through them does that "
                "(in a LightningModule, step what self.optimizers() returns, not use_pl_optimizer=False's)."
            )

    def _chunks_of(self, optimizer) -> tuple[tuple, list[Chunk]]:
        """The engine's optimizers that ``optimizer`` names (None, ``engine.optimizer`` or the only
        one: all; a wrapper such as Lightning's: the one it wraps) and the chunks they update."""
        if optimizer is None or optimizer is self.optimizer or len(self.optimizers) == 1:
            return self.optimizers, self.chunks
        own = next((o for o in self.optimizers if o is optimizer or o is getattr(optimizer, "optimizer", None)), None)
        if own is None:
            raise ValueError(f"This {type(optimizer).__name__} is not an optimizer of this ProTrain engine: step and "
                             "zero_grad the optimizers given to wrap().")
        return (own,), self._owned[id(own)]


class _ZeroGradRoute:
    """``zero_grad()`` of one of the engine's optimizers (its chunks), of its module (every chunk)
    or of a submodule (``netD.zero_grad()``: its members) also clears the gradients the engine
    keeps in its chunks, until ``remove()``.

    [Note: routing zero_grad]
    This sets an instance attribute on the user's object (its class is untouched; ``remove``
    deletes it): no public seam sees a ``zero_grad`` (torch.optim and ``nn.Module`` have no hook
    for it), and users override ``LightningModule.optimizer_zero_grad``. An instance attribute
    follows every way the user's code calls it (Lightning's optimizer wrapper is routed to it:
    lightning_protrain/strategy.py); a deep copy's is left to the class's own ``zero_grad``."""

    def __init__(self, engine: RuntimeEngine, owner: torch.optim.Optimizer | nn.Module, model: nn.Module) -> None:
        self.owner = owner
        self.own = owner.__dict__.get("zero_grad")  # one the object had on itself already: called, then put back
        original = owner.zero_grad  # (that one, or the class's)
        optimizer = None if isinstance(owner, nn.Module) else owner  # the model's: every chunk
        part = owner if isinstance(owner, nn.Module) and owner is not model else None  # a submodule's: its members

        def zero_grad(this, *args, **kwargs) -> None:  # (the caller's arguments passed on as they came)
            if this is not owner:  # a deep copy's
                return type(this).zero_grad(this, *args, **kwargs)
            # (first: then p.grad of its parameters reads None, sharded too; a module's call inside a
            # pass or a step leaves the chunks alone, as torch's leaves a running backward's)
            if not engine.closed and (optimizer is not None or engine.step_state.idle):
                engine.zero_grad(kwargs.get("set_to_none", args[0] if args else True), optimizer, module=part)
            return original(*args, **kwargs)

        self.routed = owner.zero_grad = types.MethodType(zero_grad, owner)

    def remove(self) -> None:
        if self.owner.__dict__.get("zero_grad") is self.routed:
            if self.own is None:
                del self.owner.__dict__["zero_grad"]
            else:
                self.owner.__dict__["zero_grad"] = self.own
        self.routed = None  # (it holds the engine: no cycle keeps a closed engine alive)


def _check_formats(engine: RuntimeEngine, optim: ChunkOptimizer) -> None:
    """The optimizer and layout suit the state formats; the one-pass kernel is built now, not in
    the first backward."""
    config = engine.config
    adam = optim.elementwise is None
    if optim.one_pass_kernel and adam and (engine.precision.is_mixed or config.optimizer_state_format == "8bit"):
        onepass.kernel()
    check_optimizer_for(config.optimizer_state_format, engine.optimizer, adam=adam)
    if config.optimizer_states:
        check_layout_for(config.optimizer_state_format, engine.layout)


def _optimizer_state_route(engine: RuntimeEngine, optimizer: torch.optim.Optimizer) -> list[RemovableHandle]:
    """``optimizer.state_dict()`` and ``optimizer.load_state_dict()`` read and write the states in
    the engine's chunks (the optimizer's own ``state`` stays empty while the engine is open), as
    ``engine.states.optimizer(of=optimizer)`` and ``load_optimizer`` do: a user's own save and
    resume keep Adam's state, as under plain PyTorch. Sharded over several processes the state is
    spread over them and gathering it needs every rank, so the read is refused with the fix."""
    def read(o, state_dict):
        if o is not optimizer:  # a deep copy's: its own
            return None
        if not engine.sharding.whole:
            raise RuntimeError(
                f"{type(o).__name__}.state_dict() of a ProTrain engine sharded over {engine.world_size} processes: "
                "Adam's states are spread over the processes. Call engine.states.optimizer(of=optimizer) on every "
                "rank (rank 0 receives the whole state), or save a checkpoint with the engine (save_sharded).")
        return engine.states.optimizer(of=o)

    def load(o, state_dict):
        if o is not optimizer:
            return None
        engine.states.load_optimizer(state_dict, of=o)
        return {"state": {}, "param_groups": state_dict["param_groups"]}  # (torch's own load: the groups alone)

    return [optimizer.register_state_dict_post_hook(read), optimizer.register_load_state_dict_pre_hook(load)]


def _carry_optimizer_states(engine: RuntimeEngine) -> None:
    """An optimizer that already stepped: its state into the chunks (its own is cleared)."""
    for optimizer in engine.optimizers if engine.optimizer_states else ():
        if optimizer.state:
            osd = optimizer.state_dict()
            optimizer.state.clear()
            engine.states.load_optimizer(osd, of=optimizer)


def _owned_chunks(chunks: list[Chunk], optimizers: tuple) -> dict[int, list[Chunk]]:
    """id(optimizer) -> the chunks holding its parameters (with several, none shares a chunk
    with another: the layout's ``owners``)."""
    owner = parameter_owners(optimizers)
    return {id(o): [c for c in chunks if any(owner.get(id(p)) == k for p in c.params)]
            for k, o in enumerate(optimizers)}


def _allocate(engine: RuntimeEngine, optim: ChunkOptimizer, *, touch=None) -> list[Chunk]:
    """Chunks holding the parameters' values (the parameters then point into them). ``touch(t)``:
    zeroes a new pageable host region where the CPU worker runs ([Note: CPU worker placement])."""
    persistent, dev, ctx, config = engine.plan.persistent(), engine.device, engine.ctx, engine.config
    formats = chunk_formats(engine.module, engine.optimizer, engine.layout, engine.precision, config,
                            world_size=engine.world_size)
    host_bytes = sum(fmt.streamed_host_bytes for i, fmt in enumerate(formats) if i not in persistent)
    # A CPU "device" is host memory too.
    device_bytes = 0 if dev.type != "cpu" else sum(formats[i].persistent_device_bytes for i in persistent)
    ctx.check_host_memory(host_bytes + device_bytes, "offloaded model states")
    params = dict(engine.module.named_parameters())
    # A model on the meta device takes its values chunk by chunk ([Note: weights straight into chunks]).
    weights = Weights(engine.module, config.weights, ctx.host) if ctx.host.type != "meta" and has_meta(
        engine.module) else None
    chunks, pin = [], config.runtime.pins(ctx)
    for spec, fmt in zip(engine.layout.chunks, formats):
        members = [params[m.name] for m in spec.members]
        if weights is not None:
            weights.fill([(m.name, params[m.name]) for m in spec.members])
        broadcast_tensors(members, engine.sharding, dev)  # every rank starts from rank 0's values, as DDP does
        frozen = frozen_places(spec.members, fmt.frozen_format, (engine.rank * fmt.frozen_shard, fmt.frozen_shard))
        storage = ChunkStorage(fmt, persistent=spec.index in persistent, ctx=ctx, pin=pin, n_members=len(members),
                               sharding=engine.sharding, frozen=frozen, touch=touch)
        opt_members = optim.members_by_group(members) if engine.optimizer_states else {}
        chunk = Chunk(spec, params=members, storage=storage, opt_members=opt_members)
        chunk.adopt()  # the parameters' values in, pointed at the chunk
        chunks.append(chunk)
    if weights is not None:
        weights.fill_buffers()
        weights.warn_initialised()
    broadcast_tensors(list(engine.module.buffers()), engine.sharding, dev)
    low = engine.precision.compute_dtype if engine.precision is Precision.BF16_TRUE else None
    for b in engine.module.buffers():
        # bf16-true runs the module as model.to(torch.bfloat16) would: floating buffers too.
        b.data = b.data.to(dev, dtype=low if low is not None and b.is_floating_point() else b.dtype)
    # What model.to would move besides: the state a parameterless submodule's own _apply moves
    # (a torchmetrics Metric's).
    for m in _without_parameters(engine.module):
        m.to(dev, dtype=low)
    return chunks


def _without_parameters(module: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``module`` that hold no parameter."""
    if next(module.parameters(), None) is None:
        return [module]
    return [m for child in module.children() for m in _without_parameters(child)]


def _autocast_hooks(engine: RuntimeEngine) -> list[RemovableHandle]:
    """The module's forward runs inside ``engine.autocast()`` (not a deep copy's)."""
    stack = []

    def enter(module, _args):
        if module is engine.module:
            context = engine.autocast()
            context.__enter__()
            stack.append(context)

    def leave(module, _args, _output):
        if module is engine.module:
            stack.pop().__exit__(None, None, None)

    return [engine.module.register_forward_pre_hook(enter),
            engine.module.register_forward_hook(leave, always_call=True)]


def _update_kernel(engine: RuntimeEngine) -> str:
    """How the CPU updates streamed chunks in the mixed modes with the fused AdamW path."""
    optim = engine.states.chunk_optimizer
    if not engine.precision.is_mixed or optim.elementwise is not None:
        return ""
    return "; updates of streamed chunks: " + (onepass.status() if optim.one_pass_kernel
                                                else "separate passes (one_pass_kernel=False)")

