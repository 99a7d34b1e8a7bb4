"""The public engine: ``protrain_core.wrap(model, optimizer, plan=...)``."""

from __future__ import annotations

import dataclasses

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from protrain_core.activations import (
    ActivationManager,
    BlockActivations,
    BlockMode,
    check_activation_plan,
    describe_modes,
    interleaved_modes,
)
from protrain_core.blocks import find_blocks
from protrain_core.chunk import Chunk
from protrain_core.device import DeviceContext, resolve_device
from protrain_core.host_pool import HostPool, available_host_bytes, check_host_memory, should_pin
from protrain_core.layout import ChunkLayout, build_layout, unit_chunks, with_persistence
from protrain_core.optim import ChunkOptimizer, ClipAlgorithm, GradientClipping, check_optimizer, parse_gradient_clipping
from protrain_core.plan import Plan
from protrain_core.profiles import Profile
from protrain_core.profiler import profile_model
from protrain_core.precision import LossScaler, Precision, parse_precision
from protrain_core.runtime import Phase, Runtime
from protrain_core.search import PlanChoice, search
from protrain_core.utils import parse_bytes


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | dict | None = None,
    *,
    memory_budget: int | float | str | None = None,
    precision: str = "32-true",
    device: torch.device | str | None = None,
    blocks: nn.ModuleList | str | None = None,
    chunk_size: int | None = None,
    example_inputs=None,
    loss_fn=None,
    step_fn=None,
    gradient_clipping: tuple[str, float] | None = None,
    profile_cache: bool = True,
    reprofile: bool = False,
    optimizer_states: bool = True,
    check_invariants: bool = False,
) -> Engine:
    """Put ``model``'s parameters and ``optimizer``'s states into ProTrain chunks.

    Args:
        model: the module to train; its parameters may be on the CPU or on ``device``.
        optimizer: a ``torch.optim.AdamW`` or ``Adam`` over (some of) the model's parameters.
        plan: a :class:`Plan` (or dict of its fields): chunks kept on the device, chunk
            buffers, and how many transformer blocks swap or checkpoint their activations.
            None (the default) profiles one iteration on ``example_inputs`` and picks the plan
            with the least predicted step time that fits ``memory_budget``
            (``engine.explain()`` says why).
        memory_budget: device memory the plan may use (plan=None only): bytes, or a string such
            as "20GiB" or "500MB". Default: see ``default_memory_budget``.
        precision: "32-true", "bf16-mixed", "16-mixed" or "bf16-true".
        device: the compute device; None means CUDA when available, else the CPU.
        blocks: the transformer blocks (ModuleList or dotted name) when discovery fails.
        chunk_size: chunk size in elements; None runs the waste-minimising grid search.
        example_inputs: one batch (dict of keyword arguments, tuple or tensor). It traces the
            execution order on the meta device (Hugging Face models need none for that) and,
            with plan=None, is what the profiler runs -- a real batch of the real shape.
        loss_fn: ``loss_fn(output) -> scalar`` for profiling; default ``output.loss``.
        step_fn: ``step_fn(module, example_inputs) -> loss`` (or ``(loss, kept_alive)``) for profiling, instead of calling
            the module and ``loss_fn`` (e.g. a LightningModule's ``training_step``).
        gradient_clipping: ``("norm", max_norm)`` or ``("value", clip_value)``, applied to the
            gradients before every update exactly as ``torch.nn.utils.clip_grad_norm_`` /
            ``clip_grad_value_`` would (see ``Engine.set_gradient_clipping``).
        profile_cache: reuse a profile cached on disk for the same model, batch shape,
            precision and hardware (``protrain_core.profiles.cache_dir()``).
        reprofile: profile again even when a cached profile exists.
        optimizer_states: False builds an engine for evaluation only (a plan must be given):
            no optimizer states are allocated, and ``backward`` outside ``no_sync`` and
            ``step`` raise.
        check_invariants: check residency and device-byte invariants at every hook (tests).
    """
    # Everything that can be wrong with the arguments is checked before memory is touched.
    prec = parse_precision(precision)
    dev = resolve_device(device)
    if gradient_clipping is not None:
        parse_gradient_clipping(*gradient_clipping)
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    if plan is not None and not isinstance(plan, Plan):
        raise ValueError(f"plan must be a protrain_core.Plan, a dict of its fields or None, got {type(plan).__name__}")
    if plan is not None and memory_budget is not None:
        raise ValueError(
            "memory_budget is used to search a plan; pass plan=None to search one within the budget, "
            "or drop memory_budget to use the given plan."
        )
    if not optimizer_states and plan is None:
        raise ValueError("wrap(optimizer_states=False) builds an engine for evaluation only: pass its plan=.")
    if plan is None:
        if example_inputs is None:
            raise ValueError(
                "wrap(plan=None) profiles one training iteration to choose the plan: pass "
                "example_inputs= one real batch (e.g. {'input_ids': x, 'labels': x} for a Hugging Face "
                "causal LM), or pass an explicit plan=protrain_core.Plan(...)."
            )
        budget = parse_bytes(memory_budget) if memory_budget is not None else default_memory_budget(dev)
    block_path, block_list, layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs)
    choice = profile = None
    if plan is None:
        profile = profile_model(
            model, optimizer, layout, example_inputs=example_inputs, loss_fn=loss_fn, step_fn=step_fn,
            precision=prec, device=dev, cache=profile_cache, reprofile=reprofile,
        )
        if gradient_clipping is not None and gradient_clipping[0] == "norm":
            # The global norm needs every gradient before any update: Adam waits for step().
            profile = dataclasses.replace(profile, adam_in_backward=False)
        choice = search(profile, budget, host_budget=default_host_budget(dev))
        plan = choice.plan
    check_activation_plan(len(block_list), plan.n_swap, plan.n_checkpoint)
    if plan.n_persist > layout.n_chunks:
        raise ValueError(
            f"Plan.n_persist={plan.n_persist} but the model has only {layout.n_chunks} chunks; "
            f"use n_persist <= {layout.n_chunks} (n_persist={layout.n_chunks} keeps everything on the device)."
        )
    n_streamed = layout.n_chunks - plan.n_persist
    if n_streamed and plan.n_buffer < 1:
        raise ValueError(
            f"Plan.n_buffer must be >= 1 when chunks are streamed ({n_streamed} of "
            f"{layout.n_chunks} are not persistent)."
        )
    engine = Engine(model, optimizer, with_persistence(layout, plan.n_persist), plan, prec, dev, check_invariants,
                    optimizer_states=optimizer_states)
    engine.profile, engine.choice = profile, choice
    if gradient_clipping is not None:
        engine.set_gradient_clipping(*gradient_clipping)
    return engine


def _prepare(model: nn.Module, optimizer, blocks, chunk_size, example_inputs):
    """Checks shared by ``wrap`` and ``profile``; returns (block path, block list, chunk layout)."""
    check_optimizer(optimizer)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("The model has parameters on the meta device; materialise them before wrap().")
    model_params = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                raise ValueError("The optimizer holds a parameter that is not part of the model.")
    if getattr(model, "_protrain_engine", None) is not None:
        raise ValueError("This model is already wrapped by a ProTrain engine.")

    # transformers >= 5 names it is_activation_checkpointing (is_gradient_checkpointing is deprecated).
    hf_checkpointing = next(
        (getattr(model, a) for a in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), a)),
        False,
    )
    if hf_checkpointing:
        raise ValueError(
            "The model has Hugging Face gradient checkpointing enabled; ProTrain decides per block "
            "which activations to keep, recompute or swap (Plan.n_checkpoint / Plan.n_swap). Call "
            "model.gradient_checkpointing_disable() before wrap()."
        )
    block_path, block_list = find_blocks(model, blocks)
    layout = build_layout(model, block_path, len(block_list), example_inputs=example_inputs, chunk_size=chunk_size)
    return block_path, block_list, layout


def profile(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_inputs,
    *,
    precision: str = "32-true",
    device: torch.device | str | None = None,
    blocks: nn.ModuleList | str | None = None,
    chunk_size: int | None = None,
    loss_fn=None,
    step_fn=None,
    iterations: int = 3,
    cache: bool = True,
    reprofile: bool = False,
) -> Profile:
    """Profile ``model`` on one real batch without wrapping it for training (the parameters,
    the optimizer and the random state are left as they were). See ``protrain_core.profiler``."""
    prec = parse_precision(precision)
    dev = resolve_device(device)
    _, _, layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs)
    return profile_model(
        model, optimizer, layout, example_inputs=example_inputs, loss_fn=loss_fn, step_fn=step_fn, precision=prec,
        device=dev, iterations=iterations, cache=cache, reprofile=reprofile,
    )


# The margin left free by the default budget on CUDA. "Free" memory (cudaMemGetInfo) already
# excludes the CUDA context, but memory allocated outside PyTorch's caching allocator after
# planning is not seen by the profiler: cuBLAS/cuBLASLt workspaces per stream, kernels loaded
# lazily on first use (CUDA_MODULE_LOADING=LAZY; large for libraries such as cuDNN), NCCL
# buffers when distributed; and allocator fragmentation beyond the factor measured in one
# iteration. 5 % of the device (4 GiB of an 80 GiB H100), at least 1 GiB, covers these.
CUDA_MARGIN_FRACTION = 0.05
CUDA_MARGIN_MIN_BYTES = 2**30
# On the CPU the "device" is host RAM, shared with everything else on the machine: 10 % stays free.
CPU_MARGIN_FRACTION = 0.10


def default_memory_budget(device: torch.device) -> int:
    """Free device memory minus a margin (CUDA: 5 % of the device, >= 1 GiB; CPU: 10 % of the
    available RAM, which a CPU "device" shares with the host side of ProTrain)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, free - max(int(total * CUDA_MARGIN_FRACTION), CUDA_MARGIN_MIN_BYTES))
    available = available_host_bytes()
    if available is None:
        raise ValueError("Cannot read the available memory of this machine; pass memory_budget= explicitly.")
    return int(available * (1 - CPU_MARGIN_FRACTION))


def default_host_budget(device: torch.device) -> int | None:
    """Host RAM the streamed chunks and swapped activations may use (CUDA; None on the CPU,
    where the device budget already covers the same memory)."""
    if device.type != "cuda":
        return None
    available = available_host_bytes()
    return None if available is None else int(available * (1 - CPU_MARGIN_FRACTION))


class Engine:
    """Runs a wrapped model: forward through ``engine.module``, then backward, step, zero_grad."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: ChunkLayout,
        plan: Plan,
        precision: Precision,
        device: torch.device,
        check_invariants: bool,
        *,
        optimizer_states: bool = True,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.layout = layout
        self.plan = plan
        self.precision = precision
        self.device = device
        self.ctx = DeviceContext(device)
        self.scaler = LossScaler() if precision is Precision.FP16_MIXED else None
        self._no_sync = False
        self._closed = False
        self._optim = ChunkOptimizer(optimizer, compute_is_master=not precision.is_mixed)
        self.last_grad_norm: Tensor | None = None  # total norm before clipping (norm clipping)

        params = dict(module.named_parameters())
        self.chunks: list[Chunk] = [
            Chunk(
                spec,
                persistent=layout.is_persistent(spec.index),
                params=[params[m.name] for m in spec.members],
                compute_dtype=precision.compute_dtype,
            )
            for spec in layout.chunks
        ]
        self._slot_of: dict[int, tuple[Chunk, int]] = {
            id(p): (c, i) for c in self.chunks for i, p in enumerate(c.params)
        }
        for c in self.chunks:
            # A profiling (or evaluation-only) engine never steps: no optimizer states, less memory.
            c.opt_members = self._optim.members_by_group(c) if optimizer_states else {}
        self._allocate()
        n_buffer = min(plan.n_buffer, len(self.chunks) - layout.n_persist)
        self.runtime = Runtime(
            self.chunks,
            self.ctx,
            self._optim,
            n_buffer=n_buffer,
            mixed=precision.is_mixed,
            check_invariants=check_invariants,
        )
        self._set_update_mode()
        units = self._units(n_buffer)
        self.runtime.register(units)
        blocks = list(module.get_submodule(layout.block_path))
        self.activations = None
        self._set_block_modes(interleaved_modes(len(blocks), plan.n_swap, plan.n_checkpoint))
        self._autocast_handles = self._register_autocast() if precision.is_mixed else []
        self.optimizer_states = optimizer_states
        if optimizer.state and optimizer_states:
            # The optimizer already stepped: carry its state into the chunks.
            osd = optimizer.state_dict()
            optimizer.state.clear()
            self.load_optimizer_state_dict(osd)
        module._protrain_engine = self
        self.profile: Profile | None = None  # set by wrap(plan=None)
        self.choice: PlanChoice | None = None

    # ----- construction -------------------------------------------------------------------
    def _set_block_modes(self, modes: tuple[BlockMode, ...]) -> None:
        """Install an activation manager with these block modes (replacing the current one; the
        profiler times a profiling engine's blocks both checkpointed and swapped)."""
        observer = None
        if self.activations is not None:
            observer = self.activations.observer
            self.activations.remove()
        blocks = list(self.module.get_submodule(self.layout.block_path))
        self.block_modes = modes
        self.activations = ActivationManager(blocks, modes, self.ctx)
        self.activations.observer = observer
        static = [t for c in self.chunks for t in (c.param_dev, c.param_host, c.master) if t is not None]
        self.activations.install(static + list(self.module.buffers()))

    def _state_sizes(self, c: Chunk) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of a chunk's model states, in host-pool order: master, compute copy
        (mixed precision only; otherwise the master is the compute copy), gradient accumulator,
        Adam states. The same on the device for a persistent chunk; profiler.chunk_facts
        mirrors these bytes."""
        size, cdt, mdt = self.layout.chunk_size, self.precision.compute_dtype, self.precision.master_dtype
        out = [(size, mdt)] + ([(size, cdt)] if self.precision.is_mixed else [])
        if c.grad_members:
            out.append((size, mdt))
        if c.opt_members:
            out += [(size, mdt)] * (3 if self._optim.amsgrad else 2)
        return out

    def _allocate(self) -> None:
        size = self.layout.chunk_size
        cdt = self.precision.compute_dtype
        mdt = self.precision.master_dtype  # master weights, gradient accumulator, Adam states
        amsgrad = self._optim.amsgrad
        mixed = self.precision.is_mixed
        dev = self.device

        sizes = [s for c in self.chunks if not c.persistent for s in self._state_sizes(c)]
        host_bytes = sum(n * d.itemsize for n, d in sizes)
        # A CPU "device" is host memory too.
        device_bytes = 0 if dev.type == "cuda" else sum(
            n * d.itemsize for c in self.chunks if c.persistent for n, d in self._state_sizes(c)
        )
        check_host_memory(host_bytes + device_bytes, "offloaded model states")
        self.host_pool = HostPool(sizes, pin=should_pin(dev))
        zeros = lambda: torch.zeros(size, dtype=mdt, device=dev)  # noqa: E731

        with torch.no_grad():
            for c in self.chunks:
                if c.persistent:
                    c.param_dev = torch.zeros(size, dtype=cdt, device=dev)
                    c.master = zeros() if mixed else c.param_dev
                    c.grad_acc = zeros() if c.grad_members else None
                else:
                    c.master = self.host_pool.take(size, mdt)
                    c.param_host = self.host_pool.take(size, cdt) if mixed else c.master
                    c.grad_acc = self.host_pool.take(size, mdt) if c.grad_members else None
                    c.param_dev = torch.empty(size, dtype=cdt, device=dev)
                    c.param_dev.untyped_storage().resize_(0)
                if c.opt_members:
                    take = zeros if c.persistent else (lambda: self.host_pool.take(size, mdt))
                    c.exp_avg, c.exp_avg_sq = take(), take()
                    c.max_exp_avg_sq = take() if amsgrad else None
                steps_device = c.master.device
                c.steps = [torch.zeros((), dtype=torch.float32, device=steps_device) for _ in c.params]
                for i, p in enumerate(c.params):
                    c.view(c.master, i).copy_(p.detach())  # an fp32 model is rounded to bf16 in bf16-true
                compute = c.param_dev if c.persistent else c.param_host
                if compute is not c.master:
                    compute.copy_(c.master)
                c.point_params_at(compute)
            for b in self.module.buffers():
                # bf16-true runs the module as model.to(torch.bfloat16) would: floating buffers too.
                low = self.precision is Precision.BF16_TRUE and b.is_floating_point()
                b.data = b.data.to(dev, dtype=cdt if low else b.dtype)

    def _units(self, n_buffer: int) -> dict[nn.Module, tuple[int, ...]]:
        """Hooked modules -> the chunks their forward needs (streamed chunks only matter)."""
        units: dict[nn.Module, tuple[int, ...]] = {}
        for module, idxs in unit_chunks(self.module, self.layout).items():
            streamed = sum(not self.chunks[i].persistent for i in idxs)
            if not streamed:
                continue
            units[module] = idxs
            if streamed > n_buffer:
                raise ValueError(
                    f"Module {type(module).__name__} needs {streamed} streamed chunks at once "
                    f"but Plan.n_buffer={n_buffer}; raise n_buffer or n_persist."
                )
        return units

    def _register_autocast(self):
        stack = []
        dtype = self.precision.compute_dtype
        device_type = self.device.type

        def enter(_module, _args):
            ac = torch.autocast(device_type, dtype=dtype)
            ac.__enter__()
            stack.append(ac)

        def leave(_module, _args, _output):
            stack.pop().__exit__(None, None, None)

        return [
            self.module.register_forward_pre_hook(enter),
            self.module.register_forward_hook(leave, always_call=True),
        ]

    # ----- training -----------------------------------------------------------------------
    def backward(self, loss: Tensor) -> None:
        """Backward through the managed model; streamed chunks are updated while it runs
        (unless Adam waits for step(): see ``overlap``)."""
        self._check_open()
        if not self._no_sync:
            self._check_trains("backward() outside no_sync()")
        self.runtime.begin_backward(boundary=not self._no_sync)
        self.activations.begin_backward()
        try:
            if self.scaler is not None:
                loss = loss * self.scaler.scale.to(loss.device)
            loss.backward()
        finally:
            self.activations.end_backward()
            self.runtime.end_backward()

    def set_gradient_clipping(self, algorithm: str | None, value: float | None = None, norm_type: float = 2.0) -> None:
        """Clip the gradients before every update exactly as plain PyTorch would with
        ``torch.nn.utils.clip_grad_norm_(params, value, norm_type)`` ("norm") or
        ``clip_grad_value_(params, value)`` ("value") over the optimizer's parameters, on the
        gradients Adam reads (fp32 in mixed precision, after fp16 unscaling); None turns it off.

        "value" is elementwise: each chunk is clamped right before its own Adam, so streamed
        chunks are still updated during backward. "norm" needs the global norm before any
        update: every chunk's Adam waits for step() (the CPU Adam no longer overlaps backward;
        ``overlap`` says so) and ``last_grad_norm`` holds the total norm before clipping.
        Call it between steps; setting the current value again is a no-op at any time.
        """
        self._check_open()
        clipping = parse_gradient_clipping(algorithm, value, norm_type)
        if clipping == self._optim.clipping:
            return
        if self.runtime.phase is not Phase.IDLE:
            raise RuntimeError("engine.set_gradient_clipping() was called during backward; call it between steps.")
        if any(c.updated_this_step for c in self.chunks):
            raise RuntimeError(
                "Gradient clipping changed between engine.backward() and engine.step(), but ProTrain "
                "already updated offloaded chunks during backward with the previous setting. Change "
                "it after engine.step(), before the next backward."
            )
        self.runtime.wait_all()  # no update in flight reads the setting
        self._optim.clipping = clipping
        self.last_grad_norm = None
        self._set_update_mode()

    @property
    def gradient_clipping(self) -> GradientClipping | None:
        return self._optim.clipping

    def _set_update_mode(self) -> None:
        # fp16 (an inf/nan anywhere skips the whole step) and norm clipping (one factor for all
        # gradients) must see every gradient before any update, so Adam runs at step();
        # otherwise streamed chunks are updated during backward.
        reasons = []
        if self.scaler is not None:
            reasons.append("fp16 overflow check")
        if self._clips_norm:
            reasons.append("gradient norm clipping")
        self.runtime.eager_update = not reasons
        self.overlap = f"deferred-to-step ({', '.join(reasons)})" if reasons else "cpu-adam-during-backward"

    @property
    def _clips_norm(self) -> bool:
        clipping = self._optim.clipping
        return clipping is not None and clipping.algorithm is ClipAlgorithm.NORM

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients (non-final micro-batches)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self) -> None:
        """Returns when every parameter holds this step's final value."""
        self._check_open()
        self._check_trains("step()")
        if self.runtime.phase is not Phase.IDLE:
            raise RuntimeError("engine.step() was called during backward.")
        hps = self._optim.snapshot()
        if any(c.updated_this_step for c in self.chunks) and hps != self.runtime.hps:
            raise RuntimeError(
                "The optimizer's hyper-parameters changed between engine.backward() and "
                "engine.step(), but ProTrain already applied the backward-time values to the "
                "offloaded chunks. Change lr (e.g. scheduler.step()) after engine.step()."
            )
        found_inf = None
        if self.scaler is not None or self._clips_norm:
            self.runtime.wait_all()  # every gradient is in its accumulator, none was used yet
        if self.scaler is not None:
            found_inf = self._unscale_and_check()
            self.scaler.update(found_inf)
        if self._clips_norm:
            # Also on a skipped fp16 step: the norm is then inf/nan, as clip_grad_norm_ reports it.
            self.last_grad_norm = self._optim.clip_grad_norm(self._slot_of, self.device)
        if found_inf is not None and found_inf.item():
            for c in self.chunks:
                c.updated_this_step = False
            self._after_step()
            return
        self.runtime.step(hps)
        self._after_step()

    def _after_step(self) -> None:
        # Runs the optimizer's step hooks and LR-scheduler bookkeeping. No parameter holds a
        # .grad (the engine keeps gradients in chunks), so torch's update loop skips them all.
        self.optimizer.step()

    def _unscale_and_check(self) -> Tensor:
        found_inf = torch.zeros(1, dtype=torch.float32)
        inv_scale = self.scaler.inv_scale()
        for c in self.chunks:
            grads = [c.view(c.grad_acc, i) for i in c.grad_members if c.received[i]]
            if grads:
                local = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, local, inv_scale.to(grads[0].device))
                found_inf += local.cpu()
        return (found_inf > 0).float()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_open()
        self.runtime.zero_grad()

    # ----- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """Master weights (fp32; bf16 in bf16-true) and buffers under the model's own names, on the CPU."""
        self.runtime.wait_all()
        out = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            slot = self._slot_of.get(id(t))
            if slot is not None:
                c, i = slot
                out[key] = c.view(c.master, i).detach().to("cpu", copy=True)
            else:
                out[key] = t.detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        self._check_open()
        expected = self.module.state_dict(keep_vars=True)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for key, value in state_dict.items():
            if key in expected and tuple(value.shape) != tuple(expected[key].shape):
                raise ValueError(f"load_state_dict: {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
        self.runtime.release_all()
        with torch.no_grad():
            for key, value in state_dict.items():
                t = expected.get(key)
                if t is None:
                    continue
                slot = self._slot_of.get(id(t))
                if slot is None:
                    t.copy_(value)
                    continue
                c, i = slot
                c.view(c.master, i).copy_(value)
                compute = c.param_dev if c.persistent else c.param_host
                if compute is not c.master:
                    c.view(compute, i).copy_(c.view(c.master, i))

    def optimizer_state_dict(self) -> dict:
        """The optimizer state in ``torch.optim.AdamW.state_dict()`` format, on the CPU."""
        self.runtime.wait_all()
        return self._optim.state_dict(self._slot_of)

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self._check_open()
        self.runtime.wait_all()
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
        return self.runtime.device_bytes()

    def host_bytes(self) -> int:
        return self.host_pool.nbytes

    def explain(self) -> str:
        """Why this plan: predicted step time by phase, memory breakdown, bottleneck
        (for a searched plan; an explicit plan is reported as given)."""
        if self.choice is None:
            text = (f"ProTrain plan: {self.plan} (given explicitly; wrap(plan=None, memory_budget=...) "
                    "profiles the model and searches the fastest plan that fits)")
        else:
            text = self.choice.explain()
        if self._optim.clipping is None:
            return text
        clipping = self._clipping_line()
        if self._clips_norm and self.profile is not None and self.profile.adam_in_backward:
            clipping += ("; this plan was searched assuming the overlap: wrap(..., gradient_clipping=('norm', "
                         "max_norm)) searches with Adam at step()")
        return f"{text}\n{clipping}"

    def _clipping_line(self) -> str:
        clip = self._optim.clipping
        if clip is None:
            return "gradient clipping: off"
        if clip.algorithm is ClipAlgorithm.VALUE:
            return (f"gradient clipping by value ({clip.value:g}): elementwise, per chunk before its Adam; "
                    "the CPU Adam still overlaps backward")
        return (f"gradient clipping by norm (max_norm {clip.value:g}, {clip.norm_type:g}-norm): the global norm "
                "needs every gradient before any update, so the CPU Adam of offloaded chunks runs at step() "
                "instead of overlapping backward")

    def summary(self) -> str:
        mib = 2**20
        return "\n".join(
            [
                f"ProTrain engine: {self.plan}, precision={self.precision.value}, device={self.device}",
                f"optimizer: {type(self.optimizer).__name__} per chunk; overlap: {self.overlap}",
                self._clipping_line(),
                f"activations per block: {describe_modes(self.block_modes)}",
                f"device model-state bytes now {self.device_bytes() / mib:.2f} MiB "
                f"(bound {self.runtime.device_bytes_bound() / mib:.2f} MiB); "
                f"host pool {self.host_bytes() / mib:.2f} MiB ({'pinned' if self.host_pool.pinned else 'pageable'})",
                self.layout.summary(self.precision.compute_dtype.itemsize),
            ]
        )

    def close(self) -> None:
        """Remove the hooks and stop the worker. The parameters keep their current values, as
        views of the master weights (on the device for persistent chunks, else host)."""
        if self._closed:
            return
        self.runtime.wait_all()
        self.runtime.release_all()
        for c in self.chunks:
            c.point_params_at(c.master)
        self.runtime.remove_hooks()
        self.activations.remove()
        for h in self._autocast_handles:
            h.remove()
        self.runtime.shutdown()
        self.module._protrain_engine = None
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This ProTrain engine was closed.")

    def _check_trains(self, what: str) -> None:
        if not self.optimizer_states:
            raise RuntimeError(
                f"{what} on an evaluation-only ProTrain engine (wrap(optimizer_states=False)): it holds no optimizer "
                "states. Wrap with optimizer_states=True to train."
            )
