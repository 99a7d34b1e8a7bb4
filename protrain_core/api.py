"""The entry points: ``wrap`` (a model and its optimizer into a training engine, with a given or
a searched plan) and ``profile`` (measure without wrapping).

This is where the layers meet (docs/architecture.md): ``structure`` reads the model, the
``profiler`` measures it on a profiling engine, the ``planner`` searches, and the ``runtime``
builds the engine. Every argument is checked before any of that starts.
"""

from __future__ import annotations

import torch
from torch import nn

from protrain_core.plan import Plan, check_plan, plan_arguments
from protrain_core.planner.profiles import Profile
from protrain_core.planner.search import search
from protrain_core.precision import Precision, parse_precision
from protrain_core.profiler.profiler import profile_model
from protrain_core.runtime.device import resolve_device
from protrain_core.runtime.engine import Engine, EngineOptions
from protrain_core.runtime.optim import check_optimizer
from protrain_core.structure.blocks import find_blocks
from protrain_core.structure.layout import ChunkLayout, build_layout
from protrain_core.update import overlap_mode, parse_gradient_clipping
from protrain_core.utils import available_host_bytes


def wrap(
    model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan | dict | None = None, *,
    memory_budget: int | float | str | None = None, precision: str = "32-true",
    device: torch.device | str | None = None, blocks: nn.ModuleList | str | None = None,
    chunk_size: int | None = None, example_inputs=None, loss_fn=None, step_fn=None,
    gradient_clipping: tuple[str, float] | None = None, profile_cache: bool = True, reprofile: bool = False,
    optimizer_states: bool = True, check_invariants: bool = False,
) -> Engine:
    """Put ``model``'s parameters and ``optimizer``'s states into ProTrain chunks.

    Args:
        model: the module to train; its parameters may be on the CPU or on ``device``.
        optimizer: a ``torch.optim.AdamW`` or ``Adam`` over (some of) the model's parameters.
        plan: a :class:`Plan` (or dict of its fields): chunks kept on the device, chunk
            buffers, and how many transformer blocks swap or checkpoint their activations.
            None (the default) profiles one iteration on ``example_inputs`` and picks the plan
            with the least predicted step time that fits ``memory_budget`` (``engine.explain()``).
        memory_budget: device memory the plan may use (plan=None only): bytes, or "20GiB", "500MB"...
        precision: "32-true", "bf16-mixed", "16-mixed" or "bf16-true".
        device: the compute device; None means CUDA when available, else the CPU.
        blocks: the transformer blocks (ModuleList or dotted name) when discovery fails.
        chunk_size: chunk size in elements; None runs the waste-minimising grid search.
        example_inputs: one batch (dict of keyword arguments, tuple or tensor). It traces the
            execution order on the meta device (Hugging Face models need none for that) and,
            with plan=None, is what the profiler runs -- a real batch of the real shape.
        loss_fn: ``loss_fn(output) -> scalar`` for profiling; default ``output.loss``.
        step_fn: ``step_fn(module, example_inputs) -> loss`` (or ``(loss, kept_alive)``) for
            profiling, instead of the module and ``loss_fn`` (e.g. a LightningModule's ``training_step``).
        gradient_clipping: ``("norm", max_norm)`` or ``("value", clip_value)``: exactly
            ``clip_grad_norm_`` / ``clip_grad_value_`` before every update (``Engine.set_gradient_clipping``).
        profile_cache: reuse a profile cached on disk for the same model, batch shape, precision and
            hardware (``protrain_core.planner.profiles.cache_dir()``); ``reprofile``: profile again anyway.
        optimizer_states: False builds an engine for evaluation only (a plan must be given): no
            optimizer states; ``backward`` outside ``no_sync`` and ``step`` raise.
        check_invariants: check residency and device-byte invariants at every hook (tests).
    """
    # Everything that can be wrong with the arguments is checked before memory is touched.
    prec = parse_precision(precision)
    dev = resolve_device(device)
    clipping = None if gradient_clipping is None else parse_gradient_clipping(*gradient_clipping)
    plan, budget = plan_arguments(plan, memory_budget)
    if plan is None:
        _check_search_arguments(example_inputs, optimizer_states)
        budget = budget if budget is not None else default_memory_budget(dev)
    layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs)
    choice = profile = None
    if plan is None:
        profile = profile_model(model, optimizer, layout, example_inputs=example_inputs, loss_fn=loss_fn,
                                step_fn=step_fn, precision=prec, device=dev, cache=profile_cache, reprofile=reprofile)
        choice = search(profile, budget, host_budget=default_host_budget(dev),
                        adam_in_backward=overlap_mode(prec, clipping).during_backward)
        plan = choice.plan
    check_plan(plan, layout.limits())
    engine = Engine(model, optimizer, layout, plan, prec, dev,
                    EngineOptions(optimizer_states=optimizer_states, check_invariants=check_invariants))
    engine.profile, engine.choice = profile, choice
    if gradient_clipping is not None:
        engine.set_gradient_clipping(*gradient_clipping)
    return engine


def _check_search_arguments(example_inputs, optimizer_states: bool) -> None:
    if not optimizer_states:
        raise ValueError("wrap(optimizer_states=False) builds an engine for evaluation only: pass its plan=.")
    if example_inputs is None:
        raise ValueError(
            "wrap(plan=None) profiles one training iteration to choose the plan: pass "
            "example_inputs= one real batch (e.g. {'input_ids': x, 'labels': x} for a Hugging Face "
            "causal LM), or pass an explicit plan=protrain_core.Plan(...)."
        )


def _prepare(model: nn.Module, optimizer, blocks, chunk_size, example_inputs) -> ChunkLayout:
    """Checks shared by ``wrap`` and ``profile``; returns the chunk layout."""
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
    return build_layout(model, block_path, len(block_list), example_inputs=example_inputs, chunk_size=chunk_size)


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
    prec: Precision = parse_precision(precision)
    dev = resolve_device(device)
    layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs)
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
