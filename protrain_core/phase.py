"""The training phase: one enum for the runtime, the activation manager, the profiler and the
Lightning adapters.

An engine owns one ``PhaseTracker``; the runtime enters ``BACKWARD`` in ``engine.backward`` and
``STEP`` in ``engine.step``, the activation manager enters ``RECOMPUTE`` while a checkpointed
block's forward runs again inside backward, and the profiler marks ``FORWARD`` / ``BACKWARD`` /
``RECOMPUTE`` segments of its timeline with the same values. Transitions assert the phase they
leave, so an illegal one (a second backward inside a backward) raises instead of being ignored.
"""

from __future__ import annotations

import enum
from contextlib import contextmanager


class TrainingPhase(enum.Enum):
    IDLE = "idle"  # between steps (and forward passes, which need no phase of their own here)
    FORWARD = "forward"  # used by the profiler's timeline
    BACKWARD = "backward"  # inside engine.backward()
    RECOMPUTE = "recompute"  # a checkpointed block's forward, re-run inside backward
    STEP = "step"  # inside engine.step() (adapters: the optimizer step and the closure it runs)


class PhaseTracker:
    """The current phase of one engine (not global: every engine has its own)."""

    def __init__(self) -> None:
        self.phase = TrainingPhase.IDLE

    @contextmanager
    def entered(self, phase: TrainingPhase, *, leaving: TrainingPhase, error: str):
        """Enter ``phase`` from ``leaving`` (``RuntimeError(error)`` from any other phase) and
        return to ``leaving`` afterwards, also on an exception."""
        if self.phase is not leaving:
            raise RuntimeError(error)
        self.phase = phase
        try:
            yield
        finally:
            self.phase = leaving
