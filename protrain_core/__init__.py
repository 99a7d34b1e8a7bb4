"""ProTrain engine: chunked model states, device/host placement and overlapped per-chunk Adam.

    import protrain_core as pt
    engine = pt.wrap(model, optimizer, plan=pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2))
    out = engine.module(input_ids=x, labels=x)
    engine.backward(out.loss)
    engine.step()
    engine.zero_grad()

This package never imports Lightning.
"""

from protrain_core.activations import BlockActivations, BlockMode, interleaved_modes
from protrain_core.blocks import find_blocks
from protrain_core.chunk import ChunkState, IllegalTransition
from protrain_core.cost import CostModel, MemoryEstimate, RuntimeEstimate, estimate_memory, estimate_runtime
from protrain_core.engine import Engine, default_memory_budget, profile, wrap
from protrain_core.layout import ChunkLayout, build_layout
from protrain_core.plan import Plan
from protrain_core.precision import Precision
from protrain_core.profiles import Hardware, Profile, Segment
from protrain_core.search import InfeasibleBudget, PlanChoice, search

__all__ = [
    "BlockActivations",
    "CostModel",
    "Hardware",
    "InfeasibleBudget",
    "MemoryEstimate",
    "PlanChoice",
    "Profile",
    "RuntimeEstimate",
    "Segment",
    "default_memory_budget",
    "estimate_memory",
    "estimate_runtime",
    "profile",
    "search",
    "BlockMode",
    "ChunkLayout",
    "ChunkState",
    "Engine",
    "IllegalTransition",
    "Plan",
    "Precision",
    "build_layout",
    "find_blocks",
    "interleaved_modes",
    "wrap",
]
