"""How the optimizer update is configured: gradient clipping, and when each chunk's Adam runs.

``overlap_mode`` is the one place that decides when streamed chunks are updated: the runtime
follows it, the cost model predicts the step time of that schedule (the search gets it from
``wrap``), and ``engine.overlap`` / the explanations name it.

[Note: the overlap under clipping and fp16]
Without norm clipping and fp16, a streamed chunk's CPU Adam starts as soon as its gradients
are offloaded and overlaps the rest of backward (DURING_BACKWARD): T = T_f + max(T_b + T_gpu_adam,
T_cpu_adam chain). Norm clipping and fp16's overflow check need every gradient of the step first.
Two exact ways keep an overlap (``python -m benchmarks.bench_clipping`` predicts both from the
cost model for LLaMA 1.1B / 7B / 13B):
- SPECULATIVE: update during backward into a second copy of the host states, kept unless the
  step clips or overflows, else redone after backward. The copy is 14 B per streamed parameter
  on top of 16: 7B needs 82.8 GiB of host memory instead of 44.2, 13B 164 GiB instead of 102 --
  more than the 128 GB hosts of these GPUs, where host memory caps the model size.
- NEXT_FORWARD (chosen): finish the gradients as they land ([Note: finishing gradients early] in
  runtime/gradients.py), then run the streamed chunks' Adam in forward order after backward,
  overlapping the next forward; each chunk's fetch waits for its own update. No extra memory,
  a little above the step without clipping and well below deferring every update to step().
  SPECULATIVE would beat it only by (1 - p) x that gap, p the fraction of steps that clip,
  unknown ahead and high early in fine-tuning.
So NEXT_FORWARD runs whenever norm clipping or fp16 is on.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from typing import Literal

from protrain_core.precision import Precision


@dataclass(frozen=True, kw_only=True)
class ClippingConfig:
    """Gradient clipping before every update, exactly as ``torch.nn.utils.clip_grad_norm_``
    ("norm") or ``clip_grad_value_`` ("value") on the same gradients."""

    algorithm: Literal["norm", "value"] = "norm"
    """"norm": scale every gradient by one global factor; "value": clamp every element."""

    value: float
    """max_norm ("norm") or clip_value ("value"): a finite number > 0."""

    norm_type: float = 2.0
    """p of the p-norm ("norm" only); ``inf`` for the largest magnitude."""

    def __post_init__(self) -> None:
        algorithm, value, norm_type = self.algorithm, self.value, self.norm_type
        if algorithm not in ("norm", "value"):
            raise ValueError(
                f"Gradient clipping algorithm must be 'norm' (torch.nn.utils.clip_grad_norm_) or 'value' "
                f"(clip_grad_value_), or None to turn clipping off; got {algorithm!r}."
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            what = "max_norm" if algorithm == "norm" else "clip_value"
            raise ValueError(
                f"Gradient clipping by {algorithm} needs a finite {what} > 0, got {value!r}; pass "
                "algorithm=None to turn clipping off."
            )
        if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:
            raise ValueError(f"norm_type must be a number > 0 (2.0 for the Euclidean norm, float('inf') for the max), "
                             f"got {norm_type!r}.")
        object.__setattr__(self, "value", float(value))
        object.__setattr__(self, "norm_type", float(norm_type))

    def __str__(self) -> str:
        if self.algorithm == "value":
            return f"by value ({self.value:g})"
        return f"by norm (max_norm {self.value:g}, {self.norm_type:g}-norm)"


def clips_norm(clipping: ClippingConfig | None) -> bool:
    return clipping is not None and clipping.algorithm == "norm"


class UpdateSchedule(enum.Enum):
    """When the streamed chunks' CPU Adam runs ([Note: the overlap under clipping and fp16])."""

    DURING_BACKWARD = "cpu-adam-during-backward"  # a chunk's Adam starts once its gradients are offloaded
    NEXT_FORWARD = "cpu-adam-during-next-forward"  # all start at step(), in forward order; step() does not wait


@dataclass(frozen=True)
class Overlap:
    """The schedule in force and why it is not ``DURING_BACKWARD`` (empty when it is)."""

    schedule: UpdateSchedule
    reasons: tuple[str, ...] = ()
    # Elementwise passes clipping makes over the gradients before each update (the multiply of
    # clip_grad_norm_, the two clamps of clip_grad_value_): the cost model charges them.
    gradient_passes: int = 0

    @property
    def during_backward(self) -> bool:
        return self.schedule is UpdateSchedule.DURING_BACKWARD

    def __str__(self) -> str:
        return self.schedule.value + (f" ({', '.join(self.reasons)})" if self.reasons else "")


def overlap_mode(precision: Precision, clipping: ClippingConfig | None, *, late_clipping: str | None = None) -> Overlap:
    """The schedule of [Note: the overlap under clipping and fp16]; ``late_clipping``: why
    clipping may still be requested between backward and step() (the engine's first step, or an
    adapter that clips late), which also needs every gradient before any update."""
    reasons = []
    if precision is Precision.FP16_MIXED:
        reasons.append("fp16 overflow check")
    if clips_norm(clipping):
        reasons.append("gradient norm clipping")
    elif clipping is None and late_clipping:
        reasons.append(late_clipping)
    passes = 0 if clipping is None else 1 if clips_norm(clipping) else 2
    return Overlap(UpdateSchedule.NEXT_FORWARD if reasons else UpdateSchedule.DURING_BACKWARD, tuple(reasons),
                   gradient_passes=passes)
