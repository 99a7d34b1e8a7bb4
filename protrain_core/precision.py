"""Precision modes (one table of names), and the fp16 dynamic loss scaler."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor


class Precision(enum.Enum):
    """The precision of a ProTrain engine. The mixed modes are DeepSpeed's recipe, not
    Lightning's default-strategy one: every parameter has a compute-dtype (bf16 / fp16) copy of
    its fp32 master, the forward runs under autocast, and the gradients come out in the compute
    dtype and are accumulated and applied in fp32. Lightning's own bf16-mixed keeps fp32 weights
    and autocasts only, so its gradients are fp32; the two stray from fp32 differently
    (benchmarks/bench_precision.py, benchmarks/HISTORY.md)."""

    FP32 = "32-true"  # fp32 compute, the parameters are the master weights
    BF16_TRUE = "bf16-true"  # bf16 parameters (= master), gradients and Adam states, no autocast
    BF16_MIXED = "bf16-mixed"  # bf16 compute copy + autocast, fp32 master and Adam states
    FP16_MIXED = "16-mixed"  # fp16 compute copy + autocast, fp32 master, dynamic loss scaling

    @property
    def compute_dtype(self) -> torch.dtype:
        return {Precision.FP32: torch.float32, Precision.FP16_MIXED: torch.float16}.get(self, torch.bfloat16)

    @property
    def master_dtype(self) -> torch.dtype:
        """Dtype of what the optimizer reads and writes: master weights, accumulated gradients
        and Adam states (bf16 in bf16-true, as ``torch.optim.AdamW`` on a bf16 module keeps them)."""
        return torch.bfloat16 if self is Precision.BF16_TRUE else torch.float32

    @property
    def is_mixed(self) -> bool:
        """A compute-dtype copy of fp32 master weights, run under autocast."""
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward runs under ``torch.autocast`` (mixed modes only); the engine
        enters autocast (``Engine.autocast``), nothing else does."""
        return self.compute_dtype if self.is_mixed else None


# The one table of precision names: Lightning's flags and their legacy short forms (Lightning
# maps "bf16" to "bf16-mixed" and "16" to "16-mixed" itself).
ALIASES = {
    "32-true": Precision.FP32,
    "32": Precision.FP32,
    "bf16-true": Precision.BF16_TRUE,
    "bf16-mixed": Precision.BF16_MIXED,
    "bf16": Precision.BF16_MIXED,
    "16-mixed": Precision.FP16_MIXED,
    "16": Precision.FP16_MIXED,
}
_CHOICES = (
    "'32-true', '16-mixed' (fp16 compute, fp32 master weights, dynamic loss scaling), 'bf16-mixed' (bf16 "
    "compute, fp32 master weights; host memory holds 4+4+4+4+2 bytes per offloaded parameter) or 'bf16-true' "
    "(bf16 weights, gradients and Adam states: 2+2+2+2 bytes)"
)


def parse_precision(precision: str | int | Precision) -> Precision:
    """The engine's mode for a precision name (a Lightning flag); a clear error for the others."""
    if isinstance(precision, Precision):
        return precision
    found = ALIASES.get(str(precision))
    if found is None:
        raise ValueError(f"ProTrain does not support precision={precision!r}. Choose one of {_CHOICES}.")
    return found


@dataclass(kw_only=True)
class LossScaler:
    """Dynamic loss scaling with exactly the rules of ``torch.amp.GradScaler``.

    The scale multiplies the loss before backward; before the optimizer step every gradient is
    multiplied by ``1/scale`` (computed as GradScaler does, in double then rounded to fp32) and
    checked for inf/nan. A step with a non-finite gradient is skipped entirely and the scale is
    multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a row it is
    multiplied by ``growth_factor`` (``torch._amp_update_scale_``).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        self.scale = torch.full((1,), self.init_scale, dtype=torch.float32)
        self.growth_tracker = torch.zeros((1,), dtype=torch.int32)

    def inv_scale(self) -> Tensor:
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: Tensor) -> None:
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            found_inf.to(torch.float32).reshape(1),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict:
        # Same keys as torch.amp.GradScaler.state_dict().
        return {
            "scale": self.scale.item(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self.growth_tracker.item()),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.scale.fill_(float(sd["scale"]))
        self.growth_factor = float(sd["growth_factor"])
        self.backoff_factor = float(sd["backoff_factor"])
        self.growth_interval = int(sd["growth_interval"])
        self.growth_tracker.fill_(int(sd["_growth_tracker"]))
