"""Plan search: the fastest predicted plan whose predicted peak fits the budget (paper §3.3),
except that where every chunk fits, streaming must win by more than ``KEEP_ALL_MARGIN`` ([Note:
keeping every chunk when streaming gains little]).

The four knobs span (N+1) * (N+1) * (L+1)(L+2)/2 plans (about 3.2 million for 50 chunks and
48 blocks). The search evaluates the full model for only a few of them, using three properties
of the cost models:

1. Memory is separable (eq. 8-10): peak = states(n_persist, n_buffer) + activations(n_swap,
   n_checkpoint), the first a sum over the persistent chunks plus n_buffer buffers (each the
   size of the largest streamed chunk). So for an activation layout and an n_persist the
   largest n_buffer that fits is one division.
2. For fixed n_persist and activation layout the predicted time never grows with n_buffer
   (more buffers only keep more chunks resident from forward into backward, and lift the
   one-buffer serialisation), so only that largest n_buffer is evaluated: one candidate per
   (layout, n_persist) instead of N. The winner then gets the fewest buffers that keep its time.
3. Forward + backward time (+ device Adam) of a plan is a sum of per-chunk cases, so with
   prefix sums over chunks it is a few gathers -- for every layout and n_persist at once, as
   tensors (``cost._Grid``), along with every layout's activation peak. That sum is a lower
   bound of the step time (eq. 3 adds the CPU-Adam chain of eq. 7, which is O(chunks) per
   plan). Candidates are visited in increasing order of the bound, and the search stops at the
   first whose bound is not below the best time found by the full model.

This is exact with respect to the models over the plans whose persistent chunks are the first
n (``brute_force`` enumerates every such plan; the tests compare both). Non-monotone effects
are not assumed away: more persistent chunks are usually, but not always, faster (a
compute-bound streamed chunk costs nothing, while a persistent one adds device Adam time), so
every n_persist that fits is a candidate.

Chunks differ (an embedding chunk, a short last chunk, frozen bases beside trainable spans), so
the first n are not always the best n chunks to keep. From the best first-n plan the search
then moves chunks in and out of the persistent set while that is predicted faster
(``_refine``): a local optimum over sets, checked against ``brute_force(sets=True)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from dataclasses import dataclass

import torch

from protrain_core.chunk_format import dtype_name
from protrain_core.plan import Plan, describe_modes, interleaved_modes
from protrain_core.planner.cost import CostModel, MemoryEstimate, RuntimeEstimate
from protrain_core.planner.profiles import Profile
from protrain_core.update import UpdateSchedule
from protrain_core.utils import format_bytes, format_seconds


class InfeasibleBudget(ValueError):
    """No plan's predicted peak fits the memory budget (or its host memory does not fit):
    ``message`` says what is missing and what would fit, ``needed_bytes`` what the smallest plan
    needs on the device, ``budget_bytes`` the device budget."""

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
    schedule: UpdateSchedule = UpdateSchedule.DURING_BACKWARD  # when the runtime model assumed the CPU Adam runs
    gradient_passes: int = 0  # the clipping passes it charged before each update

    def explain(self) -> str:
        """What was chosen and why: predicted time by phase, memory breakdown, bottleneck."""
        p, r, m = self.profile, self.runtime, self.memory
        streamed = p.n_chunks - self.plan.n_persist
        chunks = self.plan.persistent_chunks  # named where not the first n_persist
        named = "" if chunks is None else f" (chunks {', '.join(map(str, chunks))})"
        busy = ", ".join(f"{name} {format_seconds(t)}" for name, t in r.busy().items() if t > 0)
        if not p.hardware.async_copies:
            overlap = "no overlap on this device: compute, copies and Adam add up"
        elif self.schedule is UpdateSchedule.NEXT_FORWARD:
            overlap = "copies overlap compute (CUDA streams); the CPU Adam runs after backward, overlapping the next forward"
        else:
            overlap = "copies and the CPU Adam overlap compute (CUDA streams, worker thread)"
        lines = [
            f"ProTrain plan: {self.plan}",
            f"  model: {p.description}; precision {p.precision}",
            _states_line(p),
            _chunks_line(p) + f"; {self.plan.n_persist} persistent{named}, {streamed} streamed through "
            f"{min(self.plan.n_buffer, streamed)} buffers",
            f"  activations per block: {describe_modes(self.plan.block_modes(p.n_blocks))}",
            f"  predicted step {format_seconds(r.total_s)} = forward {format_seconds(r.forward_s)} + "
            f"backward {format_seconds(r.backward_s)} + optimizer {format_seconds(r.optimizer_s)}"
            + (f" (recomputation {format_seconds(r.recompute_s)})" if r.recompute_s else ""),
            f"  bottleneck: {r.bottleneck} ({busy}); {overlap}",
            f"  predicted peak device memory {format_bytes(m.peak_bytes)} of budget {format_bytes(self.budget_bytes)}: "
            f"persistent chunks {format_bytes(m.persistent_bytes)}, chunk buffers {format_bytes(m.buffer_bytes)}, "
            f"batch and other {format_bytes(m.base_bytes)}, activations {format_bytes(m.activation_bytes)} "
            f"(peak in the {m.peak_at}; fragmentation factor {p.fragmentation:.2f})",
            _host_line(m, self.host_budget_bytes),
            f"  search: {self.evaluated:,} plans evaluated in {format_seconds(self.seconds)}; "
            f"profile: {p.hardware.device}, {p.iterations} timed iterations",
        ]
        return "\n".join(lines)


def _host_line(m, budget: int | None) -> str:
    """The host bytes the plan allocates, by what holds them (before the first step)."""
    locked = f"{format_bytes(m.pinned_host_bytes)} page-locked" if m.pinned_host_bytes else ""
    if locked and m.page_lock_s:
        locked += f", locked at wrap in {format_seconds(m.page_lock_s)} (predicted)"
    parts = [f"chunk states {format_bytes(m.host_bytes - m.swap_host_bytes)}" + (f" ({locked})" if locked else "")]
    if m.swap_host_bytes:
        parts.append(f"swapped activations {format_bytes(m.swap_host_bytes)} (buffers up to "
                     f"{format_bytes(m.swap_host_bytes + m.swap_host_bytes // 8)})")
    if m.staging_host_bytes:
        parts.append(f"gradient staging up to {format_bytes(m.staging_host_bytes)}")
    return (f"  host memory {format_bytes(m.planned_host_bytes)} allocated: {', '.join(parts)}"
            + (f"; budget {format_bytes(budget)}" if budget else ""))


def _chunks_line(p: Profile) -> str:
    """The chunks' size and formats, and what one upload of each moves (chunks differ)."""
    uploads = [c.upload_bytes for c in p.chunks]
    lo, hi = min(uploads), max(uploads)
    moves = format_bytes(lo) if lo == hi else f"{format_bytes(lo)} to {format_bytes(hi)} by chunk"
    whose = f" (this rank's shard of {p.world_size})" if p.world_size > 1 else ""
    kinds = Counter((dtype_name(c.compute_dtype), dtype_name(c.master_dtype)) for c in p.chunks)
    dtypes = " ".join([" stored"] + [f"{compute} (states {state}) x {k}" if len(kinds) > 1 else f"{compute}, states {state}"
                                     for (compute, state), k in sorted(kinds.items())]) + ";"
    trained = [c for c in p.chunks if c.trains]
    updated = sum(c.updated_numel for c in trained)
    formats = sorted({f"Adam moments {c.state_format}" + ("" if c.accumulator else ", no gradient accumulator")
                      for c in trained if c.adam_states})
    per_param = "" if not updated else (
        f"; streamed, a trainable parameter holds "
        f"{sum(c.streamed_host_bytes - c.frozen_upload_bytes for c in trained) / updated * p.world_size:.2f} B "
        f"of host memory ({'; '.join(formats) or 'no optimizer state'})")
    frozen = [c for c in p.chunks if c.frozen_numel]
    quantised = sorted({c.frozen_format for c in frozen if c.quantised})
    per_frozen = "" if not frozen else (
        f"; a frozen parameter uploads "
        f"{sum(c.frozen_upload_bytes for c in frozen) / sum(c.frozen_numel for c in frozen):.2f} B "
        f"({', '.join(quantised) + ', scales and norms included' if quantised else 'compute dtype'})")
    size = p.chunks[0].numel * p.chunks[0].compute_dtype.itemsize
    return (f"  chunks: {p.n_chunks} x {p.chunks[0].numel:,} elements ({format_bytes(size)});"
            f"{dtypes} an upload moves {moves}{whose}{per_param}{per_frozen}")


def _states_line(p: Profile) -> str:
    """Trainable and frozen parameters and what their model states take (wherever they live)."""
    frozen = sum(c.frozen_numel * c.compute_dtype.itemsize for c in p.chunks)
    total = sum(c.persistent_device_bytes for c in p.chunks)
    return (f"  model states {format_bytes(total)}: {sum(c.updated_numel for c in p.chunks):,} trainable parameters "
            f"{format_bytes(total - frozen)} (compute copy, master, gradients, Adam states), frozen parameters "
            f"{format_bytes(frozen)} (compute copy only); chunk padding included")


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
        schedule=cm.schedule,
        gradient_passes=cm.gradient_passes,
    )


def _better(t: float, mem: int, plan: Plan, best) -> bool:
    """Is (t, mem, plan) better than ``best`` = (time, memory, plan)? Ties in time (within
    floating-point noise) go to fewer swapped, then fewer checkpointed blocks (activations kept:
    no traffic, host memory or recomputation for the same predicted time), then to the plan that
    needs less memory."""
    if best is None:
        return True
    best_t, best_mem, best_plan = best
    if t < best_t * (1 - 1e-12):
        return True
    if t > best_t * (1 + 1e-12):
        return False
    key = (plan.n_swap, plan.n_checkpoint, mem, plan.n_buffer, plan.n_persist)
    return key < (best_plan.n_swap, best_plan.n_checkpoint, best_mem, best_plan.n_buffer, best_plan.n_persist)


def search(profile: Profile, budget: int, *, host_budget: int | None = None,
           schedule: UpdateSchedule = UpdateSchedule.DURING_BACKWARD, gradient_passes: int = 0,
           n_persist: int | frozenset[int] | None = None, sets: bool = True) -> PlanChoice:
    """The plan with the least predicted step time for ``profile`` whose predicted peak is <=
    ``budget`` bytes (and whose host memory is <= ``host_budget`` when given); ``schedule``,
    ``gradient_passes``: see ``CostModel``; ``n_persist``: only plans that keep these chunks on
    the device (the first ``n_persist``, or the indices of a set; the activation part and the
    buffers are re-solved: a new batch shape between steps); ``sets``: from the best plan whose
    persistent chunks are the first n, move chunks in and out of the persistent set while that
    is predicted faster (``_refine``; False: first-n plans only, what ``brute_force`` enumerates).
    Without ``n_persist``, a plan that streams chunks must beat keeping every chunk by more
    than ``KEEP_ALL_MARGIN`` ([Note: keeping every chunk when streaming gains little])."""
    start = time.perf_counter()
    cm = CostModel(profile, schedule=schedule, gradient_passes=gradient_passes)
    best, evaluated = _best(cm, [*range(cm.N + 1)] if n_persist is None else [n_persist], budget, host_budget)
    if best is None and sets and n_persist is None and host_budget is not None:
        best, more = _host_fitting_start(cm, budget, host_budget)
        evaluated += more
    if best is None:
        raise _infeasible(cm, budget, host_budget)
    if sets and n_persist is None:
        best, more = _refine(cm, best, budget, host_budget)
        evaluated += more
    if n_persist is None:
        best, more = _keep_all_if_close(cm, best, budget, host_budget)
        evaluated += more
    plan, more = _fewest_buffers(cm, best[2], best[0])
    return _choice(cm, plan, budget, host_budget, evaluated + more, time.perf_counter() - start)


def _best(cm: CostModel, sets, budget: int, host_budget: int | None):
    """The best plan whose persistent chunks are one of ``sets`` (each the first n, an int, or
    indices), over every activation layout with the most buffers that fit (one division each:
    property 1 of the module docstring): (time, memory, plan) or None when none fits; and the
    plans evaluated."""
    profile, N = cm.profile, cm.N
    grid = cm.grid()  # every layout's activation peak, swapped bytes and phases
    columns = []
    for persistent in sets:
        kept = frozenset(range(persistent)) if isinstance(persistent, int) else persistent
        avail = budget - profile.base_bytes - grid.activation_peak - cm.states_bytes(persistent, 0)
        B = avail.div(max(cm.buffer_bytes(persistent), 1), rounding_mode="floor").clamp(max=N - len(kept))
        ok = (avail >= 0) & (B >= profile.limits.buffers_needed(persistent))  # [Note: plan validity]
        if host_budget is not None:
            ok &= cm.streamed_host_bytes(persistent) + grid.swap_host_bytes <= host_budget
        columns.append((ok, torch.where(ok, B, 0)))
    ok, B = (torch.stack(c, 1) for c in zip(*columns))
    rows, cols = ok.nonzero(as_tuple=True)
    return _visit(cm, grid.phases(sets, B)[rows, cols], rows, [sets[i] for i in cols.tolist()], B[rows, cols])


def _visit(cm: CostModel, bounds, rows, persistents: list, buffers):
    """Run the full model on candidate plans (a layout row, persistent chunks, buffers) in
    increasing order of ``bounds`` (property 3 of the module docstring) until the bound reaches
    the best time found: the best (time, memory, plan) or None, and the plans evaluated. The
    bound is summed in another order than the scalar model: a relative slack keeps rounding
    from cutting off a tie."""
    bounds, order = torch.sort(bounds)
    rows, buffers = rows.tolist(), buffers.tolist()
    best = None  # (time, memory, plan)
    evaluated = 0
    for lb, i in zip(bounds.tolist(), order.tolist()):
        if best is not None and lb >= best[0] * (1 + 1e-9):
            break
        s, c = cm.grid().pairs[rows[i]]
        persistent, b = persistents[i], buffers[i]
        lay = cm.layout(interleaved_modes(cm.L, s, c))
        evaluated += 1
        t = cm.runtime_of(lay, persistent, b).total_s
        mem = cm.states_bytes(persistent, b) + lay.activation_peak
        plan = _plan(persistent, b, s, c)
        if _better(t, mem, plan, best):
            best = (t, mem, plan)
    return best, evaluated


def _plan(persistent: int | frozenset[int], n_buffer: int, n_swap: int, n_checkpoint: int) -> Plan:
    kept = range(persistent) if isinstance(persistent, int) else sorted(persistent)  # the first n: Plan names none
    return Plan(n_persist=len(kept), n_buffer=n_buffer, n_swap=n_swap, n_checkpoint=n_checkpoint,
                persistent_chunks=tuple(kept))


def _refine(cm: CostModel, best, budget: int, host_budget: int | None):
    """Improve ``best`` = (time, memory, plan), the best first-n plan, by steepest descent over
    its persistent set (each round one ``_best`` over the sets a move away) until no move is
    predicted faster; and the plans evaluated. Chunks alike in format (``_groups``) persist
    earliest first, as the first-n rule has them; so a move adds a group's next chunk, drops
    its last persistent one, or does both for two groups: a handful of sets per round."""
    groups = _groups(cm)
    evaluated = 0
    for _ in range(2 * cm.N + 2):  # a bound, should near-ties ever cycle
        found, more = _best(cm, [*_moves(groups, best[2].persistent())], budget, host_budget)
        evaluated += more
        if found is None or not _better(*found, best):
            break
        best = found
    return best, evaluated


def _host_fitting_start(cm: CostModel, budget: int, host_budget: int):
    """Where no first-n plan fits the host budget, a start for ``_refine``: the persistent sets
    (a count of each group of alike chunks, earliest first, as ``_refine`` moves them) whose
    streamed chunks' states fit the host, fewest device bytes first, until one fits the device
    too (a later chunk may free more host bytes per device byte than the first ones). (time,
    memory, plan) or None, and the plans evaluated."""
    groups = _groups(cm)
    counts = itertools.islice(itertools.product(*(range(len(g) + 1) for g in groups)), 4096)
    sets = [frozenset(c for g, k in zip(groups, ks) for c in g[:k]) for ks in counts]
    evaluated = 0
    for persistent in sorted((s for s in sets if cm.streamed_host_bytes(s) <= host_budget),
                             key=lambda s: cm.states_bytes(s, 0))[:16]:
        found, more = _best(cm, [persistent], budget, host_budget)
        evaluated += more
        if found is not None:
            return found, evaluated
    return None, evaluated


def _groups(cm: CostModel) -> list[list[int]]:
    """Chunks grouped by what the cost model charges them apart from their place in the
    schedule: trainable and frozen elements, the bytes of each copy and of each home, and
    whether another chunk's segments fetch them; each fact in 1/32 steps of its largest value
    (the moves are coarse, their evaluation is exact)."""
    p = cm.profile
    fetched = {e for extra in cm.grid().extra for e in extra}
    facts = [[getattr(c, name) for c in p.chunks] for name in (
        "updated_numel", "frozen_numel", "persistent_device_bytes", "streamed_host_bytes", "upload_bytes", "offload_bytes",
        "buffer_device_bytes")]
    scale = [max(max(f), 1) for f in facts]
    groups: dict[tuple, list[int]] = {}
    for c in range(cm.N):
        key = (*(round(32 * f[c] / m) for f, m in zip(facts, scale)), c in fetched)
        groups.setdefault(key, []).append(c)
    return list(groups.values())


def _moves(groups: list[list[int]], persistent: frozenset[int]):
    """The persistent sets one move away (``_refine``)."""
    adds = {i: next(c for c in g if c not in persistent) for i, g in enumerate(groups)
            if any(c not in persistent for c in g)}
    drops = {i: max(c for c in g if c in persistent) for i, g in enumerate(groups) if any(c in persistent for c in g)}
    for a in adds.values():
        yield persistent | {a}
    for d in drops.values():
        yield persistent - {d}
    for i, d in drops.items():
        for j, a in adds.items():
            if i != j:
                yield (persistent - {d}) | {a}


# [Note: keeping every chunk when streaming gains little]
# Where every chunk fits the device, streaming some of them can only win the device Adam of those
# chunks (their update moves to the CPU worker, beside backward): a few percent of the step, less
# than the cost model resolves (on an H200, benchmarks/results/h200-2026-11-29, its errors were
# about 2 % of either sign, and plain PyTorch beat the streaming plan it chose). Streaming also
# takes host memory, PCIe and the host's cores from the user's other work. So a plan that streams
# is chosen only if the best all-persistent plan that fits is predicted slower than
# (1 + KEEP_ALL_MARGIN) times it; else every chunk is kept.
KEEP_ALL_MARGIN = 0.05


def _keep_all_if_close(cm: CostModel, best, budget: int, host_budget: int | None):
    """``best`` = (time, memory, plan), or the best plan that keeps every chunk on the device
    when that fits and is predicted within ``KEEP_ALL_MARGIN`` of it ([Note: keeping every chunk
    when streaming gains little]); and the plans evaluated."""
    if best[2].n_persist == cm.N:
        return best, 0
    kept, evaluated = _best(cm, [cm.N], budget, host_budget)
    return (kept if kept is not None and kept[0] <= best[0] * (1 + KEEP_ALL_MARGIN) else best), evaluated


def _fewest_buffers(cm: CostModel, plan: Plan, t: float) -> tuple[Plan, int]:
    """The fewest buffers that give ``plan`` (the most that fit) its time ``t`` (property 2 of
    the module docstring: memory the plan does not need stays free); and the plans evaluated."""
    if plan.n_buffer <= 1:
        return plan, 0
    lay = cm.layout(plan.block_modes(cm.L))
    persistent = plan.persistent()
    lo, hi = cm.profile.limits.buffers_needed(persistent), plan.n_buffer
    evaluated = 0
    while lo < hi:
        mid = (lo + hi) // 2
        evaluated += 1
        if cm.runtime_of(lay, persistent, mid).total_s <= t * (1 + 1e-12):
            hi = mid
        else:
            lo = mid + 1
    return dataclasses.replace(plan, n_buffer=hi), evaluated


def brute_force(profile: Profile, budget: int, *, host_budget: int | None = None,
                schedule: UpdateSchedule = UpdateSchedule.DURING_BACKWARD, gradient_passes: int = 0,
                n_persist: int | None = None, sets: bool = False) -> PlanChoice:
    """Every plan, no shortcuts (for checking ``search`` on small models): every persistent set
    with ``sets`` (2^N of them), else the first n chunks for each n; the other arguments as
    ``search``'s, and the same rule for keeping every chunk (``KEEP_ALL_MARGIN``)."""
    start = time.perf_counter()
    cm = CostModel(profile, schedule=schedule, gradient_passes=gradient_passes)
    N = cm.N
    best = None
    evaluated = 0
    counts = range(N + 1) if n_persist is None else (n_persist,)
    for persistent in (frozenset(q) for n in counts
                       for q in (itertools.combinations(range(N), n) if sets else [range(n)])):
        buffers = range(profile.limits.buffers_needed(persistent), N - len(persistent) + 1)
        for (s, c), b in itertools.product(cm.grid().pairs, buffers):  # every (n_swap, n_checkpoint), n_buffer
            plan = _plan(persistent, b, s, c)
            mem = cm.memory(plan)
            if mem.peak_bytes > budget or (host_budget is not None and mem.host_bytes > host_budget):
                continue
            evaluated += 1
            t = cm.runtime(plan).total_s
            used = mem.peak_bytes - profile.base_bytes
            if _better(t, used, plan, best):
                best = (t, used, plan)
    if best is None:
        raise _infeasible(cm, budget, host_budget)
    if n_persist is None:
        best, more = _keep_all_if_close(cm, best, budget, host_budget)
        evaluated += more
    return _choice(cm, best[2], budget, host_budget, evaluated, time.perf_counter() - start)


def _infeasible(cm: CostModel, budget: int, host_budget: int | None) -> InfeasibleBudget:
    profile, L, grid = cm.profile, cm.L, cm.grid()
    # The smallest device footprint: nothing persistent, the fewest buffers, and the layout with
    # the smallest activation peak.
    s, c = grid.pairs[int(torch.argmin(grid.activation_peak))]
    lay = cm.layout(interleaved_modes(L, s, c))
    fewest = profile.limits.buffers_needed(0)
    states = cm.states_bytes(0, fewest)
    need = states + profile.base_bytes + lay.activation_peak
    host_need = cm.host_suffix[0] + lay.swap_host_bytes
    keep = cm.layout(interleaved_modes(L, 0, 0)).activation_peak
    msg = [f"No ProTrain plan fits a device memory budget of {format_bytes(budget)}"
           + ("." if host_budget is None else f" and a host budget of {format_bytes(host_budget)}.")]
    if need > budget:
        msg.append(
            f"The smallest plan (n_persist=0, n_buffer={fewest}, n_swap={s}, "
            f"n_checkpoint={c}) needs {format_bytes(need)}: {format_bytes(need - budget)} missing. Of that, "
            f"activations are {format_bytes(lay.activation_peak)} (all kept: {format_bytes(keep)}), chunk buffers "
            f"{format_bytes(states)}, the batch {format_bytes(profile.base_bytes)}. A smaller batch or shorter "
            f"sequences shrink the activations; a smaller chunk size (chunk_size=) the buffers; or raise the budget."
        )
    if host_budget is not None:
        msg.append(_host_shortfall(cm, budget, host_budget, profile.base_bytes + lay.activation_peak,
                                   lay.swap_host_bytes) if need <= budget else
                   f"Streaming every chunk needs {format_bytes(host_need)} of host memory for the offloaded model "
                   f"states, with {format_bytes(host_budget)} available.")
    return InfeasibleBudget(" ".join(msg), needed_bytes=need, budget_bytes=budget)


def _host_shortfall(cm: CostModel, budget: int, host_budget: int, others: int, swapped: int) -> str:
    """What the host lacks beside the most the device holds: the leading chunks that fit the
    budget beside their buffers and ``others`` (the batch and the smallest activation peak) stay
    there, the rest stream through host memory (with ``swapped`` activation bytes)."""
    limits, N = cm.profile.limits, cm.N
    k = max(k for k in range(N + 1) if k == 0 or cm.states_bytes(k, limits.buffers_needed(k)) + others <= budget)
    host_need = cm.streamed_host_bytes(k) + swapped
    if host_need <= host_budget:
        return f"The host holds the states of the {N - k} chunks the device cannot ({format_bytes(host_need)})."
    return (f"The device holds {k} of the {N} chunks beside the chunk buffers and the activations; the other "
            f"{N - k} stream from host memory, whose states need {format_bytes(host_need)} with "
            f"{format_bytes(host_budget)} available: {format_bytes(host_need - host_budget)} missing. 8-bit Adam "
            "moments (optimizer_state_format='8bit') or a quantised frozen base (frozen_dtype='int8') need fewer "
            "host bytes per parameter, processes on more hosts each hold a part of them; or add host RAM.")
