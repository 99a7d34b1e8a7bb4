"""The entry points: ``wrap`` (a model and its optimizer into a training engine, with a given or
a searched plan) and ``profile`` (measure without wrapping).

This is where the layers meet (docs/architecture.md): ``structure`` reads the model, the
``profiler`` measures it on a profiling engine, the ``planner`` searches, and the ``runtime``
builds the engine. Every argument is checked before any of that starts.
"""

from __future__ import annotations

import torch
from torch import nn

from protrain_core.autoplan import AutoPlanner, check_budget_holds_states, follow, plan_on_first_steps, print_report
from protrain_core.plan import Plan, check_plan, plan_arguments
from protrain_core.planner.profiles import Profile
from protrain_core.precision import Precision, parse_precision
from protrain_core.profiler.profiler import profile_model, reprofile_requested, safe_plan
from protrain_core.runtime.device import DeviceContext, as_context
from protrain_core.engine import Engine
from protrain_core.runtime.engine import EngineOptions
from protrain_core.runtime.optim import check_optimizer
from protrain_core.runtime.sharding import Sharding, agree, agree_budgets, check_same_configuration
from protrain_core.runtime.storage import chunk_formats
from protrain_core.structure.blocks import find_blocks
from protrain_core.structure.layout import ChunkLayout, build_layout
from protrain_core.update import overlap_mode, parse_gradient_clipping
from protrain_core.utils import available_host_bytes, batch_tokens


def wrap(
    model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan | dict | None = None, *,
    memory_budget: int | float | str | None = None, precision: str = "32-true",
    device: torch.device | str | None = None, blocks: nn.ModuleList | str | None = None,
    chunk_size: int | None = None, example_inputs=None, loss_fn=None, step_fn=None,
    gradient_clipping: tuple[str, float] | None = None, profile_cache: bool = True, reprofile: bool = False,
    optimizer_states: bool = True, check_invariants: bool = False, max_tokens: int | None = None,
    report=print_report, process_group=None,
) -> Engine:
    """Put ``model``'s parameters and ``optimizer``'s states into ProTrain chunks.

    Args:
        model, optimizer: the module to train (its parameters on the CPU or on ``device``), and a
            ``torch.optim.AdamW`` or ``Adam`` over (some of) its parameters.
        plan: a :class:`Plan` (or dict of its fields): chunks kept on the device, chunk buffers,
            and how many transformer blocks swap or checkpoint their activations. None (default):
            the engine starts on a safe plan, measures the first training steps (they train as
            usual: [Note: live profiling] in profiler/live.py), then switches to the fastest plan
            that fits ``memory_budget`` (``engine.explain()``); ``example_inputs``: profile ahead.
        memory_budget: device memory the plan may use (plan=None only): bytes, or "20GiB", "500MB"...
        precision, device: "32-true", "bf16-mixed", "16-mixed" or "bf16-true"; None: CUDA if any.
        blocks, chunk_size: the transformer blocks (ModuleList or dotted name) when discovery
            fails; chunk size in elements (None: the waste-minimising search).
        example_inputs: one batch (keyword arguments, tuple or tensor) to trace the execution
            order on the meta device (Hugging Face models need none) and, with plan=None, to profile
            ahead of training (your module or ``step_fn`` then runs a few more times).
        loss_fn, step_fn: profiling ahead: ``loss_fn(output) -> scalar`` (default ``output.loss``),
            or ``step_fn(module, example_inputs) -> loss`` (or ``(loss, kept_alive)``) instead.
        gradient_clipping: ``("norm", max_norm)`` or ``("value", clip_value)``: exactly
            ``clip_grad_norm_`` / ``clip_grad_value_`` before every update (``Engine.set_gradient_clipping``).
        profile_cache, reprofile: reuse a profile cached on disk for the same model, batch shape,
            precision and hardware (``planner.profiles.cache_dir()``); profile again anyway.
        optimizer_states, check_invariants: False: an engine for evaluation only (give its plan)
            holds no optimizer states; True: check the runtime's invariants at every hook (tests).
        max_tokens: plan once for batches of up to this many tokens (batch x sequence); else
            the plan follows the batch shapes ([Note: batch shapes] in autoplan.py).
        report: ``report(text, **metrics)``: the plan chosen, switches for batch shapes, the step
            time measured against the prediction (default: print).
        process_group: the processes to shard the chunks over ([Note: sharded chunks]); default:
            the initialised default group, if any. Every rank calls ``wrap`` alike; rank 0's
            weights are broadcast and rank 0's plan is followed.
    """
    # Everything that can be wrong with the arguments is checked before memory is touched.
    prec, dev = _checked(model, precision, device, gradient_clipping)
    plan, budget = plan_arguments(plan, memory_budget, max_tokens)
    if plan is None and not optimizer_states:
        raise ValueError("wrap(optimizer_states=False) builds an engine for evaluation only: pass its plan=.")
    sharding = Sharding.resolve(process_group)
    if sharding is not None:
        sharding.check_device(dev.device)
    budget = default_memory_budget(dev) if budget is None and plan is None else budget
    layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs, dev)
    check_same_configuration(sharding, _configuration(model, optimizer, layout, prec, plan, gradient_clipping,
                                                      optimizer_states, max_tokens))
    options = EngineOptions(optimizer_states=optimizer_states, check_invariants=check_invariants)
    if plan is not None:
        return _engine(model, optimizer, layout, agree(sharding, plan), prec, dev, gradient_clipping, options, sharding)
    return _searched(model, optimizer, layout, prec, dev, gradient_clipping, options, sharding, budget, max_tokens, report,
                     example_inputs=example_inputs, loss_fn=loss_fn, step_fn=step_fn, cache=profile_cache,
                     reprofile=reprofile or reprofile_requested())


def _configuration(model: nn.Module, optimizer, layout: ChunkLayout, prec: Precision, plan, gradient_clipping,
                   optimizer_states: bool, max_tokens) -> dict[str, object]:
    """What every rank's ``wrap`` must agree on (``check_same_configuration``)."""
    hyper = sorted({k for g in optimizer.param_groups for k in g if k != "params"})
    return {
        "precision": prec.value,
        "chunk size": layout.chunk_size,
        "blocks": f"{layout.block_path} ({layout.n_blocks})",
        "parameters": [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
                       for name, p in model.named_parameters()],
        "optimizer": [(type(optimizer).__name__, len(g["params"]), *(repr(g.get(k)) for k in hyper))
                      for g in optimizer.param_groups],
        "plan": "searched" if plan is None else repr(plan),
        "gradient clipping": repr(gradient_clipping),
        "optimizer states": optimizer_states,
        "max tokens": max_tokens,
    }


def _searched(model, optimizer, layout: ChunkLayout, prec: Precision, dev: DeviceContext, gradient_clipping,
              options: EngineOptions, sharding: Sharding | None, budget: int, max_tokens: int | None, report, *,
              example_inputs, loss_fn, step_fn, cache: bool, reprofile: bool) -> Engine:
    """``wrap`` with plan=None: the engine on a safe plan that switches after profiling its first
    steps, or (``example_inputs``) profiled and searched first."""
    budget, host_budget = agree_budgets(sharding, budget, default_host_budget(dev))  # one plan for every rank
    world = 1 if sharding is None else sharding.world
    if layout.n_blocks == 0:  # no activations to plan: the placement alone, without profiling
        plan = safe_plan(model, optimizer, layout, prec, dev, optimizer_states=True, budget=budget, world_size=world)
        engine = _engine(model, optimizer, layout, agree(sharding, plan), prec, dev, gradient_clipping, options,
                         sharding)
        report(f"ProTrain: {plan} -- the model has no repeated blocks, so there is no activation plan to search: "
               "its chunks persist when its model states take at most half the memory budget, else they stream.")
        return engine
    if example_inputs is None:
        check_budget_holds_states(chunk_formats(model, optimizer, layout, prec, optimizer_states=True, world_size=world),
                                  layout.limits(), budget)
        start = safe_plan(model, optimizer, layout, prec, dev, optimizer_states=True, budget=budget, world_size=world)
        engine = _engine(model, optimizer, layout, agree(sharding, start), prec, dev, gradient_clipping, options,
                         sharding)
        plan_on_first_steps(engine, budget=budget, host_budget=host_budget, report=report, max_tokens=max_tokens,
                            cache=cache, reprofile=reprofile)
        return engine
    profile = profile_model(model, optimizer, layout, example_inputs=example_inputs, loss_fn=loss_fn,
                            step_fn=step_fn, precision=prec, device=dev, cache=cache, reprofile=reprofile,
                            sharding=sharding)
    n = batch_tokens(example_inputs)
    overlap = overlap_mode(prec, None if gradient_clipping is None else parse_gradient_clipping(*gradient_clipping))
    planner = AutoPlanner(None, profile, budget=budget, host_budget=host_budget, report=report, max_tokens=max_tokens,
                          overlap=overlap,
                          tokens_per_batch_token=profile.tokens / n if n and profile.tokens else None)
    choice = planner.first_choice()
    planner.engine = engine = _engine(model, optimizer, layout, choice.plan, prec, dev, gradient_clipping, options,
                                      sharding)
    follow(engine, planner, choice, report=report)
    return engine


def _engine(model, optimizer, layout: ChunkLayout, plan: Plan, precision: Precision, device: DeviceContext,
            gradient_clipping, options: EngineOptions, sharding: Sharding | None = None) -> Engine:
    check_plan(plan, layout.limits())
    engine = Engine(model, optimizer, layout, plan, precision, device, options, sharding=sharding)
    if gradient_clipping is not None:
        engine.set_gradient_clipping(*gradient_clipping)
    return engine


def _prepare(model: nn.Module, optimizer, blocks, chunk_size, example_inputs, ctx: DeviceContext) -> ChunkLayout:
    """Checks shared by ``wrap`` and ``profile``; returns the chunk layout."""
    check_optimizer(optimizer)
    if ctx.device.type != "meta" and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("The model has parameters on the meta device; materialise them before wrap().")
    model_params = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                raise ValueError("The optimizer holds a parameter that is not part of the model.")
    engine = getattr(model, "_protrain_engine", None)
    if engine is not None and engine.module is model:  # (a deep copy of a wrapped model is not)
        raise ValueError("This model is already wrapped by a ProTrain engine.")

    compiled = next((name for name, m in model.named_modules() if _is_compiled(m)), None)
    if compiled is not None:
        where = "The model is" if compiled == "" else f"Its submodule {compiled!r} is"
        raise ValueError(
            f"{where} compiled with torch.compile. ProTrain hooks every block and moves its parameters "
            "between the device and the host, which a compiled graph does not see; wrap the model before "
            "compiling anything (torch.compile of a ProTrain-wrapped model is not supported yet)."
        )
    checkpointed = _hf_checkpointing(model)
    if checkpointed is not None:
        where = "The model" if checkpointed == "" else f"Its submodule {checkpointed!r}"
        raise ValueError(
            f"{where} has Hugging Face gradient checkpointing enabled; ProTrain decides per block "
            "which activations to keep, recompute or swap (Plan.n_checkpoint / Plan.n_swap). Call "
            "gradient_checkpointing_disable() on it before wrap() (in a LightningModule: in __init__ or "
            "configure_model, instead of gradient_checkpointing_enable())."
        )
    block_path, block_list = find_blocks(model, blocks)
    return build_layout(model, block_path, len(block_list), example_inputs=example_inputs, chunk_size=chunk_size)


def _checked(model: nn.Module, precision: str, device, gradient_clipping) -> tuple[Precision, DeviceContext]:
    """The precision and device of ``wrap`` (a torch device, or a DeviceContext: a simulated
    device), after the checks of its arguments that need no model structure (nothing is
    allocated yet)."""
    prec, dev = parse_precision(precision), as_context(device)
    check_parameter_dtypes(model, prec)
    if gradient_clipping is not None:
        parse_gradient_clipping(*gradient_clipping)
    return prec, dev


def check_parameter_dtypes(model: nn.Module, precision: Precision) -> None:
    """Under "32-true" every floating-point parameter must be fp32: ProTrain would otherwise
    train the others in fp32 too, where plain PyTorch (and Lightning's default strategy) would
    compute in their dtype, or fail on the mismatch."""
    if precision is not Precision.FP32:
        return
    other = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if other:
        dtypes = sorted({str(d).removeprefix("torch.") for _, d in other})
        raise ValueError(
            f"precision='32-true' trains fp32 parameters, but {len(other)} parameter(s) are {', '.join(dtypes)} "
            f"(e.g. {other[0][0]}). Cast the model with model.float(), or choose the precision of its dtype: "
            "'bf16-true' for a bf16 model, 'bf16-mixed' / '16-mixed' for fp32 masters with low-precision compute."
        )


def _is_compiled(module: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper (torch._dynamo's OptimizedModule), without importing
    dynamo."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def _hf_checkpointing(model: nn.Module) -> str | None:
    """The name of the (sub)module with Hugging Face gradient checkpointing enabled ("" for the
    model itself), or None -- the model may be a LightningModule holding the Hugging Face model.
    transformers >= 5 names the flag is_activation_checkpointing (is_gradient_checkpointing is
    deprecated)."""
    for name, module in model.named_modules():
        for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(module), attr):
                if getattr(module, attr):
                    return name
                break
    return None


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
    dev = as_context(device)
    layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs, dev)
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


def default_memory_budget(device: torch.device | DeviceContext) -> int:
    """Free device memory minus a margin (CUDA and a simulated GPU: 5 % of the device, >= 1 GiB;
    CPU: 10 % of the available RAM, which a CPU "device" shares with the host side of ProTrain)."""
    if _asynchronous(device):
        free, total = device.free_memory() if isinstance(device, DeviceContext) else torch.cuda.mem_get_info(device)
        return max(0, free - max(int(total * CUDA_MARGIN_FRACTION), CUDA_MARGIN_MIN_BYTES))
    available = available_host_bytes()
    if available is None:
        raise ValueError("Cannot read the available memory of this machine; pass memory_budget= explicitly.")
    return int(available * (1 - CPU_MARGIN_FRACTION))


def default_host_budget(device: torch.device | DeviceContext) -> int | None:
    """Host RAM the streamed chunks and swapped activations may use (CUDA and a simulated GPU;
    None on the CPU, where the device budget already covers the same memory)."""
    if not _asynchronous(device):
        return None
    available = device.available_host_bytes() if isinstance(device, DeviceContext) else available_host_bytes()
    return None if available is None else int(available * (1 - CPU_MARGIN_FRACTION))


def _asynchronous(device: torch.device | DeviceContext) -> bool:
    """A device with memory of its own beside the host's (CUDA, a simulated GPU)."""
    return device.asynchronous if isinstance(device, DeviceContext) else device.type == "cuda"
