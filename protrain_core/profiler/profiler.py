"""The memory-aware profiler: real iterations of the user's model, and hardware probes.

[Note: profiling]
The model is wrapped by a *profiling engine*: the same chunks, hooks and runtime as training,
but without optimizer states (it never steps); the profiler drives it through the engine's
public methods only (``set_block_modes``, ``on_recompute``, ``autocast``, ``device_bytes``).
It runs ``safe_plan`` (so a model that does not fit can be profiled); where the batch's
activations then run out of device memory, the passes start again on a new engine with the
states' share halved, down to every chunk streamed (``torch.OutOfMemoryError`` beyond that).
Every block is checkpointed, so only one block's activations exist at a time -- and every
block's recomputation can be timed and measured. The passes, each a forward, the loss and a backward
(inside ``no_sync``: nothing is updated), run under ``torch.random.fork_rng``, so the user's
parameters and random state are untouched and training afterwards is exactly what it would be
without profiling:
  1. warm-up (lazy initialisation, allocator caches; which chunks each segment uses);
  2. memory: every operator runs under a dispatch mode that records its time and the dynamic
     device bytes before, during and after it (CPU: ``LiveStorageTracker``; CUDA: the caching
     allocator, minus the engine's chunk memory, with a synchronisation per operator), between
     segment boundaries that hooks mark (boundaries.py);
  3. timing, ``iterations`` times without the dispatch mode: the same boundaries with a
     device synchronisation each, median per segment;
  4. without asynchronous copies (a CPU device) the timing again with every block *swapped*:
     there the swap copies add to the block's forward and backward, by an amount the copy
     bandwidth does not predict well (allocation of the copies, per-tensor hook work), so
     it is measured per block. On CUDA a copy stream overlaps compute and swapping every
     block would need host memory for all activations: the bandwidth model is used.
Static facts come from the chunks' format records (``chunk_format.ChunkFormat``), not measured;
``planner/profiles.py`` describes the fields.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import statistics
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from protrain_core.chunk_format import timed_formats
from protrain_core.config import ProTrainConfig
from protrain_core.memtrack import LiveStorageTracker
from protrain_core.phase import TrainingPhase
from protrain_core.plan import BlockMode, Plan, PlanLimits
from protrain_core.planner.profiles import PROFILE_VERSION, Profile, Segment, load_cached, store
from protrain_core.precision import Precision
from protrain_core.profiler.boundaries import Boundaries, Boundary as B, CudaMeter, MemoryPass
from protrain_core.profiler.hardware import probe_hardware
from protrain_core.runtime.compiled import compile_fingerprint
from protrain_core.runtime.device import DeviceContext, as_context
from protrain_core.runtime.elementwise import state_slots
from protrain_core.runtime.engine import RuntimeEngine
from protrain_core.runtime.options import RuntimeConfig
from protrain_core.runtime.sharding import ONE_PROCESS, Sharding, agree
from protrain_core.runtime.state_formats import block_aligned
from protrain_core.runtime.storage import chunk_formats
from protrain_core.runtime.weights import back_to_meta, meta_names
from protrain_core.structure.blocks import block_modules, find_blocks
from protrain_core.structure.layout import ChunkLayout, build_layout
from protrain_core.utils import block_tokens, iter_tensors


# ----- inputs and loss ----------------------------------------------------------------------------
def to_device(inputs, device: torch.device):
    if isinstance(inputs, Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(to_device(v, device) for v in inputs)
    return inputs


def call(model: nn.Module, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def default_loss(output) -> Tensor:
    """``output.loss`` (Hugging Face with labels), a scalar output, or the sum of the first
    floating-point output (same backward cost as a real loss of that output)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, Tensor):
        return loss
    for t in iter_tensors(output if not hasattr(output, "to_tuple") else output.to_tuple()):
        if t.is_floating_point() and t.requires_grad:
            return t if t.dim() == 0 else t.float().sum()
    raise ValueError(
        "The profiler cannot find a loss in the model's output: pass labels in example_inputs "
        "(Hugging Face models return .loss then) or loss_fn=callable(output) -> scalar tensor."
    )


def tensor_shapes(tensors) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each tensor: what a profile's key knows of a batch."""
    return [(tuple(t.shape), str(t.dtype)) for t in tensors]


def profile_key(model, optimizer, batch: list[tuple[tuple[int, ...], str]], precision: Precision,
                device: torch.device | DeviceContext, layout: ChunkLayout, formats, compile=False) -> str:
    """A hash of everything a profile depends on: model structure (parameter names, shapes,
    dtypes, trainability; the Hugging Face config), optimizer coverage, the batch as the first
    block sees it (``tensor_shapes`` of its inputs), precision, chunk layout and the chunks'
    format records (``formats``: one rank's, its shard and formats), device and software, and
    how the units are compiled (``compile``: ``ProTrainConfig.compile``)."""
    h = hashlib.sha256()

    def add(*parts):
        h.update(json.dumps(parts, default=str).encode())

    add("protrain-profile", PROFILE_VERSION)
    add(type(model).__qualname__, [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()])
    add([(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()])
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        add(config.to_json_string(use_diff=False), getattr(config, "_attn_implementation", None))
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    add(type(optimizer).__name__, [id(p) in optimized for p in model.parameters()],
        state_slots(optimizer))
    add(batch)
    add(precision.value, layout.chunk_size, layout.block_path, [c.units for c in layout.chunks])
    add(as_context(device).name(), torch.__version__, torch.version.cuda, torch.get_num_threads(), os.cpu_count())
    add([c.to_dict() for c in formats])
    if (compiled := compile_fingerprint(compile)) is not None:  # (eager profiles keep their keys)
        add("compiled", compiled)
    return h.hexdigest()[:24]


# ----- the profiler -----------------------------------------------------------------------------
# The profiling engine's configuration: it never steps (no optimizer states), and computes alike
# in every state format (the profile carries the run's own records).
PROFILING = ProTrainConfig(optimizer_states=False)

@dataclass
class Measured:
    """What the passes measured (see [Note: profiling])."""

    chunks: dict[int, tuple[int, ...]]  # segment -> chunks its modules use
    base: int  # device bytes neither chunks nor activations
    mem: MemoryPass
    fragmentation: float
    timings: list  # per timed pass: (forward, backward, recomputation) seconds per segment
    swap_timings: list  # the same with every block swapped (no asynchronous copies only)


def profile_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: ChunkLayout,
    *,
    example_inputs,
    loss_fn=None,
    step_fn=None,
    precision: Precision,
    device: torch.device,
    iterations: int = 3,
    cache: bool = True,
    cache_dir=None,
    reprofile: bool = False,
    sharding: Sharding = ONE_PROCESS,
    switches: RuntimeConfig | None = None,
    compile=False,
    formats,
) -> Profile:
    """Profile ``model`` on ``example_inputs`` (one real batch) ahead of training -- or, after
    one pass that shows the batch as the first block sees it, return the cached profile with the
    same key (``reprofile=True`` forces a new one). ``sharding``: the processes the engine will
    be sharded over: each rank profiles its own (unsharded) engine, the collectives are probed,
    and every rank gets rank 0's profile. ``switches``: the runtime switches of the engine to
    be profiled (``ProTrainConfig.runtime``), ``compile``: its units' compilation
    (``ProTrainConfig.compile``: the blocks are timed compiled, after the warm-up compiled them);
    ``formats``: the chunks' records as the engine will allocate them on this rank, which the
    profile carries (the profiled engine computes alike in any format)."""
    ctx = as_context(device)
    inputs = to_device(example_inputs, ctx.device)
    loss_fn = loss_fn or default_loss
    # the output stays alive through backward, as in training
    step_fn = step_fn or (lambda module, batch: (loss_fn(out := call(module, batch)), out))
    start = ctx.clock()

    def passes(engine: RuntimeEngine, bounds: Boundaries):
        _one_pass(engine, bounds, inputs, step_fn)  # warm-up, and the batch as the first block sees it
        shapes = tensor_shapes(bounds.block_inputs or [])
        key = profile_key(model, optimizer, shapes, precision, ctx, layout, formats, compile)
        cached = agree(sharding, load_cached(key, cache_dir, n_chunks=layout.n_chunks, n_blocks=layout.n_blocks)
                       if cache and not reprofile else None)
        return shapes, key, cached if cached is not None else _measure(engine, bounds, inputs, step_fn, iterations)

    profiling = PROFILING.replace(runtime=switches or RuntimeConfig(), compile=compile)
    shapes, key, measured = _fitting(model, optimizer, layout, precision, ctx, profiling, passes)
    if isinstance(measured, Profile):
        return measured
    profile = agree(sharding, build_profile(key, shapes, measured, model, layout, precision, ctx, start, formats,
                                            sharding=sharding, switches=switches))
    if cache and sharding.rank == 0:
        store(profile, cache_dir)
    return profile


def _fitting(model: nn.Module, optimizer, layout: ChunkLayout, precision: Precision, ctx: DeviceContext,
             profiling: ProTrainConfig, passes):
    """``passes(engine, boundaries)`` on a profiling engine of the safe plan, again with the
    states' share of the device halved after each out-of-memory ([Note: profiling])."""
    budget, formats = None, chunk_formats(model, optimizer, layout, precision, PROFILING)
    while True:
        plan = safe_plan(formats, layout.limits(), ctx, budget=budget)
        try:
            return _profiled(model, optimizer, layout, plan, precision, ctx, profiling, passes)
        except torch.OutOfMemoryError as e:
            if plan.n_persist == 0 or not ctx.asynchronous:
                raise torch.OutOfMemoryError(
                    f"Profiling ran out of device memory with every chunk streamed and every block checkpointed: the "
                    f"example batch's activations do not fit on {ctx.name()} ({e}). Profile and train with a smaller "
                    "batch or shorter sequences.") from e
        gc.collect()  # the failed pass's tensors, held by the traceback's frames, before the next engine
        budget = (budget or ctx.free_memory()[0]) // 2


def _profiled(model: nn.Module, optimizer, layout: ChunkLayout, plan: Plan, precision: Precision, ctx: DeviceContext,
              profiling: ProTrainConfig, passes):
    """``passes(engine, boundaries)`` on a profiling engine of ``plan``, then the engine closed;
    the blocks checked to have run."""
    meta = meta_names(model) if ctx.host.type != "meta" else []  # (filled by their initialisation to profile)
    with torch.random.fork_rng(devices=[ctx.device] if ctx.is_cuda else []):
        engine = RuntimeEngine(model, optimizer, layout, plan, precision, ctx, profiling, warn_on_cache=False)
        bounds = Boundaries(engine, block_modules(model, layout.block_path))
        try:
            with _buffers_kept(model):
                found = passes(engine, bounds)
        finally:
            bounds.remove()
            engine.close()  # (closed, it is freed when its last reference goes: no cycle holds it)
            back_to_meta(model, meta)
    check_blocks_called(bounds)
    return found


@contextmanager
def _buffers_kept(model: nn.Module):
    """The model's buffers as they were before (what the passes' forwards update, BatchNorm's
    running statistics, is put back: the passes are not the user's steps)."""
    with torch.no_grad():
        kept = {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers() if not b.is_meta}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in kept:
                    b.copy_(kept[name])


def build_profile(key: str, shapes, measured: Measured, model, layout: ChunkLayout, precision: Precision,
                  ctx: DeviceContext, start: float, formats, sharding: Sharding = ONE_PROCESS, switches: RuntimeConfig | None = None) -> Profile:
    """The Profile of what the passes measured, the chunks' records ``formats`` and the hardware
    probes, in their formats (with ``sharding``: the collectives' bandwidths too, a collective
    call; ``switches``: the engine's runtime switches, which the probes follow)."""
    moments, frozen = timed_formats(formats)
    hardware = probe_hardware(ctx, layout.chunk_size, precision, sharding=sharding, switches=switches,
                              state_format=moments, frozen_format=frozen)
    n_params = sum(p.numel() for p in model.parameters())
    return Profile(
        key=key,
        description=f"{type(model).__name__}, {n_params:,} parameters, {layout.n_blocks} blocks, first block's inputs "
                    + ", ".join(str(shape) for shape, _ in shapes),
        precision=precision.value,
        chunks=tuple(formats),
        resident_sets=layout.resident_sets,
        segments=_segments(measured, layout.n_blocks),
        base_bytes=measured.base,
        fragmentation=measured.fragmentation,
        hardware=hardware,
        ops=tuple(measured.mem.ops),
        tokens=block_tokens(shapes),
        iterations=len(measured.timings),
        profile_seconds=ctx.clock() - start,
    )


def for_world_size(profile: Profile, model: nn.Module, optimizer, precision: Precision, world_size: int,
                   collective_bytes_per_s: float) -> Profile:
    """What ``profile`` (measured in one process) predicts with the chunks sharded over
    ``world_size`` processes: one rank's static bytes, and all-gathers and reduce-scatters at
    ``collective_bytes_per_s`` (assumed: one process cannot measure them). The batch is each
    rank's. ``protrain plan --world-size`` prints this what-if."""
    block_path, blocks = find_blocks(model, None)
    layout = build_layout(model, block_path, len(blocks), chunk_size=profile.chunks[0].numel,
                          block_aligned=block_aligned(profile.state_format))
    hw = dataclasses.replace(profile.hardware, gather_bytes_per_s=collective_bytes_per_s,
                             reduce_bytes_per_s=collective_bytes_per_s)
    moments, frozen = timed_formats(profile.chunks)
    config = ProTrainConfig(optimizer_state_format=moments, frozen_dtype=frozen,
                            grad_accumulator=None if all(c.accumulator for c in profile.chunks) else False)
    formats = chunk_formats(model, optimizer, layout, precision, config, world_size=world_size)
    return dataclasses.replace(profile, hardware=hw, chunks=tuple(formats), resident_sets=layout.resident_sets)


def safe_plan(formats, limits: PlanLimits, device: torch.device | DeviceContext, *, budget: int | None = None) -> Plan:
    """A plan any batch the profiler measures can run on: every block checkpointed, and the model
    states of the chunks' records ``formats`` (with or without Adam's, as the engine allocates
    them) in at most half the device budget (default: the free memory). On a CPU, or when they
    fit there, every chunk is persistent; else the leading chunks that fit there beside the
    chunk buffers are, and the rest are streamed -- the fewest host bytes such a plan can have
    (streaming every chunk would ask the host for all the states, more than it may hold)."""
    n, L = limits.n_chunks, limits.n_blocks
    ctx = as_context(device)
    if ctx.asynchronous:
        half = (budget if budget is not None else ctx.free_memory()[0]) // 2
        if sum(fmt.persistent_device_bytes for fmt in formats) > half:
            used = max(2, limits.buffers_needed(0)) * max(fmt.buffer_device_bytes for fmt in formats)
            k = 0
            while k < n and used + formats[k].persistent_device_bytes <= half:
                used += formats[k].persistent_device_bytes
                k += 1
            return Plan(n_persist=k, n_buffer=max(2, limits.buffers_needed(k)), n_checkpoint=L)
    return Plan(n_persist=n, n_buffer=0, n_checkpoint=L)


def _measure(engine: RuntimeEngine, bounds: Boundaries, inputs, step_fn, iterations: int) -> Measured:
    """The passes of [Note: profiling] after the warm-up, on the profiling engine."""
    L, ctx = engine.layout.n_blocks, engine.ctx
    chunks = {s: tuple(sorted(c)) for s, c in bounds.chunks.items()}
    base = base_bytes(engine, inputs)
    mem, meter = memory_meter(engine, bounds)
    bounds.listener = mem.boundary
    one_pass = functools.partial(_one_pass, engine, bounds, inputs, step_fn)
    with meter:
        one_pass()
    bounds.listener = None
    timings, swap_timings = [one_pass() for _ in range(max(1, iterations))], []
    if not ctx.asynchronous and L:  # no asynchronous copies: measure what swapping adds
        engine.set_block_modes((BlockMode.SWAP,) * L)
        one_pass()  # warm-up: host buffers
        swap_timings = [one_pass() for _ in range(max(1, iterations))]
    return Measured(chunks, base, mem, fragmentation_factor(ctx), timings, swap_timings)


def _segments(m: Measured, L: int) -> tuple[Segment, ...]:
    """Per segment: median times of the timed passes, and the memory pass's byte deltas."""
    K = L + 2
    mem = m.mem

    def med(i: int, s: int, runs) -> float:
        return statistics.median(t[i][s] for t in runs)

    def swap_cost(i: int, s: int) -> float | None:
        if not m.swap_timings or not 0 < s < K - 1:
            return None
        return max(0.0, med(i, s, m.swap_timings) - med(i, s, m.timings))

    segments = []
    for s in range(K):
        L_s = mem.at[(B.FORWARD, s)]
        L_next = mem.at[(B.FORWARD, s + 1)] if s + 1 < K else mem.at[(B.FORWARD_END, -1)]
        recompute = (TrainingPhase.RECOMPUTE, s)
        segments.append(Segment(
            name=mem.names[s],
            kind="pre" if s == 0 else "post" if s == K - 1 else "block",
            chunks=m.chunks.get(s, ()),
            fwd_s=med(0, s, m.timings),
            bwd_s=med(1, s, m.timings),
            recompute_s=med(2, s, m.timings),
            out_bytes=max(0, L_next - L_s),
            saved_bytes=mem.saved.get(s, 0),
            fwd_peak_bytes=max(0, mem.peaks[(TrainingPhase.FORWARD, s)] - L_s),
            bwd_peak_bytes=max(0, mem.peaks[(TrainingPhase.BACKWARD, s)] - L_s),
            recompute_peak_bytes=max(0, mem.peaks[recompute] - L_s) if recompute in mem.peaks else 0,
            swap_out_s=swap_cost(0, s),
            swap_in_s=swap_cost(1, s),
        ))
    return tuple(segments)


def _one_pass(engine: RuntimeEngine, bounds: Boundaries, inputs, step_fn) -> tuple[list[float], ...]:
    """One forward, loss and backward; its ``Boundaries.durations``."""
    bounds.reset()
    bounds.mark(B.FORWARD, 0)  # also when step_fn calls a submodule, not the wrapped module itself
    with engine.autocast():
        loss = step_fn(engine.module, inputs)
    kept = None
    if isinstance(loss, tuple):  # (loss, what the caller keeps alive until after backward)
        loss, kept = loss
    bounds.mark(B.FORWARD_END)
    bounds.mark(B.BACKWARD, bounds.L + 1)
    with engine.no_sync():
        engine.backward(loss)
    bounds.mark(B.BACKWARD_END)
    del loss, kept
    engine.zero_grad()
    return bounds.durations()


def memory_meter(engine: RuntimeEngine, bounds: Boundaries):
    """(MemoryPass, the dispatch mode that feeds it the operators; the caller feeds it the
    boundaries): enter the mode around one pass. CPU (and a simulated device): the tensor
    tracker; CUDA: the caching allocator, minus the engine's chunk memory."""
    device = engine.device
    if engine.ctx.is_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        static = engine.memory.device_bytes
        mem = MemoryPass(bounds, lambda: torch.cuda.memory_allocated(device) - static())
        mode = CudaMeter(device, static, mem.op)
    else:
        mode = LiveStorageTracker(device, on_op=lambda *op: mem.op(*op))
        mem = MemoryPass(bounds, lambda: mode.live)
    return mem, mode if engine.compiled is None else _eager(mode)


@contextmanager
def _eager(mode):
    """``mode`` with compiled units run eagerly: dynamo does not trace under a dispatch mode
    ([Note: compiled units])."""
    with torch.compiler.set_stance("force_eager"), mode:
        yield


def fragmentation_factor(ctx: DeviceContext) -> float:
    """Reserved over allocated at the peak (CUDA): the caching allocator's rounding and splitting."""
    if not ctx.is_cuda:
        return 1.0
    reserved, allocated = torch.cuda.max_memory_reserved(ctx.device), torch.cuda.max_memory_allocated(ctx.device)
    return min(1.5, max(1.0, reserved / max(1, allocated)))


def base_bytes(engine, inputs) -> int:
    """Device bytes alive through the iteration that are neither chunks nor activations."""
    if engine.ctx.is_cuda:
        torch.cuda.synchronize(engine.device)
        return max(0, torch.cuda.memory_allocated(engine.device) - engine.memory.device_bytes())
    storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()  # (meta storages have no address)
                for t in [*iter_tensors(inputs), *engine.module.buffers()]}
    return sum(storages.values())


def check_blocks_called(bounds: Boundaries) -> None:
    missing = [j for j in range(bounds.L) if (B.FORWARD, j + 1) not in bounds.times]
    if missing:
        raise ValueError(
            f"The profiled forward pass did not call blocks {missing[:8]} of the block list; "
            "pass blocks= naming the ModuleList whose blocks run in order."
        )
