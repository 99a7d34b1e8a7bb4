"""The profiler's timeline: segment boundaries from hooks, and per-operator memory.

Segment 0 is everything before the first block, 1..L the blocks, L+1 everything after the last
block (head and loss). Boundaries come from hooks: block forward pre/post hooks, gradient
hooks on block inputs and outputs for backward, and the engine's recomputation observer; the
phase between them is a ``TrainingPhase``.
"""

from __future__ import annotations

import enum
import time
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from protrain_core.phase import TrainingPhase
from protrain_core.planner.profiles import OpRecord
from protrain_core.utils import iter_tensors

P = TrainingPhase


class Boundary(enum.Enum):
    """Where one profiled interval ends and the next begins: (name, ``starts``: the phase of the next)."""

    FORWARD = ("forward", P.FORWARD)  # a segment's forward begins
    FORWARD_END = ("forward end", P.IDLE)
    BACKWARD = ("backward", P.BACKWARD)  # a segment's backward begins
    BACKWARD_END = ("backward end", P.IDLE)
    RECOMPUTE = ("recompute", P.RECOMPUTE)  # a checkpointed block's recomputation begins (inside backward)
    RECOMPUTE_END = ("recompute end", P.BACKWARD)

    @property
    def starts(self) -> TrainingPhase:
        return self.value[1]


B = Boundary


class Boundaries:
    """Hooks that time-stamp segment boundaries (the segments of the module docstring).

    Ahead of training the profiler calls the model itself and marks the start of a pass. On
    live training steps (``live``) the first module with parameters that runs with gradients
    marks it, forward passes without gradients (evaluation) are not marked, and ``first_inputs``
    / ``block_inputs`` keep the tensors that module and the first block got (the batch, and what
    the profile's key is made of)."""

    def __init__(self, engine, blocks: list[nn.Module], *, live: bool = False) -> None:
        self.L = len(blocks)
        self.live = live
        self.ctx = engine.ctx
        self.reset()
        self.listener = None  # called with (kind, seg) after each new boundary
        self.chunks: dict[int, set[int]] = defaultdict(set)
        handles = self.handles = []
        for j, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._block_pre(j), with_kwargs=True))
            handles.append(block.register_forward_hook(self._block_post(j)))
        chunk_of = engine.layout.param_chunks(engine.module)
        for m in engine.module.modules():
            idxs = {chunk_of[id(p)] for p in m.parameters(recurse=False)}
            if idxs:
                handles.append(m.register_forward_pre_hook(self._uses(idxs)))
        handles.append(engine.on_recompute(lambda block, begin: self.mark(B.RECOMPUTE if begin else B.RECOMPUTE_END,
                                                                          block + 1)))

    def _uses(self, idxs):
        def hook(_m, args):
            if self.live and (B.FORWARD, 0) not in self.times and torch.is_grad_enabled():
                self.first_inputs = list(iter_tensors(args))
                self.mark(B.FORWARD, 0)
            if self.phase is P.FORWARD:
                self.chunks[self.seg] |= idxs

        return hook

    def _block_pre(self, j: int):
        def hook(_m, args, kwargs):
            if self.live and not torch.is_grad_enabled():
                return
            if j == 0 and self.block_inputs is None:
                self.block_inputs = list(iter_tensors((args, kwargs)))
            if self.live and (B.FORWARD, 0) not in self.times:  # no stem: the first block takes the batch
                self.first_inputs = list(iter_tensors((args, kwargs)))
                self.mark(B.FORWARD, 0)
            self.mark(B.FORWARD, j + 1)
            self._backward_reaches((args, kwargs), j)

        return hook

    def _block_post(self, j: int):
        def hook(_m, _args, out):
            if self.live and not torch.is_grad_enabled():
                return
            if j == self.L - 1:
                self.mark(B.FORWARD, self.L + 1)
            self._backward_reaches(out, j + 1)

        return hook

    def _backward_reaches(self, tensors, seg: int) -> None:
        """Mark the backward of segment ``seg`` when the gradient of one of ``tensors`` arrives."""
        if torch.is_grad_enabled():
            for t in iter_tensors(tensors):
                if t.requires_grad:
                    t.register_hook(lambda _g: self.mark(B.BACKWARD, seg))

    def mark(self, kind: Boundary, seg: int = -1) -> None:
        """A boundary: the interval since the previous one ends where the compute stream has
        got to (its kernels, not the copies or collectives issued beside them), then the device
        is synchronised and the next interval begins -- so a segment's time is its compute
        alone, even when the chunks it uses are streamed."""
        key = (kind, seg)
        if key in self.times:
            return
        end = self.ctx.stamp()
        if self._start is not None:
            self._spans.append((self.phase, self.seg, self._start, end))
        self.ctx.synchronize_device()
        self.times[key] = self.ctx.clock()
        self._start = self.ctx.stamp()
        self.phase = kind.starts
        if seg >= 0:
            self.seg = seg
        if self.listener is not None:
            self.listener(kind, seg)

    def reset(self) -> None:
        self.times: dict[tuple[Boundary, int], float] = {}
        self._start = None  # the compute stream's stamp where the current interval began
        self._spans: list[tuple[P, int, object, object]] = []  # (phase, segment, begin stamp, end stamp)
        self.phase, self.seg = P.IDLE, 0
        self.first_inputs: list | None = None
        self.block_inputs: list | None = None

    def remove(self) -> None:
        """Take the hooks off, and the tensors kept: a kept activation's gradient hook holds these
        boundaries, so they would keep each other -- and the profiled engine with its chunks on
        the device -- alive past the garbage collector."""
        for h in self.handles:
            h.remove()
        self.first_inputs = self.block_inputs = None

    def durations(self) -> tuple[list[float], list[float], list[float]]:
        """Forward, backward (recomputation excluded) and recomputation time per segment: the
        compute of the intervals between boundaries, by the phase and segment they belong to."""
        K = self.L + 2
        out = {P.FORWARD: [0.0] * K, P.BACKWARD: [0.0] * K, P.RECOMPUTE: [0.0] * K}
        for phase, seg, begin, end in self._spans:
            if phase in out:
                out[phase][seg] += max(0.0, self.ctx.elapsed(begin, end))
        return out[P.FORWARD], out[P.BACKWARD], out[P.RECOMPUTE]


class CudaMeter(TorchDispatchMode):
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


class MemoryPass:
    """Collects per-operator records and the live bytes at each boundary."""

    def __init__(self, bounds: Boundaries, live) -> None:
        self.bounds = bounds
        self.live = live  # () -> dynamic bytes now
        self.ops: list[OpRecord] = []
        self.at: dict[tuple[Boundary, int], int] = {}
        self.peaks: dict[tuple[P, int], int] = defaultdict(int)
        self.saved: dict[int, int] = {}
        self.pending: int | None = None  # a block whose recomputation just ended
        self.names = ["pre"] + [f"block.{j}" for j in range(bounds.L)] + ["post"]

    def boundary(self, kind: Boundary, seg: int) -> None:
        live = self.live()
        self._settle(live)
        self.at[(kind, seg)] = live
        if kind == B.RECOMPUTE_END:
            # The recomputation may have stopped early by an exception whose traceback still
            # holds the forward's temporaries: what it saved is read at the next operator.
            self.pending = seg
        if kind in (B.FORWARD, B.BACKWARD):
            key = (kind.starts, seg)
            self.peaks[key] = max(self.peaks[key], live)

    def _settle(self, live: int) -> None:
        if self.pending is not None:
            self.saved[self.pending] = max(0, live - self.at.get((B.RECOMPUTE, self.pending), live))
            self.pending = None

    def op(self, func, before: int, peak: int, seconds: float, after: int | None = None) -> None:
        self._settle(before)
        b = self.bounds
        if b.phase is P.IDLE:
            return
        after = peak if after is None else after
        self.ops.append(OpRecord(segment=self.names[b.seg], phase=b.phase.value, op=str(func.__name__),
                                 seconds=seconds, before=before, peak=peak, after=after))
        key = (b.phase, b.seg)
        self.peaks[key] = max(self.peaks[key], peak)
