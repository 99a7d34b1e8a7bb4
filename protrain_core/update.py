"""How the optimizer update is configured: gradient clipping, and when each chunk's Adam runs.

``overlap_mode`` is the one place that decides whether streamed chunks are updated during
backward: the runtime follows it, the cost model predicts the step time of that mode (the
search gets it from ``wrap``), and ``engine.overlap`` / the explanations name it.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

from protrain_core.precision import Precision


class ClipAlgorithm(enum.Enum):
    NORM = "norm"  # torch.nn.utils.clip_grad_norm_: scale every gradient by one global factor
    VALUE = "value"  # torch.nn.utils.clip_grad_value_: clamp every element


@dataclass(frozen=True, kw_only=True)
class GradientClipping:
    """Clipping applied to the gradients before every update (``parse_gradient_clipping``)."""

    algorithm: ClipAlgorithm
    value: float  # max_norm (NORM) or clip_value (VALUE)
    norm_type: float = 2.0  # p of the p-norm (NORM only); inf for the largest magnitude


def parse_gradient_clipping(algorithm: str | None, value: float | None = None, norm_type: float = 2.0) -> GradientClipping | None:
    """Validate a clipping setting (``None`` turns clipping off)."""
    if algorithm is None:
        return None
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
        raise ValueError(f"norm_type must be a number > 0 (2.0 for the Euclidean norm, float('inf') for the max), got {norm_type!r}.")
    return GradientClipping(algorithm=ClipAlgorithm(algorithm), value=float(value), norm_type=float(norm_type))


def clips_norm(clipping: GradientClipping | None) -> bool:
    return clipping is not None and clipping.algorithm is ClipAlgorithm.NORM


@dataclass(frozen=True)
class Overlap:
    """When the streamed chunks' CPU Adam runs.

    Attributes:
        during_backward: a chunk is updated as soon as its gradients are offloaded, while
            backward goes on; otherwise every update waits for ``step()``.
        reasons: why the updates wait (empty when they do not).
    """

    during_backward: bool
    reasons: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "cpu-adam-during-backward" if self.during_backward else f"deferred-to-step ({', '.join(self.reasons)})"


def overlap_mode(precision: Precision, clipping: GradientClipping | None) -> Overlap:
    """fp16 (an inf/nan anywhere skips the whole step) and norm clipping (one factor for all
    gradients) must see every gradient before any update, so Adam runs at step(); otherwise
    streamed chunks are updated during backward."""
    reasons = []
    if precision is Precision.FP16_MIXED:
        reasons.append("fp16 overflow check")
    if clips_norm(clipping):
        reasons.append("gradient norm clipping")
    return Overlap(during_backward=not reasons, reasons=tuple(reasons))
