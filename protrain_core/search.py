"""Plan search: the fastest predicted plan whose predicted peak fits the budget (paper §3.3).

The four knobs span (N+1) * (N+1) * (L+1)(L+2)/2 plans (about 3.2 million for 50 chunks and
48 blocks). The search evaluates only a few of them, using three properties of the cost models:

1. Memory is separable (eq. 8-10): peak = states(n_persist, n_buffer) + activations(n_swap,
   n_checkpoint), the first linear in n_persist and n_buffer. So for an activation layout and
   an n_persist the largest n_buffer that fits is one division.
2. For fixed n_persist and activation layout the predicted time never grows with n_buffer
   (more buffers only keep more chunks resident from forward into backward, and lift the
   one-buffer serialisation), so only that largest n_buffer is evaluated: one plan per
   (layout, n_persist) instead of N.
3. A layout's device compute (forward, backward and its recomputation) is a lower bound of
   the step time of every plan with that layout. Layouts are visited in increasing order of
   that bound, and the search stops at the first layout whose bound is not below the best
   time found: no later layout can win.
4. Within a layout, forward + backward time (+ device Adam) of a plan is a sum of per-chunk
   cases, so it comes from prefix sums in O(1) (``CostModel.phases_bound``); the full model,
   whose CPU-Adam chain (eq. 7) is O(chunks), runs only for plans this bound does not rule out.

This is exact with respect to the models (``brute_force`` enumerates every plan; the tests
compare both). Non-monotone effects are not assumed away: more persistent chunks are usually,
but not always, faster (a compute-bound streamed chunk costs nothing, while a persistent one
adds device Adam time), so every n_persist that fits is evaluated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from protrain_core.activations import describe_modes, interleaved_modes
from protrain_core.cost import CostModel, MemoryEstimate, RuntimeEstimate
from protrain_core.plan import Plan
from protrain_core.profiles import Profile
from protrain_core.utils import format_bytes, format_seconds


class InfeasibleBudget(ValueError):
    """No plan's predicted peak fits the memory budget (or its host memory does not fit).
    ``needed_bytes``: what the smallest plan needs on the device."""

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


@dataclass(frozen=True)
class PlanChoice:
    plan: Plan
    runtime: RuntimeEstimate
    memory: MemoryEstimate
    budget_bytes: int
    host_budget_bytes: int | None
    evaluated: int  # plans whose runtime was evaluated
    seconds: float  # search time
    profile: Profile

    def explain(self) -> str:
        """What was chosen and why: predicted time by phase, memory breakdown, bottleneck."""
        p, r, m = self.profile, self.runtime, self.memory
        modes = interleaved_modes(p.n_blocks, self.plan.n_swap, self.plan.n_checkpoint)
        streamed = p.n_chunks - self.plan.n_persist
        resources = [
            ("device compute", r.compute_s),
            ("host->device transfers", r.h2d_s),
            ("device->host transfers", r.d2h_s),
            ("CPU Adam", r.cpu_adam_s),
            ("device Adam", r.device_adam_s),
        ]
        busy = ", ".join(f"{name} {format_seconds(t)}" for name, t in resources if t > 0)
        overlap = (
            "copies and the CPU Adam overlap compute (CUDA streams, worker thread)"
            if p.hardware.async_copies
            else "no overlap on this device: compute, copies and Adam add up"
        )
        lines = [
            f"ProTrain plan: {self.plan}",
            f"  model: {p.description}; precision {p.precision}",
            f"  chunks: {p.n_chunks} x {format_bytes(p.chunk_bytes)} ({p.chunk_elems:,} elements); "
            f"{self.plan.n_persist} persistent, {streamed} streamed through {min(self.plan.n_buffer, streamed)} buffers",
            f"  activations per block: {describe_modes(modes)}",
            f"  predicted step {format_seconds(r.total_s)} = forward {format_seconds(r.forward_s)} + "
            f"backward {format_seconds(r.backward_s)} + optimizer {format_seconds(r.optimizer_s)}"
            + (f" (recomputation {format_seconds(r.recompute_s)})" if r.recompute_s else ""),
            f"  bottleneck: {r.bottleneck} ({busy}); {overlap}",
            f"  predicted peak device memory {format_bytes(m.peak_bytes)} of budget {format_bytes(self.budget_bytes)}: "
            f"persistent chunks {format_bytes(m.persistent_bytes)}, chunk buffers {format_bytes(m.buffer_bytes)}, "
            f"batch and other {format_bytes(m.base_bytes)}, activations {format_bytes(m.activation_bytes)} "
            f"(peak in the {m.peak_at}; fragmentation factor {p.fragmentation:.2f})",
            f"  host memory {format_bytes(m.host_bytes)} (streamed chunks' states and swapped activations)"
            + (f" of {format_bytes(self.host_budget_bytes)} available" if self.host_budget_bytes else ""),
            f"  search: {self.evaluated:,} plans evaluated in {format_seconds(self.seconds)}; "
            f"profile: {p.hardware.device}, {p.iterations} timed iterations",
        ]
        return "\n".join(lines)


def _choice(cm: CostModel, plan: Plan, budget: int, host_budget, evaluated: int, seconds: float) -> PlanChoice:
    return PlanChoice(
        plan=plan,
        runtime=cm.runtime(plan),
        memory=cm.memory(plan),
        budget_bytes=budget,
        host_budget_bytes=host_budget,
        evaluated=evaluated,
        seconds=seconds,
        profile=cm.profile,
    )


def _better(t: float, mem: int, best_t: float, best_mem: int) -> bool:
    # Ties (within floating-point noise) go to the plan that needs less memory.
    if t < best_t * (1 - 1e-12):
        return True
    return t <= best_t * (1 + 1e-12) and mem < best_mem


def search(profile: Profile, budget: int, *, host_budget: int | None = None) -> PlanChoice:
    """The plan with the least predicted step time whose predicted peak is <= ``budget``
    bytes (and whose host memory is <= ``host_budget`` when given)."""
    start = time.perf_counter()
    cm = CostModel(profile)
    N, L = cm.N, cm.L
    buf = profile.buffer_bytes
    min_buf = max(1, profile.min_buffers)
    layouts = []
    for s in range(L + 1):
        for c in range(L + 1 - s):
            modes = interleaved_modes(L, s, c)
            layouts.append((cm.compute_bound(modes), s, c, modes))
    layouts.sort(key=lambda x: x[0])  # layouts (and their memory walks) are built only when visited
    best = None  # (time, memory, plan)
    evaluated = 0
    for bound, s, c, modes in layouts:
        if best is not None and bound >= best[0] * (1 + 1e-12):
            break  # every remaining layout computes at least this long
        lay = cm.layout(modes)  # built now: its memory walk (eq. 9) and per-chunk arrays
        room = budget - profile.base_bytes - lay.activation_peak
        if room < 0:
            continue
        for p in range(N, -1, -1):
            persist = cm.persist_prefix[p]
            if persist > room:
                continue
            if host_budget is not None and cm.host_suffix[p] + lay.swap_host_bytes > host_budget:
                break  # fewer persistent chunks only need more host memory
            if p == N:
                B = 0
            else:
                B = min(N - p, (room - persist) // buf)
                if B < min(min_buf, N - p):
                    continue
            if best is not None and cm.phases_bound(lay, p, B) >= best[0] * (1 + 1e-12):
                continue  # forward + backward (+ device Adam) alone are too slow: skip eq. 7
            evaluated += 1
            t = cm._runtime(lay, p, B).total_s
            mem = persist + B * buf + lay.activation_peak
            if best is None or _better(t, mem, best[0], best[1]):
                best = (t, mem, Plan(n_persist=p, n_buffer=B, n_swap=s, n_checkpoint=c))
    if best is None:
        raise _infeasible(cm, budget, host_budget)
    return _choice(cm, best[2], budget, host_budget, evaluated, time.perf_counter() - start)


def brute_force(profile: Profile, budget: int, *, host_budget: int | None = None) -> PlanChoice:
    """Every plan, no shortcuts (for checking ``search`` on small models)."""
    start = time.perf_counter()
    cm = CostModel(profile)
    N, L = cm.N, cm.L
    min_buf = max(1, profile.min_buffers)
    best = None
    evaluated = 0
    for s in range(L + 1):
        for c in range(L + 1 - s):
            for p in range(N + 1):
                for b in range(0 if p == N else min(min_buf, N - p), N - p + 1):
                    plan = Plan(n_persist=p, n_buffer=b, n_swap=s, n_checkpoint=c)
                    mem = cm.memory(plan)
                    if mem.peak_bytes > budget:
                        continue
                    if host_budget is not None and mem.host_bytes > host_budget:
                        continue
                    evaluated += 1
                    t = cm.runtime(plan).total_s
                    used = mem.peak_bytes - profile.base_bytes
                    if best is None or _better(t, used, best[0], best[1]):
                        best = (t, used, plan)
    if best is None:
        raise _infeasible(cm, budget, host_budget)
    return _choice(cm, best[2], budget, host_budget, evaluated, time.perf_counter() - start)


def _infeasible(cm: CostModel, budget: int, host_budget: int | None) -> InfeasibleBudget:
    profile = cm.profile
    N, L = cm.N, cm.L
    # The smallest device footprint: nothing persistent, the fewest buffers, and the layout with
    # the smallest activation peak.
    smallest = min(
        ((cm.layout(interleaved_modes(L, s, c)), s, c) for s in range(L + 1) for c in range(L + 1 - s)),
        key=lambda x: x[0].activation_peak,
    )
    lay, s, c = smallest
    states = cm.states_bytes(0, min(max(1, profile.min_buffers), N)) if N else 0
    need = states + profile.base_bytes + lay.activation_peak
    host_need = cm.host_suffix[0] + lay.swap_host_bytes
    keep = cm.layout(interleaved_modes(L, 0, 0)).activation_peak
    msg = [f"No ProTrain plan fits a device memory budget of {format_bytes(budget)}."]
    if need > budget:
        msg.append(
            f"The smallest plan (n_persist=0, n_buffer={min(max(1, profile.min_buffers), N)}, n_swap={s}, "
            f"n_checkpoint={c}) needs {format_bytes(need)}: {format_bytes(need - budget)} missing. Of that, "
            f"activations are {format_bytes(lay.activation_peak)} (all kept: {format_bytes(keep)}), chunk buffers "
            f"{format_bytes(states)}, the batch {format_bytes(profile.base_bytes)}. A smaller batch or shorter "
            f"sequences shrink the activations; a smaller chunk size (chunk_size=) the buffers; or raise the budget."
        )
    if host_budget is not None:
        msg.append(
            f"Streaming every chunk needs {format_bytes(host_need)} of host memory for the offloaded model "
            f"states, with {format_bytes(host_budget)} available"
            + (f" ({format_bytes(host_need - host_budget)} missing): add host RAM or raise the device budget so "
               "that more chunks stay on the device." if host_need > host_budget else ".")
        )
    return InfeasibleBudget(" ".join(msg), needed_bytes=need, budget_bytes=budget)
