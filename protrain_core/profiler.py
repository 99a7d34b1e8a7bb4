"""The memory-aware profiler: real iterations of the user's model, and hardware probes.

[Note: profiling]
The model is wrapped by a *profiling engine*: the same chunks, hooks and runtime as training,
but without optimizer states (it never steps). On CUDA its chunks are all persistent when their
parameters and gradients fit in half the free memory, otherwise they are streamed through
buffers (so a model that does not fit can be profiled); on the CPU they are persistent. Every
block is checkpointed, so only one block's activations exist at a time -- and every block's
recomputation can be timed and measured. The passes, each a forward, the loss and a backward
(inside ``no_sync``: nothing is updated), run under ``torch.random.fork_rng``, so the user's
parameters and random state are untouched and training afterwards is exactly what it would be
without profiling:
  1. warm-up (lazy initialisation, allocator caches; which chunks each segment uses);
  2. memory: every operator runs under a dispatch mode that records its time and the dynamic
     device bytes before, during and after it (CPU: ``LiveStorageTracker``; CUDA: the caching
     allocator, minus the engine's chunk memory, with a synchronisation per operator). Segment
     boundaries come from hooks (block forward pre/post hooks; gradient hooks on block inputs
     and outputs for backward; the activation manager's recomputation observer);
  3. timing, ``iterations`` times without the dispatch mode: the same boundaries with a
     device synchronisation each, median per segment;
  4. without asynchronous copies (a CPU device) the timing again with every block *swapped*:
     there the swap copies add to the block's forward and backward, by an amount the copy
     bandwidth does not predict well (allocation of the copies, per-tensor hook work), so
     it is measured per block. On CUDA a copy stream overlaps compute and swapping every
     block would need host memory for all activations: the bandwidth model is used.
Static facts (chunk sizes, trainable elements, the bytes of a chunk when persistent or
streamed) are computed from the layout, not measured. See ``profiles.py`` for the fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections import defaultdict

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import protrain_core
from protrain_core.activations import BlockMode
from protrain_core.layout import ChunkLayout, unit_chunks, with_persistence
from protrain_core.memtrack import LiveStorageTracker
from protrain_core.plan import Plan
from protrain_core.precision import Precision
from protrain_core.profiles import PROFILE_VERSION, Hardware, OpRecord, Profile, Segment, load_cached, store
from protrain_core.utils import iter_tensors, total_host_bytes


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


# ----- static facts -----------------------------------------------------------------------------
def chunk_facts(layout: ChunkLayout, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision):
    """Per chunk: trainable elements, has gradients, device bytes when persistent, host bytes
    when streamed -- exactly what the engine allocates (engine._allocate)."""
    params = dict(model.named_parameters())
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
    S, cb, mb, mixed = layout.chunk_size, precision.compute_dtype.itemsize, precision.master_dtype.itemsize, precision.is_mixed
    trainable, has_grad, persist, host = [], [], [], []
    for spec in layout.chunks:
        ps = [params[m.name] for m in spec.members]
        grad = any(p.requires_grad for p in ps)
        opt = sum(p.numel() for p in ps if p.requires_grad and id(p) in optimized)
        states = (3 if amsgrad else 2) * mb * S if opt else 0
        trainable.append(opt)
        has_grad.append(grad)
        # Without mixed precision the compute copy is the master (cb == mb).
        persist.append(S * cb + (mb * S if mixed else 0) + (mb * S if grad else 0) + states)
        host.append(mb * S + (S * cb if mixed else 0) + (mb * S if grad else 0) + states)
    return tuple(trainable), tuple(has_grad), tuple(persist), tuple(host)


def profile_key(model, optimizer, inputs, precision: Precision, device: torch.device, layout: ChunkLayout, extra="") -> str:
    """A hash of everything a profile depends on: model structure (parameter names, shapes,
    dtypes, trainability; the Hugging Face config), optimizer coverage, batch shapes, precision,
    chunk layout, device and software."""
    h = hashlib.sha256()

    def add(*parts):
        h.update(json.dumps(parts, default=str).encode())

    add("protrain-profile", PROFILE_VERSION, protrain_core.__name__)
    add(type(model).__qualname__, [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()])
    add([(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()])
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        add(config.to_json_string(use_diff=False), getattr(config, "_attn_implementation", None))
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    add(type(optimizer).__name__, [id(p) in optimized for p in model.parameters()],
        [bool(g.get("amsgrad", False)) for g in optimizer.param_groups])
    add([(tuple(t.shape), str(t.dtype)) for t in iter_tensors(inputs)],
        sorted(inputs) if isinstance(inputs, dict) else None)
    add(precision.value, layout.chunk_size, layout.block_path, [c.units for c in layout.chunks])
    add(_device_name(device), torch.__version__, torch.version.cuda, torch.get_num_threads(), os.cpu_count(), extra)
    return h.hexdigest()[:24]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ----- hardware probes --------------------------------------------------------------------------
def _median_time(fn, sync, *, budget_s: float = 0.15, max_reps: int = 20) -> float:
    fn()
    sync()
    times = []
    spent = 0.0
    while len(times) < max_reps and (len(times) < 3 or spent < budget_s):
        t = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return statistics.median(times)


def probe_hardware(device: torch.device, chunk_elems: int, precision: Precision) -> Hardware:
    """Chunk-size copies each way and Adam on one chunk, as the runtime performs them.

    CUDA: pinned host buffer <-> device buffer; CPU Adam on host tensors (plus the
    compute-dtype copy back in mixed precision, as the worker does); device Adam on device
    tensors. CPU device: the "copies" are what the runtime does there too, memory copies between
    two host tensors, and the persistent chunks' Adam is the same CPU kernel."""
    n = max(1024, min(chunk_elems, 64 * 2**20))
    cdt = precision.compute_dtype
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    host = torch.empty(n, dtype=cdt, pin_memory=cuda)
    dev = torch.empty(n, dtype=cdt, device=device)
    host.fill_(1)
    dev.fill_(1)
    nbytes = n * cdt.itemsize
    if cuda:
        h2d = nbytes / _median_time(lambda: dev.copy_(host, non_blocking=True), sync)
        d2h = nbytes / _median_time(lambda: host.copy_(dev, non_blocking=True), sync)
    else:
        # The CPU runtime allocates a chunk's "device" buffer (and gradient buffer) anew for
        # every upload (and offload): fresh pages, so the probe allocates too.
        h2d = nbytes / _median_time(lambda: torch.empty(n, dtype=cdt).copy_(host), sync)
        d2h = nbytes / _median_time(lambda: host.copy_(torch.zeros(n, dtype=cdt)), sync)
    del host, dev

    def adam_rate(on: torch.device, with_copy: bool) -> float:
        from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision

        p, g, m, v = (torch.zeros(n, device=on) for _ in range(4))
        g.fill_(1e-3)
        steps = [torch.zeros((), device=on)]
        hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        low = torch.empty(n, dtype=cdt, device=on) if with_copy else None
        s = (lambda: torch.cuda.synchronize(on)) if on.type == "cuda" else (lambda: None)

        def step():
            adam_step([p], [g], [m], [v], [], steps, hp)
            if low is not None:
                copy_to_low_precision(low, p)

        return n / _median_time(step, s)

    mixed = precision.is_mixed
    cpu_rate = adam_rate(torch.device("cpu"), mixed)
    dev_rate = adam_rate(device, mixed) if cuda else cpu_rate
    total = torch.cuda.get_device_properties(device).total_memory if cuda else total_host_bytes()
    return Hardware(
        device=_device_name(device),
        async_copies=cuda,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        cpu_adam_params_per_s=cpu_rate,
        device_adam_params_per_s=dev_rate,
        device_memory_bytes=int(total),
    )


# ----- boundaries -------------------------------------------------------------------------------
class _Boundaries:
    """Hooks that time-stamp segment boundaries: segment 0 is everything before the first block,
    1..L the blocks, L+1 everything after the last block (head and loss)."""

    def __init__(self, engine, blocks: list[nn.Module]) -> None:
        self.engine = engine
        self.L = len(blocks)
        self.sync = engine.ctx.synchronize_device
        self.times: dict[tuple[str, int], float] = {}
        self.phase, self.seg = "idle", 0
        self.listener = None  # called with (kind, seg) after each new boundary
        self.chunks: dict[int, set[int]] = defaultdict(set)
        handles = [engine.module.register_forward_pre_hook(lambda _m, _a: self.mark("fwd", 0))]
        for j, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._block_pre(j), with_kwargs=True))
            handles.append(block.register_forward_hook(self._block_post(j)))
        slot_of = engine._slot_of
        for m in engine.module.modules():
            own = [p for p in m.parameters(recurse=False)]
            if own:
                idxs = {slot_of[id(p)][0].index for p in own}
                handles.append(m.register_forward_pre_hook(self._uses(idxs)))
        self.handles = handles
        engine.activations.observer = self._recompute

    def _uses(self, idxs):
        def hook(_m, _a):
            if self.phase == "forward":
                self.chunks[self.seg] |= idxs

        return hook

    def _block_pre(self, j: int):
        def hook(_m, args, kwargs):
            self.mark("fwd", j + 1)
            if torch.is_grad_enabled():
                for t in iter_tensors((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(lambda _g: self.mark("bwd", j))

        return hook

    def _block_post(self, j: int):
        def hook(_m, _args, out):
            if j == self.L - 1:
                self.mark("fwd", self.L + 1)
            if torch.is_grad_enabled():
                for t in iter_tensors(out):
                    if t.requires_grad:
                        t.register_hook(lambda _g: self.mark("bwd", j + 1))

        return hook

    def _recompute(self, event: str, block: int) -> None:
        self.mark("rec_begin" if event == "recompute_begin" else "rec_end", block + 1)

    def mark(self, kind: str, seg: int = -1) -> None:
        key = (kind, seg)
        if key in self.times:
            return
        self.sync()
        self.times[key] = time.perf_counter()
        if kind == "fwd":
            self.phase, self.seg = "forward", seg
        elif kind == "bwd":
            self.phase, self.seg = "backward", seg
        elif kind == "rec_begin":
            self.phase, self.seg = "recompute", seg
        elif kind == "rec_end":
            self.phase, self.seg = "backward", seg
        else:
            self.phase = kind
        if self.listener is not None:
            self.listener(kind, seg)

    def reset(self) -> None:
        self.times = {}
        self.phase, self.seg = "idle", 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.engine.activations.observer = None

    def durations(self) -> tuple[list[float], list[float], list[float]]:
        """Forward, backward (recomputation excluded) and recomputation time per segment."""
        t, K = self.times, self.L + 2
        fwd = []
        for s in range(K):
            end = t[("fwd", s + 1)] if s + 1 < K else t[("fwd_end", -1)]
            fwd.append(end - t[("fwd", s)])
        end_all = t[("bwd_end", -1)]
        start = {K - 1: t[("bwd", K - 1)]}
        for s in range(K - 2, -1, -1):
            start[s] = t.get(("bwd", s), end_all)  # no gradient into block 0 -> no "pre" backward
        rec = [t[("rec_end", s)] - t[("rec_begin", s)] if ("rec_begin", s) in t and ("rec_end", s) in t else 0.0
               for s in range(K)]
        bwd = []
        for s in range(K):
            end = start[s - 1] if s > 0 else end_all
            bwd.append(max(0.0, end - start[s] - rec[s]))
        return fwd, bwd, rec


class _CudaMeter(TorchDispatchMode):
    """Per operator on CUDA: dynamic bytes (allocated minus the engine's chunk memory) before,
    at the peak during (the allocator's peak statistic, reset per operator) and after; time
    with a synchronisation."""

    def __init__(self, device: torch.device, static_bytes, on_op) -> None:
        super().__init__()
        self.device = device
        self.static_bytes = static_bytes
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        static = self.static_bytes()
        before = torch.cuda.memory_allocated(self.device) - static
        torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(self.device) - static
        after = torch.cuda.memory_allocated(self.device) - static
        self.on_op(func, before, max(peak, after), seconds, after)
        return out


class _MemoryPass:
    """Collects per-operator records and the live bytes at each boundary."""

    def __init__(self, bounds: _Boundaries, live) -> None:
        self.bounds = bounds
        self.live = live  # () -> dynamic bytes now
        self.ops: list[OpRecord] = []
        self.at: dict[tuple[str, int], int] = {}
        self.peaks: dict[tuple[str, int], int] = defaultdict(int)
        self.rec_begin: dict[int, int] = {}
        self.saved: dict[int, int] = {}
        self.pending: int | None = None  # a block whose recomputation just ended
        self.names = ["pre"] + [f"block.{j}" for j in range(bounds.L)] + ["post"]

    def boundary(self, kind: str, seg: int) -> None:
        live = self.live()
        self._settle(live)
        self.at[(kind, seg)] = live
        if kind == "rec_begin":
            self.rec_begin[seg] = live
        elif kind == "rec_end":
            # The recomputation may have stopped early by an exception whose traceback still
            # holds the forward's temporaries: what it saved is read at the next operator.
            self.pending = seg
        phase = {"fwd": "forward", "bwd": "backward"}.get(kind)
        if phase is not None:
            key = (phase, seg)
            self.peaks[key] = max(self.peaks[key], live)

    def _settle(self, live: int) -> None:
        if self.pending is not None:
            seg = self.pending
            self.saved[seg] = max(0, live - self.rec_begin.get(seg, live))
            self.pending = None

    def op(self, func, before: int, peak: int, seconds: float, after: int | None = None) -> None:
        self._settle(before)
        b = self.bounds
        if b.phase not in ("forward", "backward", "recompute"):
            return
        after = peak if after is None else after
        self.ops.append(OpRecord(segment=self.names[b.seg], phase=b.phase, op=str(func.__name__),
                                 seconds=seconds, before=before, peak=peak, after=after))
        key = (b.phase, b.seg)
        self.peaks[key] = max(self.peaks[key], peak)


# ----- the profiler -----------------------------------------------------------------------------
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
    description: str | None = None,
) -> Profile:
    """Profile ``model`` on ``example_inputs`` (one real batch) -- or return the cached profile
    with the same key (``reprofile=True`` or ``PROTRAIN_REPROFILE=1`` forces a new one)."""
    from protrain_core.engine import Engine  # engine imports the planner, which imports this

    loss_fn = loss_fn or default_loss
    inputs = to_device(example_inputs, device)
    extra = getattr(step_fn or loss_fn, "__qualname__", "")
    key = profile_key(model, optimizer, inputs, precision, device, layout, extra=extra)
    if step_fn is None:
        def step_fn(module, batch):
            out = call(module, batch)
            return loss_fn(out), out  # the output stays alive through backward, as in training

    reprofile = reprofile or os.environ.get("PROTRAIN_REPROFILE", "") not in ("", "0")
    if cache and not reprofile:
        cached = load_cached(key, cache_dir)
        if cached is not None:
            return cached

    start = time.perf_counter()
    trainable, has_grad, persist_b, host_b = chunk_facts(layout, model, optimizer, precision)
    n_chunks = layout.n_chunks
    blocks = list(model.get_submodule(layout.block_path))
    L = len(blocks)
    hardware = probe_hardware(device, layout.chunk_size, precision)

    # Chunks persistent (CPU, or parameters and gradients fit in half the free memory) or streamed.
    n_persist, n_buffer = n_chunks, 0
    if device.type == "cuda":
        per_chunk = layout.chunk_size * (precision.compute_dtype.itemsize + 4 + (4 if precision.is_mixed else 0))
        free, _ = torch.cuda.mem_get_info(device)
        if per_chunk * n_chunks > free // 2:
            n_persist, n_buffer = 0, max(2, min_buffers(model, layout))
    plan = Plan(n_persist=n_persist, n_buffer=n_buffer, n_swap=0, n_checkpoint=L)
    engine = Engine(model, optimizer, with_persistence(layout, n_persist), plan, precision, device, False,
                    optimizer_states=False)
    engine.activations._warned_cache = True  # the profiler's layout, not the user's choice
    bounds = _Boundaries(engine, blocks)
    timings: list[tuple[list[float], list[float], list[float]]] = []
    swap_timings: list[tuple[list[float], list[float], list[float]]] = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _one_pass(engine, bounds, inputs, step_fn)  # warm-up
            chunks = {s: tuple(sorted(c)) for s, c in bounds.chunks.items()}
            base = _base_bytes(engine, inputs, device)
            mem, fragmentation = _memory_pass(engine, bounds, inputs, step_fn, device)
            for _ in range(max(1, iterations)):
                _one_pass(engine, bounds, inputs, step_fn)
                timings.append(bounds.durations())
            if not hardware.async_copies and L:
                engine._set_block_modes((BlockMode.SWAP,) * L)
                engine.activations._warned_cache = True
                _one_pass(engine, bounds, inputs, step_fn)  # warm-up: host buffers
                for _ in range(max(1, iterations)):
                    _one_pass(engine, bounds, inputs, step_fn)
                    swap_timings.append(bounds.durations())
    finally:
        bounds.remove()
        engine.close()
    _check_blocks_called(bounds, L)

    def med(i: int, s: int, runs=timings) -> float:
        return statistics.median(t[i][s] for t in runs)

    def swap_cost(i: int, s: int) -> float | None:
        if not swap_timings or not 0 < s < K - 1:
            return None
        return max(0.0, med(i, s, swap_timings) - med(i, s))

    K = L + 2
    segments = []
    for s in range(K):
        kind = "pre" if s == 0 else "post" if s == K - 1 else "block"
        L_s = mem.at[("fwd", s)]
        L_next = mem.at[("fwd", s + 1)] if s + 1 < K else mem.at[("fwd_end", -1)]
        segments.append(
            Segment(
                name=mem.names[s],
                kind=kind,
                chunks=chunks.get(s, ()),
                fwd_s=med(0, s),
                bwd_s=med(1, s),
                recompute_s=med(2, s),
                out_bytes=max(0, L_next - L_s),
                saved_bytes=mem.saved.get(s, 0),
                fwd_peak_bytes=max(0, mem.peaks[("forward", s)] - L_s),
                bwd_peak_bytes=max(0, mem.peaks[("backward", s)] - L_s),
                recompute_peak_bytes=max(0, mem.peaks[("recompute", s)] - L_s) if ("recompute", s) in mem.peaks else 0,
                swap_out_s=swap_cost(0, s),
                swap_in_s=swap_cost(1, s),
            )
        )
    n_params = sum(p.numel() for p in model.parameters())
    shapes = ", ".join(f"{tuple(t.shape)}" for t in iter_tensors(inputs))
    profile = Profile(
        key=key,
        description=description or f"{type(model).__name__}, {n_params:,} parameters, {L} blocks, batch {shapes}",
        precision=precision.value,
        n_chunks=n_chunks,
        chunk_elems=layout.chunk_size,
        compute_bytes=precision.compute_dtype.itemsize,
        chunk_trainable=trainable,
        chunk_has_grad=has_grad,
        persist_bytes=persist_b,
        host_bytes=host_b,
        min_buffers=min_buffers(model, layout),
        adam_in_backward=precision is not Precision.FP16_MIXED,
        segments=tuple(segments),
        base_bytes=base,
        fragmentation=fragmentation,
        hardware=hardware,
        ops=tuple(mem.ops),
        iterations=len(timings),
        profile_seconds=time.perf_counter() - start,
    )
    if cache:
        store(profile, cache_dir)
    return profile


def _one_pass(engine, bounds: _Boundaries, inputs, step_fn) -> None:
    bounds.reset()
    bounds.mark("fwd", 0)  # also when step_fn calls a submodule, not the wrapped module itself
    loss = step_fn(engine.module, inputs)
    kept = None
    if isinstance(loss, tuple):  # (loss, what the caller keeps alive until after backward)
        loss, kept = loss
    bounds.mark("fwd_end")
    bounds.mark("bwd", bounds.L + 1)
    with engine.no_sync():
        engine.backward(loss)
    bounds.mark("bwd_end")
    del loss, kept
    engine.zero_grad()


def _memory_pass(engine, bounds: _Boundaries, inputs, step_fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        static = engine.device_bytes
        mem = _MemoryPass(bounds, lambda: torch.cuda.memory_allocated(device) - static())
        mode = _CudaMeter(device, static, mem.op)
    else:
        tracker = LiveStorageTracker(device, on_op=lambda f, b, a, s: mem.op(f, b, a, s))
        mem = _MemoryPass(bounds, lambda: tracker.live)
        mode = tracker
    bounds.listener = mem.boundary
    try:
        with mode:
            _one_pass(engine, bounds, inputs, step_fn)
    finally:
        bounds.listener = None
    fragmentation = 1.0
    if device.type == "cuda":
        # Reserved over allocated at the peak: the caching allocator's rounding and splitting.
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        fragmentation = min(1.5, max(1.0, reserved / max(1, allocated)))
    return mem, fragmentation


def _base_bytes(engine, inputs, device: torch.device) -> int:
    """Device bytes alive through the iteration that are neither chunks nor activations."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.memory_allocated(device) - engine.device_bytes())
    seen, total = set(), 0
    for t in list(iter_tensors(inputs)) + list(engine.module.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _check_blocks_called(bounds: _Boundaries, L: int) -> None:
    missing = [j for j in range(L) if ("fwd", j + 1) not in bounds.times]
    if missing:
        raise ValueError(
            f"The profiled forward pass did not call blocks {missing[:8]} of the block list; "
            "pass blocks= naming the ModuleList whose blocks run in order."
        )


def min_buffers(model: nn.Module, layout: ChunkLayout) -> int:
    """The most chunks one hooked module (a block, or a module owning parameters) needs at once."""
    return max((len(idxs) for idxs in unit_chunks(model, layout).values()), default=1)
