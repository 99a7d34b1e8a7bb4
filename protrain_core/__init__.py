"""ProTrain engine: chunked model states, device/host placement and overlapped per-chunk Adam.

    import protrain_core as pt
    engine = pt.wrap(model, optimizer, pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2))
    out = engine.module(input_ids=x, labels=x)
    engine.backward(out.loss)
    engine.step()
    engine.zero_grad()

The folders are the architecture (docs/architecture.md): ``structure`` (blocks, traced
execution order, chunk layout), ``runtime`` (chunk storage and lifecycle, hooks, optimizer,
activations, the engine), ``profiler`` and ``planner`` (profile, cost models, search),
``autoplan`` (the plan of a running engine: after its first steps, for each batch shape); ``api``
joins them, and ``engine`` adds the checkpoint and export verbs to the engine it returns.
``config`` holds every setting of a run (``ProTrainConfig``). This package never imports Lightning.
"""

from protrain_core import utils
from protrain_core.api import default_memory_budget, profile, wrap
from protrain_core.autoplan import BatchTooLarge
from protrain_core.config import CheckpointConfig, ClippingConfig, PlanningConfig, ProTrainConfig, RuntimeConfig
from protrain_core.engine import Engine
from protrain_core.phase import StepObserver, StepState, TrainingPhase
from protrain_core.plan import BlockMode, Plan, PlanLimits, interleaved_modes
from protrain_core.planner.cost import CostModel, MemoryEstimate, RuntimeEstimate, estimate_memory, estimate_runtime
from protrain_core.planner.profiles import Hardware, Profile, Segment
from protrain_core.planner.search import InfeasibleBudget, PlanChoice, search
from protrain_core.precision import Precision
from protrain_core.runtime.activations import BlockActivations
from protrain_core.runtime.chunk import ChunkState, GradState, IllegalTransition
from protrain_core.runtime.frozen_formats import dequantised
from protrain_core.runtime.hooks import ManagedParameter
from protrain_core.runtime.sharding import barrier, broadcast_object
from protrain_core.runtime.state_formats import AdamWBf16Moments, to_fp32_adam_state
from protrain_core.structure.blocks import find_blocks
from protrain_core.structure.layout import ChunkLayout, build_layout

__all__ = [
    "AdamWBf16Moments",
    "BatchTooLarge",
    "CheckpointConfig",
    "ClippingConfig",
    "PlanningConfig",
    "ProTrainConfig",
    "RuntimeConfig",
    "BlockActivations",
    "CostModel",
    "Hardware",
    "InfeasibleBudget",
    "MemoryEstimate",
    "PlanChoice",
    "PlanLimits",
    "Profile",
    "RuntimeEstimate",
    "Segment",
    "StepObserver",
    "StepState",
    "TrainingPhase",
    "default_memory_budget",
    "dequantised",
    "estimate_memory",
    "estimate_runtime",
    "profile",
    "search",
    "barrier",
    "broadcast_object",
    "to_fp32_adam_state",
    "BlockMode",
    "ChunkLayout",
    "ChunkState",
    "Engine",
    "GradState",
    "IllegalTransition",
    "ManagedParameter",
    "Plan",
    "Precision",
    "build_layout",
    "find_blocks",
    "interleaved_modes",
    "utils",
    "wrap",
]
