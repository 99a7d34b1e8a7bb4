"""Planning alongside training: the plan searched on the first steps' profile, applied to the
live engine; a plan valid for every batch shape the run sees; the prediction checked.

[Note: batch shapes]
The profile holds the step of one batch shape. Activation bytes and per-block compute grow
with the batch's tokens (``Profile.at_tokens``), so a batch of another length needs no new
profile, only another look at the plan. Before each training micro-batch (``batch_begins``,
when nothing of it has run yet) the ``AutoPlanner`` counts its tokens and, for a count it has
not planned for, predicts the current plan's peak and time for it, and re-solves the activation
part and the buffers with the chunks on the device unchanged (``search(n_persist=...)``;
fewer persistent chunks only when nothing else fits). It switches (``Engine.replan``, which
keeps every state and does not change the numerics) only when the current plan would exceed
the budget or the new one is predicted at least ``SWITCH_GAIN`` faster, and says so once per
token count and plan. A batch that no plan fits is refused before its forward, naming the
largest token count that fits. ``max_tokens`` plans once for that many tokens: batches up to
it keep that plan.

Tokens are counted the way the first block sees them (batch x sequence of its input); a batch
shows its count through ``utils.batch_tokens`` (its token ids), in a ratio measured on the
profiled batch.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from protrain_core.chunk_format import ChunkFormat, timed_formats
from protrain_core.phase import StepObserver
from protrain_core.plan import Plan, PlanLimits
from protrain_core.planner.cost import CostModel
from protrain_core.planner.profiles import Profile, discard
from protrain_core.planner.search import InfeasibleBudget, PlanChoice, search
from protrain_core.profiler.hardware import probe_hardware
from protrain_core.profiler.live import LiveProfile, LiveProfiler
from protrain_core.runtime.engine import RuntimeEngine
from protrain_core.runtime.storage import chunk_formats
from protrain_core.update import Overlap
from protrain_core.utils import batch_tokens, format_bytes, format_seconds

# A batch shape's plan replaces the current one only when predicted at least this much faster.
SWITCH_GAIN = 0.02
# The prediction check: steps after the switch before timing, steps timed.
WARMUP_STEPS, CHECKED_STEPS = 2, 5
# A prediction off by more than this factor means the profile does not describe this machine as
# it runs now.
STALE_FACTOR = 1.5


def print_report(text: str, **metrics) -> None:
    print(text, flush=True)


class BatchTooLarge(torch.OutOfMemoryError):
    """A training batch that fits no plan within the memory budget (raised before its forward):
    ``message`` says what is missing and the fix, ``tokens`` the batch's tokens (batch x
    sequence), ``largest`` the most tokens a batch may have (0: none fits). An out-of-memory
    error, named as the device's would be ("CUDA out of memory"): what skips such a batch, or
    backs off from it (Lightning's batch-size tuner), handles this one too."""

    def __init__(self, message: str, *, tokens: int, largest: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.largest = largest


class AutoPlanner(StepObserver):
    """The plan of one engine once its profile exists (see [Note: batch shapes])."""

    def __init__(self, engine: RuntimeEngine | None, profile: Profile, *, budget: int, host_budget: int | None,
                 overlap: Overlap, report=print_report, max_tokens: int | None = None,
                 tokens_per_batch_token: float | None = None, cache_dir=None, refit=None) -> None:
        """``engine``: may be set later (a plan searched before the engine is built);
        ``overlap``: when the CPU Adam runs and the passes clipping adds (``update.overlap_mode``)
            until the engine is set; then the engine's steady overlap (``engine.clipping.overlap(steady=True)``);
        ``tokens_per_batch_token``: the first block's tokens per ``batch_tokens`` of the batch
        (None: batches do not show their tokens, and the plan stays the first choice);
        ``refit(profile, changes)``: ``profile`` as the run would be with ``ProTrainConfig.replace(**changes)``
        (``refitter``), for the changes a refusal proposes."""
        self.engine, self.profile, self.budget, self.host_budget = engine, profile, budget, host_budget
        self.report, self.max_tokens, self.cache_dir, self.refit = report, max_tokens, cache_dir, refit
        self.ratio = tokens_per_batch_token
        self._overlap = overlap
        self.planned_tokens = max(profile.tokens, max_tokens or 0)
        self._models: dict[tuple[int, Overlap], CostModel] = {}
        self._decisions: dict[tuple[int, Plan, Overlap], Plan] = {}
        self._said: set[tuple[int, Plan]] = set()
        self.handle = None
        self.pending: Plan | None = None  # a switch waiting for a graph's backward (``switch``)

    # ----- the plans ------------------------------------------------------------------------
    @property
    def overlap(self) -> Overlap:
        return self._overlap if self.engine is None else self.engine.clipping.overlap(steady=True)

    def cost_model(self, tokens: int) -> CostModel:
        key = (tokens, self.overlap)
        if key not in self._models:
            self._models[key] = CostModel(self.profile.at_tokens(tokens), schedule=key[1].schedule,
                                          gradient_passes=key[1].gradient_passes)
        return self._models[key]

    def search(self, tokens: int, n_persist: int | frozenset[int] | None = None) -> PlanChoice:
        return self._search(self.profile.at_tokens(tokens), n_persist)

    def first_choice(self) -> PlanChoice:
        """The fastest plan for the profiled batch (or ``max_tokens``, when larger)."""
        try:
            return self.search(self.planned_tokens)
        except InfeasibleBudget as e:
            if self.planned_tokens != self.profile.tokens:
                raise self._too_large(self.planned_tokens, e, what="max_tokens") from None
            raise InfeasibleBudget(f"{e}\n{self._what_would_fit()}", needed_bytes=e.needed_bytes,
                                   budget_bytes=e.budget_bytes) from None

    def plan_for(self, tokens: int) -> Plan:
        """The plan to run a batch of ``tokens`` tokens with, from the current one."""
        current = self.engine.plan
        if self.max_tokens is not None and tokens <= self.max_tokens:
            tokens = self.max_tokens  # the plan made for max_tokens fits every shorter batch
        key = (tokens, current, self.overlap)  # a late clipping request changes the schedule
        if key not in self._decisions:
            self._decisions[key] = self._decide(tokens, current)
        return self._decisions[key]

    def _decide(self, tokens: int, current: Plan) -> Plan:
        cm = self.cost_model(tokens)
        memory = cm.memory(current)
        fits = memory.peak_bytes <= self.budget and (self.host_budget is None or memory.host_bytes <= self.host_budget)
        try:
            best = self.search(tokens, n_persist=current.persistent())
        except InfeasibleBudget:
            try:
                best = self.search(tokens)  # fewer chunks on the device
            except InfeasibleBudget as e:
                raise self._too_large(tokens, e, what="batch") from None
        now = cm.runtime(current).total_s
        if fits and best.runtime.total_s >= now * (1 - SWITCH_GAIN):
            return current
        if (tokens, best.plan) not in self._said:
            self._said.add((tokens, best.plan))
            why = (f"{current} would need {format_bytes(memory.peak_bytes)} of the {format_bytes(self.budget)} budget"
                   if not fits else f"{current} is predicted {format_seconds(now)} a step")
            self.report(f"ProTrain: batches of {tokens:,} tokens (the plan was made for {self.planned_tokens:,}): {why}; "
                        f"switching to {best.plan}: predicted {format_seconds(best.runtime.total_s)} a step, peak "
                        f"{format_bytes(best.memory.peak_bytes)}.")
        return best.plan

    def largest_fitting(self, below: int) -> int:
        """The largest token count under ``below`` that some plan fits (0: none)."""
        lo, hi = 0, below - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                self.search(mid)
                lo = mid
            except InfeasibleBudget:
                hi = mid - 1
        return lo

    def _too_large(self, tokens: int, error: InfeasibleBudget, *, what: str) -> BatchTooLarge:
        largest = self.largest_fitting(tokens)
        fix = ("use shorter sequences (truncate, or bucket batches by length) or smaller batches, or raise memory_budget"
               if largest else "no batch fits this budget: raise memory_budget or use a smaller chunk_size")
        device = "CUDA" if self.profile.hardware.async_copies else "CPU"  # (a simulated GPU's too: CUDA)
        return BatchTooLarge(
            f"{device} out of memory, predicted by ProTrain before the forward: a {what} of {tokens:,} tokens "
            f"(batch x sequence) fits no plan within the memory budget of "
            f"{format_bytes(self.budget)}: the smallest plan needs {format_bytes(error.needed_bytes)}. The largest "
            f"batch that fits has {largest:,} tokens; {fix}.",
            tokens=tokens, largest=largest)

    def _what_would_fit(self) -> str:
        """After a refusal: each change that needs fewer bytes, alone, with the plan it would get
        and its predicted step."""
        chunks, tokens = self.profile.chunks, self.profile.tokens
        largest = self.largest_fitting(tokens)
        changes = [(f"batches of at most {largest:,} tokens instead of {tokens:,} (shorter sequences or a smaller "
                    "batch)", lambda: self.profile.at_tokens(largest))] if largest else []
        if self.refit is not None and self.profile.state_format != "8bit" and any(c.adam_states for c in chunks):
            changes.append(("optimizer_state_format='8bit'",
                            lambda: self.refit(self.profile, dict(optimizer_state_format="8bit"))))
        if self.refit is not None and not any(c.quantised for c in chunks) and any(c.frozen_numel for c in chunks):
            changes.append(("frozen_dtype='int8'", lambda: self.refit(self.profile, dict(frozen_dtype="int8"))))
        rows = [self._row(change, profile) for change, profile in changes] + [self._more_processes()]
        return ("What would fit, each change alone (predicted by the cost model from this profile; a new format's "
                "update timed in it):\n" + "\n".join(rows))

    def _row(self, change: str, profile) -> str:
        """``change``'s line (``_fits``) for ``profile()``."""
        try:
            return self._fits(change, self._search(profile()))
        except InfeasibleBudget:
            return f"  {change}: does not fit either"
        except Exception as e:  # (a format that cannot run here): the refusal stands as it is
            return f"  {change}: not predicted ({type(e).__name__}: {e})"

    @staticmethod
    def _fits(change: str, choice: PlanChoice) -> str:
        return (f"  {change}: {choice.plan}, predicted {format_seconds(choice.runtime.total_s)} a step, device peak "
                f"{format_bytes(choice.memory.peak_bytes)}, host {format_bytes(choice.memory.host_bytes)}")

    def _search(self, profile: Profile, n_persist: int | frozenset[int] | None = None) -> PlanChoice:
        return search(profile, self.budget, host_budget=self.host_budget, schedule=self.overlap.schedule,
                      gradient_passes=self.overlap.gradient_passes, n_persist=n_persist)

    def _more_processes(self) -> str:
        """The line of the fewest processes (doubling, up to 64 times as many), each with a device
        and a host like this one's, whose shards of the chunks fit."""
        w, whole = self.profile.world_size, self.profile.chunks[0].whole
        collectives = ("the step leaves out the collectives, which one process cannot time" if whole else
                       f"the collectives at the rates timed with {w} processes")
        try:
            for n in (2 * w, 4 * w, 8 * w, 16 * w, 32 * w, 64 * w):
                sharded = dataclasses.replace(self.profile, chunks=tuple(c.sharded(n) for c in self.profile.chunks))
                try:
                    choice = self._search(sharded)
                except InfeasibleBudget:
                    continue
                return self._fits(f"{n} processes, each with a device and a host like this one's (ZeRO-3 over chunks: "
                                  f"each holds 1/{n} of the states; {collectives})", choice)
        except Exception as e:  # the refusal stands as it is
            return f"  more processes: not predicted ({type(e).__name__}: {e})"
        return f"  more processes, each with a device and a host like this one's: not even {64 * w} fit"

    # ----- following the run ----------------------------------------------------------------
    def follow(self) -> None:
        """From now on, check every micro-batch's shape (when batches show their tokens) and
        make a switch that waited (``switch``)."""
        self.handle = self.engine.observe(self)

    def tokens_of(self, batch) -> int | None:
        """A batch's tokens as the first block will see them (None: it does not show them)."""
        n = batch_tokens(batch) if self.ratio is not None else 0
        return round(n * self.ratio) if n else None

    def batch_begins(self, batch) -> None:
        tokens = self.tokens_of(batch)
        if tokens is None:
            if self.pending is not None:
                self.switch(self.pending)
            return
        # Every rank plans for the longest of the ranks' batches (a host collective).
        tokens = int(self.engine.sharding.max_on_host([tokens])[0])
        self.switch(self.plan_for(tokens))

    def switch(self, plan: Plan) -> None:
        """Run ``plan``: now, or -- while a forward's autograd graph waits for its backward across
        a step (``RuntimeHooks.backward_awaited``) -- from the first micro-batch after it."""
        self.pending = plan if self.engine.hooks.backward_awaited() else None
        if self.pending is None and plan != self.engine.plan:
            self.engine.replan(plan)

    def predicted_step(self, tokens: int | None) -> float:
        """The current plan's predicted time for one micro-batch of ``tokens`` (None: as planned)."""
        return self.cost_model(self.planned_tokens if tokens is None else tokens).runtime(self.engine.plan).total_s


class PredictionCheck(StepObserver):
    """After a plan was searched: the measured step time of a few steps (``WARMUP_STEPS`` after
    the switch, then the median of ``CHECKED_STEPS``) against the prediction for the same
    micro-batches, reported once with both as metrics (``predicted_step_s``,
    ``measured_step_s``). A stale profile is said so and removed from the cache: the next run
    profiles again."""

    def __init__(self, engine: RuntimeEngine, planner: AutoPlanner, *, report=print_report, hint: str = "reprofile=True",
                 checked_steps: int = CHECKED_STEPS) -> None:
        self.engine, self.planner, self.report, self.hint = engine, planner, report, hint
        self.checked_steps = checked_steps
        self.ends: list[float] = []
        self.predicted: list[float] = []  # per step: the sum over its micro-batches
        self.micro_batches: list[int] = []  # per step
        self.pending, self.pending_micro = 0.0, 0
        self.tokens: int | None = None  # the running micro-batch's
        self.handle = engine.observe(self)

    def batch_begins(self, batch) -> None:
        self.tokens = self.planner.tokens_of(batch)

    def backward_ends(self) -> None:
        self.pending += self.planner.predicted_step(self.tokens)
        self.pending_micro += 1
        self.tokens = None

    def step_ends(self) -> None:
        self.ends.append(self.engine.ctx.clock())
        self.predicted.append(self.pending)
        self.micro_batches.append(self.pending_micro)
        self.pending, self.pending_micro = 0.0, 0
        if len(self.ends) < WARMUP_STEPS + self.checked_steps + 1:
            return
        self.handle.remove()
        measured = statistics.median(b - a for a, b in zip(self.ends[WARMUP_STEPS:], self.ends[WARMUP_STEPS + 1:]))
        predicted = statistics.median(self.predicted[WARMUP_STEPS + 1:])
        if predicted <= 0 or measured <= 0:
            return  # steps without a backward: nothing to compare
        micro = statistics.median(self.micro_batches[WARMUP_STEPS + 1:])
        # The plan's "predicted step" is one micro-batch's: an optimizer step runs several.
        each = f"; {micro:g} micro-batches of {format_seconds(predicted / micro)}" if micro > 1 else ""
        message = (f"ProTrain: measured step {format_seconds(measured)} (median of {self.checked_steps} after {WARMUP_STEPS} "
                   f"warm-up steps, data loading and your code included), predicted {format_seconds(predicted)} "
                   f"({(predicted - measured) / measured:+.1%}{each}).")
        if not 1 / STALE_FACTOR <= predicted / measured <= STALE_FACTOR:
            removed = discard(self.planner.profile.key, self.planner.cache_dir)
            message += (
                " The profile does not describe this machine as it runs now (was it taken, or cached, while other "
                "work loaded the machine?), so the plan may not be the best one. "
                + ("It has been removed from the profile cache: the next run profiles again."
                   if removed else f"Profile again with {self.hint}.")
            )
        self.report(message, predicted_step_s=predicted, measured_step_s=measured)


def follow(engine: RuntimeEngine, planner: AutoPlanner, choice: PlanChoice, *, report) -> None:
    """Record the choice on the engine, check batch shapes and the prediction from now on."""
    engine.profile, engine.choice = planner.profile, choice
    planner.follow()
    PredictionCheck(engine, planner, report=report)


def refitter(model, optimizer, layout, precision, config, device, *, world_size: int = 1):
    """``refit(profile, changes)`` for ``AutoPlanner``: ``profile`` as the run would be with
    ``config.replace(**changes)`` -- its chunks' records in the new formats and the CPU update and
    the dequantisation timed in them (one process's probes), every other measurement kept."""

    def refit(profile: Profile, changes: dict) -> Profile:
        new = config.replace(**changes)
        chunks = tuple(chunk_formats(model, optimizer, layout, precision, new, world_size=world_size))
        moments, frozen = timed_formats(chunks)
        probed = probe_hardware(device, layout.chunk_size, precision, switches=new.runtime, state_format=moments,
                                frozen_format=frozen)
        hw = profile.hardware
        timed = {name: getattr(probed, name) for name in ("cpu_adam_params_per_s", "cpu_land_params_per_s",
                                                          "cpu_pass_params_per_s", "dequant_params_per_s")}
        if not hw.async_copies:  # a CPU device: the persistent chunks' update is the same kernel
            timed["device_adam_params_per_s"] = probed.device_adam_params_per_s
        return dataclasses.replace(profile, chunks=chunks, hardware=dataclasses.replace(hw, **timed))

    return refit


def check_budget_holds_states(formats: tuple[ChunkFormat, ...], limits: PlanLimits, budget: int) -> None:
    """Before a safe plan starts: a budget below the smallest plan's chunk buffers (every chunk
    streamed through the fewest buffers the model allows) fits no plan, whatever the profile
    says; refuse it now instead of after the profiled steps."""
    fewest = limits.buffers_needed(0)
    need = fewest * max(fmt.buffer_device_bytes for fmt in formats)
    if need > budget:
        raise InfeasibleBudget(
            f"No ProTrain plan fits a device memory budget of {format_bytes(budget)}: streaming every chunk through the "
            f"fewest buffers this model allows ({fewest}) needs {format_bytes(need)} for the buffers alone, before "
            "any activation. Raise memory_budget, or pass a smaller chunk_size.", needed_bytes=need, budget_bytes=budget)


def plan_on_first_steps(engine: RuntimeEngine, *, budget: int, host_budget: int | None, report=print_report,
                        max_tokens: int | None = None, cache: bool = True, reprofile: bool = False,
                        cache_dir=None) -> LiveProfiler:
    """Profile the engine's first training steps (it runs a safe plan meanwhile), then switch it
    to the fastest plan that fits ``budget`` ([Note: live profiling] in profiler/live.py)."""

    def profiled(result: LiveProfile) -> None:
        ratio = result.tokens / result.batch_tokens if result.tokens and result.batch_tokens else None
        profile = result.profile.at_tokens(result.tokens) if result.tokens else result.profile
        planner = AutoPlanner(engine, profile, budget=budget, host_budget=host_budget,
                              overlap=engine.clipping.overlap(steady=True), report=report,
                              max_tokens=max_tokens, tokens_per_batch_token=ratio, cache_dir=cache_dir,
                              refit=refitter(engine.module, engine.optimizer, engine.layout, engine.precision,
                                             engine.config, engine.ctx, world_size=engine.world_size))
        choice = planner.first_choice()
        planner.switch(choice.plan)
        follow(engine, planner, choice, report=report)
        how = "from the profile cache, 1 step" if result.cached else f"{result.steps} steps"
        when = " at the next micro-batch (a forward's graph waits for its backward)" if planner.pending else ""
        report(f"ProTrain profiling: {how}, {format_seconds(result.seconds)} (they trained as usual, on a safe plan); "
               f"switching to the searched plan{when}.\n{engine.explain()}",
               profiling_steps=result.steps, profiling_s=result.seconds)

    def unfinished(steps: int) -> None:
        report(f"ProTrain: the run ended after {steps} steps, before profiling was over; it ran the safe plan "
               f"{engine.plan} throughout.")

    return LiveProfiler(engine, on_profile=profiled, on_unfinished=unfinished, cache=cache, reprofile=reprofile,
                        cache_dir=cache_dir)
