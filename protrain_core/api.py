"""The entry points, where the layers meet (docs/architecture.md): ``wrap`` (a model and its
optimizer into a training engine, with a given or a searched plan) and ``profile`` (measure
without wrapping). Every argument is checked before any layer starts.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from protrain_core.autoplan import (AutoPlanner, check_budget_holds_states, follow, plan_on_first_steps, print_report,
                                    refitter)
from protrain_core.checkpoint import is_sharded_checkpoint
from protrain_core.chunk_format import ChunkFormat
from protrain_core.config import PlanningConfig, ProTrainConfig
from protrain_core.engine import Engine
from protrain_core.plan import Plan, check_plan
from protrain_core.planner.profiles import Profile
from protrain_core.precision import Precision, parse_precision
from protrain_core.profiler.profiler import profile_model, safe_plan
from protrain_core.runtime.compiled import compile_fingerprint, compile_setting
from protrain_core.runtime.device import DeviceContext, as_context
from protrain_core.runtime.optim import check_optimizer, joint_optimizer, parameter_owners
from protrain_core.runtime.sharding import Sharding, agree, agree_budgets, check_same_configuration
from protrain_core.runtime.state_formats import block_aligned, check_optimizer_for
from protrain_core.runtime.storage import chunk_formats
from protrain_core.runtime.weights import check_weights
from protrain_core.structure.blocks import find_blocks
from protrain_core.structure.layout import ChunkLayout, build_layout
from protrain_core.update import clips_norm, overlap_mode
from protrain_core.utils import available_host_bytes, batch_tokens, format_bytes, is_compile_wrapper


def wrap(
    model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], plan: Plan | dict | None = None, *,
    config: ProTrainConfig | None = None, precision: str = "32-true", device: torch.device | str | None = None,
    example_inputs=None, loss_fn=None, step_fn=None, report=print_report, process_group=None,
) -> Engine:
    """Put ``model``'s parameters and ``optimizer``'s states into ProTrain chunks.

    Args:
        model, optimizer: the module to train (its parameters on the CPU or on ``device``), and a
            ``torch.optim.AdamW`` or ``Adam`` (or another elementwise optimizer) over (some of)
            its parameters; or a list of several optimizers of one class over disjoint
            parameters (a GAN's generator and discriminator), each stepped on its own with
            ``engine.step(optimizer)`` ([Note: several optimizers] in runtime/engine.py).
        plan: a :class:`Plan` (or dict of its fields), as ``config.planning.plan``. None
            (default): the engine starts on a safe plan, measures the first training steps (they
            train as usual: [Note: live profiling] in profiler/live.py), then switches to the
            fastest plan that fits ``config.planning.memory_budget`` (``engine.explain()``).
        config: every other setting (:class:`ProTrainConfig`: planning, gradient clipping,
            runtime switches); default: the defaults.
        precision, device: "32-true", "bf16-mixed", "16-mixed" or "bf16-true"; None: CUDA (this process's GPU) if any.
        example_inputs: one batch (keyword arguments, tuple or tensor) to trace the execution
            order on the meta device (Hugging Face models need none) and, with plan=None, to profile
            ahead of training (your module or ``step_fn`` then runs a few more times).
        loss_fn, step_fn: profiling ahead: ``loss_fn(output) -> scalar`` (default ``output.loss``),
            or ``step_fn(module, example_inputs) -> loss`` (or ``(loss, kept_alive)``) instead.
        report: ``report(text, **metrics)``: the plan chosen, switches for batch shapes, the step
            time measured against the prediction (default: print).
        process_group: the processes to shard the chunks over ([Note: sharded chunks]); default:
            the initialised default group, if any. Every rank calls ``wrap`` alike; rank 0's
            weights are broadcast and rank 0's plan is followed.
    """
    # Everything that can be wrong with the arguments is checked before memory is touched.
    config = ProTrainConfig() if config is None else config
    if not isinstance(config, ProTrainConfig):
        raise TypeError(f"wrap(config=...) takes a protrain_core.ProTrainConfig, got {type(config).__name__}.")
    if plan is not None:
        if config.planning.plan is not None:
            raise ValueError("wrap() was given a plan and a config whose planning.plan is set: give it once.")
        config = config.replace(planning={"plan": plan})
    planning = config.planning
    if planning.plan is None and not config.optimizer_states:
        raise ValueError("optimizer_states=False builds an engine for evaluation only: pass its plan= (or "
                         "config.planning.plan).")
    prec, dev = parse_precision(precision), as_context(device)  # (a DeviceContext: maybe a simulated device)
    optimizers, optimizer = _joint(model, optimizer, config, prec)
    check_parameter_dtypes(model, prec)
    check_weights(model, config.weights)
    _check_grad_accumulator(config, prec)
    config = config.replace(compile=compile_setting(model, config.compile))
    sharding = Sharding.resolve(process_group)
    sharding.check_device(dev.device)
    budget = planning.budget_bytes
    budget = default_memory_budget(dev) if budget is None and planning.plan is None else budget
    layout = _prepare(model, optimizer, planning.blocks, planning.chunk_size, example_inputs, dev,
                      moments=config.optimizer_state_format, optimizers=optimizers)
    check_same_configuration(sharding, _configuration(model, optimizer, layout, prec, config))
    build = _Build(model, optimizer, layout, prec, dev, config, sharding, optimizers)
    if planning.plan is not None:
        return build.engine(agree(sharding, planning.plan))
    return _searched(build, budget, report, example_inputs=example_inputs, loss_fn=loss_fn, step_fn=step_fn)


def _joint(model: nn.Module, optimizer, config: ProTrainConfig, prec: Precision) -> tuple[tuple, torch.optim.Optimizer]:
    """The optimizers given (one, or a list), and the engine's optimizer: the one given, or one
    over several (``joint_optimizer``), whose steps the engine takes one optimizer at a time; what
    several cannot do is refused here."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap(model, ...) takes a torch.nn.Module, got {type(model).__name__}.")
    optimizers = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
    if not optimizers:
        raise ValueError("wrap() needs an optimizer (or a list of them); got an empty list.")
    wrong = next((o for o in optimizers if not isinstance(o, torch.optim.Optimizer)), None)
    if wrong is not None:
        raise TypeError(f"wrap(model, optimizer) takes a torch.optim.Optimizer (or a list of them) over the model's "
                        f"parameters, got {type(wrong).__name__}: build one, e.g. torch.optim.AdamW(model.parameters()).")
    if len(optimizers) > 1:
        unsupported = {
            "gradient clipping (its norm would span every optimizer's parameters)": config.clipping is not None,
            "grad_accumulator=False (updates during backward)": config.grad_accumulator is False,
            "optimizer_states=False (an engine for evaluation has no optimizer)": not config.optimizer_states,
            f"optimizer_state_format={config.optimizer_state_format!r} (fp32 moments only, for now)":
                config.optimizer_state_format != "fp32",
            "precision='16-mixed' (one loss scale would serve every optimizer's step; bf16-mixed needs none)":
                prec is Precision.FP16_MIXED,
        }
        why = next((what for what, given in unsupported.items() if given), None)
        if why is not None:
            raise ValueError(f"wrap() with several optimizers does not support {why}: each optimizer's chunks are "
                             "updated at its own step() from the gradients accumulated for them. Remove the setting, "
                             "or train with one optimizer (a param group per model part).")
    names = {id(p): n for n, p in model.named_parameters()}
    return optimizers, joint_optimizer(optimizers, names)


def _check_grad_accumulator(config: ProTrainConfig, prec: Precision) -> None:
    """Refuse ``grad_accumulator=False`` where an offloaded chunk's gradient cannot be consumed
    where it lands ([Note: gradients consumed where they land] in runtime/worker.py)."""
    if config.grad_accumulator is not False or not config.optimizer_states:
        return
    if prec is not Precision.BF16_MIXED:
        raise ValueError(
            f"grad_accumulator=False lets the CPU Adam read each offloaded gradient where it lands, in the bf16 host "
            f"copy, which precision 'bf16-mixed' has; this run's is {prec.value!r} (fp16's overflow check needs every "
            "gradient before any update; the true modes land in the accumulator itself). Use precision='bf16-mixed', "
            "or grad_accumulator=None.")
    if clips_norm(config.clipping):
        raise ValueError(
            "grad_accumulator=False updates each offloaded chunk as its gradients land, during backward, but clipping "
            "by norm needs every gradient of the step first, kept in the accumulators. Clip by value, or keep the "
            "accumulators (grad_accumulator=None).")


def _configuration(model: nn.Module, optimizer, layout: ChunkLayout, prec: Precision,
                   config: ProTrainConfig) -> dict[str, object]:
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
        "plan": "searched" if config.planning.plan is None else repr(config.planning.plan),
        "gradient clipping": repr(config.clipping),
        "optimizer states": config.optimizer_states,
        "optimizer state format": config.optimizer_state_format,
        "frozen dtype": config.frozen_dtype,
        "gradient accumulator": config.grad_accumulator,
        "max tokens": config.planning.max_tokens,
        "compile": compile_fingerprint(config.compile),
    }


@dataclass(frozen=True)
class _Build:
    """What every engine ``wrap`` builds is built from (the safe plan's, the searched one's)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layout: ChunkLayout
    precision: Precision
    device: DeviceContext
    config: ProTrainConfig
    sharding: Sharding
    optimizers: tuple = ()  # several optimizers the engine steps one at a time (``optimizer`` over all)

    def engine(self, plan: Plan) -> Engine:
        check_plan(plan, self.layout.limits())
        self.check_host_budget(plan)
        weights = self.config.weights  # a sharded ProTrain checkpoint directory (save_sharded)?
        sharded = isinstance(weights, (str, os.PathLike)) and is_sharded_checkpoint(weights)
        config = self.config.replace(weights=None) if sharded else self.config
        engine = Engine(self.model, self.optimizer, self.layout, plan, self.precision, self.device, config,
                        sharding=self.sharding, optimizers=self.optimizers)
        if sharded:  # (initialised, then read in place: a sharded checkpoint is read chunk by chunk)
            engine.load_sharded(weights, optimizer=False)
        clipping = self.config.clipping
        if clipping is not None:
            engine.clipping.configure(clipping.algorithm, clipping.value, clipping.norm_type)
        return engine

    def check_host_budget(self, plan: Plan) -> None:
        """Refuse, before anything is allocated, a plan whose streamed chunks' states exceed this
        rank's host budget (``default_host_budget``, divided among the ranks of a node: a
        collective). A searched plan fits by construction; this catches a given one and the safe
        plan."""
        host_budget = default_host_budget(self.device)
        if host_budget is None:
            return
        host_budget = agree_budgets(self.sharding, 0, host_budget)[1]
        persistent = plan.persistent()
        need = sum(f.streamed_host_bytes for i, f in enumerate(self.formats) if i not in persistent)
        if need > host_budget:
            raise MemoryError(
                f"The plan {plan} keeps {format_bytes(need)} of model states in host memory on this rank (the "
                f"streamed chunks' weights, gradients and optimizer states), over its host budget of "
                f"{format_bytes(host_budget)} (available RAM minus {CPU_MARGIN_FRACTION:.0%}, divided among the "
                "ranks of this node). Keep more chunks on the device (a larger n_persist), store fewer bytes per "
                "parameter (optimizer_state_format='8bit', grad_accumulator=False, frozen_dtype='int8' for a frozen "
                "base, or precision='bf16-true'), add processes on more hosts, or free host memory; nothing was "
                "allocated.")

    @cached_property
    def formats(self) -> tuple[ChunkFormat, ...]:
        """Every chunk's format, as the engine will allocate it on this rank (made once: the host
        check, the safe plan and the profile all read it)."""
        return tuple(chunk_formats(self.model, self.optimizer, self.layout, self.precision, self.config,
                                   world_size=self.sharding.world))

    def safe_plan(self, budget: int) -> Plan:
        return safe_plan(self.formats, self.layout.limits(), self.device, budget=budget)


def _searched(build: _Build, budget: int, report, *, example_inputs, loss_fn, step_fn) -> Engine:
    """``wrap`` with plan=None: the engine on a safe plan that switches after profiling its first
    steps, or (``example_inputs``) profiled and searched first."""
    planning, sharding = build.config.planning, build.sharding
    budget, host_budget = agree_budgets(sharding, budget, default_host_budget(build.device))  # one plan for every rank
    cache = dict(cache=planning.profile_cache, reprofile=planning.reprofile, cache_dir=planning.cache_dir)
    if build.layout.n_blocks == 0:  # no activations to plan: the placement alone, without profiling
        plan = build.safe_plan(budget)
        engine = build.engine(agree(sharding, plan))
        report(f"ProTrain: {plan} -- the model has no repeated blocks, so there is no activation plan to search: "
               "its chunks persist when its model states take at most half the memory budget, else they stream.")
        return engine
    if example_inputs is None:
        check_budget_holds_states(build.formats, build.layout.limits(), budget)
        engine = build.engine(agree(sharding, build.safe_plan(budget)))
        plan_on_first_steps(engine, budget=budget, host_budget=host_budget, report=report,
                            max_tokens=planning.max_tokens, **cache)
        return engine
    profile = profile_model(build.model, build.optimizer, build.layout, example_inputs=example_inputs,
                            loss_fn=loss_fn, step_fn=step_fn, precision=build.precision, device=build.device,
                            sharding=sharding, switches=build.config.runtime, compile=build.config.compile,
                            formats=build.formats, **cache)
    n = batch_tokens(example_inputs)
    planner = AutoPlanner(None, profile, budget=budget, host_budget=host_budget, report=report,
                          max_tokens=planning.max_tokens, overlap=overlap_mode(build.precision, build.config.clipping),
                          tokens_per_batch_token=profile.tokens / n if n and profile.tokens else None,
                          cache_dir=planning.cache_dir, refit=refitter(build.model, build.optimizer, build.layout,
                                                                       build.precision, build.config, build.device,
                                                                       world_size=build.sharding.world))
    choice = planner.first_choice()
    planner.engine = engine = build.engine(choice.plan)
    follow(engine, planner, choice, report=report)
    return engine


def _prepare(model: nn.Module, optimizer, blocks, chunk_size, example_inputs, ctx: DeviceContext, *,
             moments: str = "fp32", optimizers: tuple = ()) -> ChunkLayout:
    """Checks shared by ``wrap`` and ``profile``; returns the chunk layout. ``moments``: the
    moments' format, which the optimizer must suit and the layout follows; ``optimizers``:
    several, whose parameters never share a chunk."""
    check_optimizer_for(moments, optimizer, adam=check_optimizer(optimizer) is None)
    model_params = {id(p) for p in model.parameters()}
    if any(id(p) not in model_params for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("The optimizer holds a parameter that is not part of the model.")
    engine = getattr(model, "_protrain_engine", None)
    if engine is not None and engine.module is model:  # (a deep copy of a wrapped model is not)
        raise ValueError("This model is already wrapped by a ProTrain engine.")

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
    # The order is traced on the meta device with torch.compile's wrappers running eagerly.
    compiled = any(is_compile_wrapper(m) for m in model.modules())
    with torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext():
        return build_layout(model, block_path, len(block_list), example_inputs=example_inputs, chunk_size=chunk_size,
                            block_aligned=block_aligned(moments),
                            owners=parameter_owners(optimizers) if len(optimizers) > 1 else None)


def check_parameter_dtypes(model: nn.Module, precision: Precision) -> None:
    """Under "32-true" every floating-point parameter must be fp32, and under the mixed modes none
    may be wider (their masters are fp32): ProTrain would otherwise train them in fp32, where plain
    PyTorch (and Lightning's default strategy) would compute and update in their dtype."""
    if precision is Precision.FP32:
        other = [(n, p.dtype) for n, p in model.named_parameters()
                 if p.is_floating_point() and p.dtype != torch.float32]
        fix = ("Cast the model with model.float(), or choose the precision of its dtype: 'bf16-true' for a bf16 "
               "model, 'bf16-mixed' / '16-mixed' for fp32 masters with low-precision compute.")
    elif precision.is_mixed:
        other = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype == torch.float64]
        fix = "Their updates would be rounded to fp32. Cast them to fp32 (model.float()) to train with ProTrain."
    else:
        return
    if other:
        dtypes = sorted({str(d).removeprefix("torch.") for _, d in other})
        raise ValueError(
            f"precision='{precision.value}' trains fp32 {'parameters' if precision is Precision.FP32 else 'masters'}, "
            f"but {len(other)} parameter(s) are {', '.join(dtypes)} (e.g. {other[0][0]}). {fix}"
        )


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
    reprofile: bool | None = None,
    config: ProTrainConfig | None = None,
) -> Profile:
    """Profile ``model`` and ``optimizer`` on one real batch, ``example_inputs``, without
    wrapping them for training (the parameters, the optimizer and the random state are left as
    they were), for ``search`` and the cost models. See ``protrain_core.profiler``.

    ``precision``, ``device``, ``loss_fn``, ``step_fn``: as ``wrap``'s; ``blocks``,
    ``chunk_size``, ``cache`` (``profile_cache``), ``reprofile`` (None: its default): as
    ``PlanningConfig``'s; ``iterations``: timed passes (the median is kept); ``config``: the
    ``ProTrainConfig`` the run will use (its state formats and runtime switches)."""
    prec: Precision = parse_precision(precision)
    dev = as_context(device)
    config = config or ProTrainConfig()
    layout = _prepare(model, optimizer, blocks, chunk_size, example_inputs, dev)
    return profile_model(
        model, optimizer, layout, example_inputs=example_inputs, loss_fn=loss_fn, step_fn=step_fn, precision=prec,
        device=dev, iterations=iterations, cache=cache, switches=config.runtime,
        compile=compile_setting(model, config.compile),
        reprofile=PlanningConfig().reprofile if reprofile is None else reprofile,
        formats=chunk_formats(model, optimizer, layout, prec, config),
    )


# The margin left free by the default budget on CUDA: memory allocated outside PyTorch's caching
# allocator after planning, which the profiler does not see (cuBLAS workspaces per stream, kernels
# loaded lazily, NCCL buffers), and fragmentation beyond the factor measured in one iteration.
# 5 % of the device (4 GiB of an 80 GiB H100), at least 1 GiB, covers these.
CUDA_MARGIN_FRACTION = 0.05
CUDA_MARGIN_MIN_BYTES = 2**30
# On the CPU the "device" is host RAM, shared with everything else on the machine: 10 % stays free.
CPU_MARGIN_FRACTION = 0.10


def default_memory_budget(device: torch.device | DeviceContext) -> int:
    """Free device memory minus a margin (``device_budget``; CPU: ``host_budget`` of the
    available RAM, which a CPU "device" shares with the host side of ProTrain)."""
    if _asynchronous(device):
        free, total = device.free_memory() if isinstance(device, DeviceContext) else torch.cuda.mem_get_info(device)
        return device_budget(free, total)
    available = available_host_bytes()
    if available is None:
        raise ValueError("Cannot read the available memory of this machine; set config.planning.memory_budget explicitly.")
    return host_budget(available)


def default_host_budget(device: torch.device | DeviceContext) -> int | None:
    """Host RAM the streamed chunks and swapped activations may use (CUDA and a simulated GPU;
    None on the CPU, where the device budget already covers the same memory)."""
    if not _asynchronous(device):
        return None
    available = device.available_host_bytes() if isinstance(device, DeviceContext) else available_host_bytes()
    return None if available is None else host_budget(available)


def device_budget(free: int, total: int) -> int:
    """A GPU's memory budget: its free memory less the margin (5 % of the device, >= 1 GiB)."""
    return max(0, free - max(int(total * CUDA_MARGIN_FRACTION), CUDA_MARGIN_MIN_BYTES))


def host_budget(available: int) -> int:
    """What the host side may take of ``available`` host memory: all but the margin (10 %)."""
    return int(available * (1 - CPU_MARGIN_FRACTION))


def _asynchronous(device: torch.device | DeviceContext) -> bool:
    """A device with memory of its own beside the host's (CUDA, a simulated GPU)."""
    return device.asynchronous if isinstance(device, DeviceContext) else device.type == "cuda"
