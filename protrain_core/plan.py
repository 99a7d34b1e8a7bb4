"""The four knobs of a ProTrain plan (paper §3.1), what they mean per block, and the one check
of a plan against a model.

[Note: plan validity]
A plan is valid for a model when the runtime can execute it, and ``check_plan`` is the only
place that decides this (``wrap``, the strategies and the search all use it or its parts):
  * ``0 <= n_persist <= n_chunks``;
  * ``n_swap + n_checkpoint <= n_blocks`` (every block is kept, checkpointed or swapped);
  * ``n_buffer >= PlanLimits.buffers_needed(n_persist)``: the most *streamed* chunks that must
    be on the device at the same time. The layout traces which hooked modules (units) run
    inside one another (``structure.trace``); a unit pins its chunks while it runs, so every
    stack of active units needs the union of their chunks at once. A T5 decoder module that
    runs inside another one, or a block that shares a parameter with an earlier block, needs
    more than one chunk at a time. Nothing else needs a buffer: prefetched and idle chunks are
    evicted when a unit needs room, and a chunk whose gradients are still arriving is offloaded
    early and accumulated on the host (runtime/scheduler.py), so ``buffers_needed`` is exactly
    what the runtime asks for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protrain_core.utils import parse_bytes

FIELDS = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where model states and activations live.

    Attributes:
        n_persist: how many chunks keep their parameters, gradients, master weights and Adam
            states on the device for the whole run: the first ``n_persist`` in execution order
            unless ``persistent_chunks`` names them.
        n_buffer: number of reusable device chunk buffers through which the remaining
            (non-persistent) chunks are streamed; at least what the model needs at once
            (``PlanLimits.buffers_needed``, 1 for most models) when any chunk is streamed.
        n_swap: transformer blocks whose activations are swapped to host memory.
        n_checkpoint: transformer blocks whose activations are recomputed in backward.
        persistent_chunks: which chunks persist (``n_persist`` chunk indices), when not the first
            ``n_persist``: a chunk whose upload no computation hides (an embedding) may be worth
            more on the device than one of the first blocks. None (the default, and what a plan
            naming the first ``n_persist`` becomes): the first ``n_persist``.
    """

    n_persist: int
    n_buffer: int
    n_swap: int = 0
    n_checkpoint: int = 0
    persistent_chunks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Plan.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"Plan.{name} must be >= 0, got {value}")
        named = self.persistent_chunks
        if named is None:
            return
        if isinstance(named, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in named):
            raise ValueError(f"Plan.persistent_chunks must be chunk indices (ints >= 0), got {named!r}")
        named = tuple(sorted(set(named)))
        if len(named) != self.n_persist:
            raise ValueError(f"Plan.persistent_chunks names {len(named)} distinct chunks {list(named)} but "
                             f"n_persist={self.n_persist}: give n_persist={len(named)}.")
        object.__setattr__(self, "persistent_chunks", None if named == tuple(range(self.n_persist)) else named)

    def persistent(self) -> frozenset[int]:
        """The indices of the chunks that persist."""
        return frozenset(range(self.n_persist) if self.persistent_chunks is None else self.persistent_chunks)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        unknown = set(d) - {*FIELDS, "persistent_chunks"}
        if unknown:
            raise ValueError(f"Unknown Plan field(s) {sorted(unknown)}; valid fields are {', '.join(FIELDS)}, "
                             "persistent_chunks")
        return cls(**d)

    def block_modes(self, n_blocks: int) -> tuple[BlockMode, ...]:
        return interleaved_modes(n_blocks, self.n_swap, self.n_checkpoint)


def as_plan(plan: Plan | dict | None) -> Plan | None:
    """A ``Plan`` from a plan, a dict of its fields, or None."""
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if plan is not None and not isinstance(plan, Plan):
        raise ValueError(f"plan must be a protrain_core.Plan, a dict of its fields or None, got {type(plan).__name__}")
    return plan


def plan_arguments(plan: Plan | dict | None, memory_budget, max_tokens=None) -> tuple[Plan | None, int | None]:
    """Check the ``plan`` / ``memory_budget`` / ``max_tokens`` arguments of ``wrap`` and the
    strategies before anything is built: a plan, or what to search one for; each well-formed.
    Returns (plan, budget in bytes)."""
    plan = as_plan(plan)
    for name, value in (("memory_budget", memory_budget), ("max_tokens", max_tokens)):
        if plan is not None and value is not None:
            raise ValueError(
                f"{name} is used to search a plan: pass either plan= (the plan to use) or {name}= with "
                "plan=None (search the fastest plan that fits), not both."
            )
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens={max_tokens!r}: give the most tokens (batch size x sequence length) of a "
                         "training batch, a positive integer.")
    return plan, None if memory_budget is None else parse_bytes(memory_budget)


# ----- activations per block ---------------------------------------------------------------
class BlockMode(enum.Enum):
    """What a transformer block does with its activations between forward and backward."""

    KEEP = "keep"  # autograd keeps the block's saved tensors on the device
    CHECKPOINT = "checkpoint"  # only the inputs are kept; backward recomputes the forward
    SWAP = "swap"  # saved tensors go to host memory in forward and come back for backward


def interleaved_modes(n_blocks: int, n_swap: int, n_checkpoint: int) -> tuple[BlockMode, ...]:
    """The mode of each block, in forward order (see [Note: activation layout] in
    runtime/activations.py).

    Swapped blocks are ``0 .. n_swap-1``. Of the ``r = n_blocks - n_swap`` others, position
    ``floor(k * r / n_checkpoint)`` is checkpointed for ``k = 0 .. n_checkpoint-1``: evenly
    spread, distinct because ``r / n_checkpoint >= 1``, and the last position ``r - ceil(r / n)``
    is never the last block while ``n_checkpoint < r``.
    """
    _check_block_counts(n_blocks, n_swap, n_checkpoint)
    modes = [BlockMode.SWAP] * n_swap + [BlockMode.KEEP] * (n_blocks - n_swap)
    rest = n_blocks - n_swap
    for k in range(n_checkpoint):
        modes[n_swap + k * rest // n_checkpoint] = BlockMode.CHECKPOINT
    return tuple(modes)


def describe_modes(modes: tuple[BlockMode, ...]) -> str:
    """E.g. 'S S C K C K K K (2 swap, 2 checkpoint, 4 keep)'."""
    letters = " ".join(m.name[0] for m in modes)
    order = (BlockMode.SWAP, BlockMode.CHECKPOINT, BlockMode.KEEP)
    counts = ", ".join(f"{sum(m is mode for m in modes)} {mode.value}" for mode in order)
    return f"{letters} ({counts})"


def _check_block_counts(n_blocks: int, n_swap: int, n_checkpoint: int) -> None:
    if n_swap < 0 or n_checkpoint < 0:
        raise ValueError(f"n_swap and n_checkpoint must be >= 0, got n_swap={n_swap}, n_checkpoint={n_checkpoint}")
    if n_swap + n_checkpoint > n_blocks:
        raise ValueError(
            f"Plan.n_swap={n_swap} + Plan.n_checkpoint={n_checkpoint} = {n_swap + n_checkpoint} blocks, "
            f"but the model has only {n_blocks} transformer blocks; each block is kept, checkpointed "
            f"or swapped, so use n_swap + n_checkpoint <= {n_blocks}."
        )


# ----- what a model allows ----------------------------------------------------------------
@dataclass(frozen=True)
class PlanLimits:
    """What a plan must respect for one model (see [Note: plan validity]).

    Attributes:
        n_chunks: chunks of the layout, in execution order.
        n_blocks: transformer blocks.
        resident_sets: the chunks that must be on the device at the same time, one tuple per
            distinct stack of units active together in the traced forward pass.
    """

    n_chunks: int
    n_blocks: int
    resident_sets: tuple[tuple[int, ...], ...]

    def buffers_needed(self, persistent: int | frozenset[int]) -> int:
        """The fewest chunk buffers a plan can run with whose persistent chunks are
        ``persistent`` (indices; an int ``n``: the first ``n``)."""
        if isinstance(persistent, int):
            persistent = frozenset(range(persistent))
        return max((sum(c not in persistent for c in s) for s in self.resident_sets), default=0)


def check_plan(plan: Plan, limits: PlanLimits) -> None:
    """Raise ``ValueError`` (saying how to fix it) unless the runtime can execute ``plan``."""
    _check_block_counts(limits.n_blocks, plan.n_swap, plan.n_checkpoint)
    n = limits.n_chunks
    if plan.n_persist > n:
        raise ValueError(
            f"Plan.n_persist={plan.n_persist} but the model has only {n} chunks; "
            f"use n_persist <= {n} (n_persist={n} keeps everything on the device)."
        )
    outside = [i for i in plan.persistent_chunks or () if i >= n]
    if outside:
        raise ValueError(f"Plan.persistent_chunks names chunks {outside}, but the model has only {n} chunks "
                         f"(0 to {n - 1}).")
    needed = limits.buffers_needed(plan.persistent())
    if plan.n_buffer < needed:
        what = (f"{needed} streamed chunks must be on the device at once (a module runs inside another, or "
                "shares parameters with a module in another chunk)" if needed > 1 else "chunks are streamed")
        raise ValueError(
            f"Plan.n_buffer={plan.n_buffer} is too small for n_persist={plan.n_persist}: {what} "
            f"({n - plan.n_persist} of {n} chunks are not persistent). Use n_buffer >= {needed}, or a larger "
            "n_persist."
        )
