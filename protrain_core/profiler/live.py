"""Profiling on the first real training steps.

[Note: live profiling]
``wrap(plan=None)`` without ``example_inputs`` builds the engine on a *safe plan* (``safe_plan``
in profiler.py) and attaches a ``LiveProfiler``. The user's training steps run exactly as they
would anyway: their gradients are applied, nothing runs twice. The profiler only watches them,
through the engine's public seams (``observe``, ``on_recompute``, ``set_block_modes``) and hooks
of its own ([Note: profiling] in profiler.py says what is measured):
  step 1       the memory pass (its first micro-batch): every operator under a dispatch mode,
               the segment boundaries, the chunks each segment uses, the bytes of the batch. At
               the first block the batch shape is known: a profile cached for this model and
               shape ends profiling with this step;
  steps 2-3    timing (the median of the two);
  steps 4-6    without asynchronous copies (a CPU device) every block swapped: one step warms
               the host buffers up, two are timed (what swapping adds is measured per block).
With compiled units (``ProTrainConfig.compile``) the memory pass runs them eagerly and one step
after it compiles them, untimed: the timing steps and the swap steps come one later.
A micro-batch's times are scaled to the tokens of the memory pass's batch, so batches of other
lengths in the timed steps measure the same thing. Then the hardware is probed, the profile
built and cached, and ``on_profile`` gets it -- the planner (autoplan.py) searches and
switches the engine to the plan it found, between two steps. None of this changes what is
computed (a plan does not change the numerics: [Note: chunk lifecycle] in runtime/chunk.py), so
training equals plain PyTorch from the first step on.
"""

from __future__ import annotations

from dataclasses import dataclass

from protrain_core.phase import StepObserver
from protrain_core.plan import BlockMode
from protrain_core.planner.profiles import Profile, load_cached, store
from protrain_core.profiler.boundaries import Boundaries, Boundary as B
from protrain_core.profiler.profiler import (
    Measured, base_bytes, build_profile, check_blocks_called, fragmentation_factor, memory_meter, profile_key,
    tensor_shapes,
)
from protrain_core.runtime.engine import RuntimeEngine
from protrain_core.structure.blocks import block_modules
from protrain_core.runtime.sharding import agree
from protrain_core.utils import batch_tokens, block_tokens

TIMED_STEPS = 2


@dataclass(frozen=True)
class LiveProfile:
    """What ``LiveProfiler`` hands over when it is done."""

    profile: Profile
    steps: int  # training steps profiled (1 when the profile came from the cache)
    seconds: float  # from the first profiled step's forward to now, hardware probes included
    cached: bool
    tokens: int  # the first block's tokens in the profiled batch (the profile's, unless cached)
    batch_tokens: int  # ``utils.batch_tokens`` of the same batch as the engine saw it (0: unknown)


class LiveProfiler(StepObserver):
    """Profiles an engine's first training steps (see the Note), then calls ``on_profile``
    with a ``LiveProfile``."""

    def __init__(self, engine: RuntimeEngine, *, on_profile, on_unfinished=None, cache: bool = True, reprofile: bool = False,
                 cache_dir=None) -> None:
        """``on_unfinished(steps)``: the engine closed before profiling was over."""
        self.engine, self.on_profile, self.on_unfinished = engine, on_profile, on_unfinished
        self.cache, self.reprofile, self.cache_dir = cache, reprofile, cache_dir
        self.formats = tuple(c.storage.fmt for c in engine.chunks)  # the records the profile carries
        blocks = block_modules(engine.module, engine.layout.block_path)
        self.L = len(blocks)
        self.bounds = Boundaries(engine, blocks, live=True)
        self.bounds.listener = self._boundary
        swaps = not engine.ctx.asynchronous  # no asynchronous copies: measure what swapping adds
        # Compiled units compile in the step after the memory pass (which runs them eagerly), not in a timed one.
        warm = ["compile-warm-up"] if engine.compiled is not None else []
        self.schedule = ["memory"] + warm + ["time"] * TIMED_STEPS + (["swap-warm-up"] + ["swap"] * TIMED_STEPS if swaps else [])
        self.step = 0
        self.recorded = False  # a micro-batch of this step was measured
        self._meter = None  # the dispatch mode of the memory pass (feeding ``measured.mem``), while entered
        self.measured = Measured(chunks={}, base=0, mem=None, fragmentation=1.0, timings=[], swap_timings=[])
        self.key: str | None = None
        self.shapes = None
        self.cached: Profile | None = None
        self.started: float | None = None
        self.batch = 0  # batch_tokens of the micro-batch now running
        self.ref_tokens = self.ref_batch = 0  # the memory pass's batch: block tokens, batch_tokens
        self.handle = engine.observe(self)

    # ----- the engine's events ----------------------------------------------------------------
    def batch_begins(self, batch) -> None:
        self.batch = batch_tokens(batch)

    def _boundary(self, kind: str, seg: int) -> None:
        if kind == B.FORWARD and seg == 0:
            if self.started is None:
                self.started = self.engine.ctx.clock()
            if self.schedule[self.step] == "memory" and self.measured.mem is None and self.cached is None:
                self.measured.base = base_bytes(self.engine, self.bounds.first_inputs or [])
                self.measured.mem, self._meter = memory_meter(self.engine, self.bounds)
                self._meter.__enter__()
        if kind == B.FORWARD and seg == 1 and self.key is None:
            self._look_up_cache()
        if self._meter is not None:
            self.measured.mem.boundary(kind, seg)

    def backward_begins(self) -> None:
        self.bounds.mark(B.FORWARD_END)
        self.bounds.mark(B.BACKWARD, self.L + 1)

    def backward_ends(self) -> None:
        self.bounds.mark(B.BACKWARD_END)
        self._leave_memory_pass()
        if (B.FORWARD, 0) in self.bounds.times and not (self.schedule[self.step] == "memory" and self.recorded):
            self._record()
        self.bounds.reset()

    def step_ends(self) -> None:
        # Updates that overlap the next forward would be timed as that forward's: the profiled
        # steps let them finish first.
        self.engine.wait_for_updates()
        self._leave_memory_pass()
        self.bounds.reset()
        if not self.recorded:
            return  # a step without a (marked) training backward: try the next one
        self.recorded = False
        self.step += 1
        if self.cached is not None or self.step == len(self.schedule):
            self._finish()
        elif self.schedule[self.step] == "swap-warm-up":
            self.engine.set_block_modes((BlockMode.SWAP,) * self.L)

    def engine_closes(self) -> None:
        """The engine closes while profiling (the run ended early)."""
        self._stop()
        if self.on_unfinished is not None and self.step:
            self.on_unfinished(self.step)

    # ----- measuring --------------------------------------------------------------------------
    def _record(self) -> None:
        """One micro-batch's forward and backward are over: keep what this step measures."""
        kind = self.schedule[self.step] if self.cached is None else "cached"  # (nothing to measure)
        tokens = block_tokens(tensor_shapes(self.bounds.block_inputs or []))
        if kind == "memory":
            check_blocks_called(self.bounds)
            self.measured.chunks = {s: tuple(sorted(c)) for s, c in self.bounds.chunks.items()}
            self.ref_tokens, self.ref_batch = tokens, self.batch
        elif kind in ("time", "swap"):
            scale = self.ref_tokens / tokens if self.ref_tokens and tokens else 1.0
            timing = tuple([t * scale for t in part] for part in self.bounds.durations())  # (fwd, bwd, recompute)
            (self.measured.timings if kind == "time" else self.measured.swap_timings).append(timing)
        self.recorded = True

    def _leave_memory_pass(self) -> None:
        if self._meter is None:
            return
        self._meter.__exit__(None, None, None)
        self._meter = None
        self.measured.fragmentation = fragmentation_factor(self.engine.ctx)

    def _look_up_cache(self) -> None:
        engine = self.engine
        self.shapes = tensor_shapes(self.bounds.block_inputs or [])
        self.key = profile_key(engine.module, engine.optimizer, self.shapes, engine.precision, engine.ctx,
                               engine.layout, self.formats, engine.config.compile)
        if self.cache and not self.reprofile:
            self.cached = load_cached(self.key, self.cache_dir, n_chunks=engine.layout.n_chunks,
                                      n_blocks=engine.layout.n_blocks)
        self.cached = agree(engine.sharding, self.cached)  # sharded: every rank profiles as rank 0 does
        if self.cached is not None:  # nothing to measure: this step only finishes
            self._leave_memory_pass()
            self.measured.mem = None
            self.ref_tokens, self.ref_batch = block_tokens(self.shapes), self.batch

    def _stop(self) -> None:
        self._leave_memory_pass()
        self.handle.remove()
        self.bounds.remove()

    def _finish(self) -> None:
        self._stop()
        engine = self.engine
        if engine.block_modes != engine.plan.block_modes(self.L):
            engine.set_block_modes(engine.plan.block_modes(self.L))  # the safe plan's, until the switch
        profile = self.cached
        if profile is None:
            profile = build_profile(self.key, self.shapes, self.measured, engine.module, engine.layout,
                                    engine.precision, engine.ctx, self.started, self.formats,
                                    sharding=engine.sharding, switches=engine.config.runtime)
            if self.cache and engine.rank == 0:
                store(profile, self.cache_dir)
        # Sharded: rank 0's profile and batch, so that every rank searches the same plan.
        result = agree(engine.sharding, LiveProfile(
            profile=profile, steps=self.step, seconds=self.engine.ctx.clock() - self.started,
            cached=self.cached is not None, tokens=self.ref_tokens, batch_tokens=self.ref_batch))
        self.on_profile(result)
