"""The four knobs of a ProTrain plan (paper §3.1)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where model states and activations live.

    Attributes:
        n_persist: the first ``n_persist`` chunks (in execution order) keep their parameters,
            gradients, fp32 master weights and Adam states on the device for the whole run.
        n_buffer: number of reusable device chunk buffers through which the remaining
            (non-persistent) chunks are streamed. Must be at least 1 when any chunk is
            non-persistent; ignored otherwise.
        n_swap: transformer blocks whose activations are swapped to host memory.
        n_checkpoint: transformer blocks whose activations are recomputed in backward.
    """

    n_persist: int
    n_buffer: int
    n_swap: int = 0
    n_checkpoint: int = 0

    def __post_init__(self) -> None:
        for name in ("n_persist", "n_buffer", "n_swap", "n_checkpoint"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Plan.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"Plan.{name} must be >= 0, got {value}")

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        unknown = set(d) - {"n_persist", "n_buffer", "n_swap", "n_checkpoint"}
        if unknown:
            raise ValueError(
                f"Unknown Plan field(s) {sorted(unknown)}; "
                "valid fields are n_persist, n_buffer, n_swap, n_checkpoint"
            )
        return cls(**d)
