"""Where training stands: one record per engine (``StepState``), for the runtime, the activation
manager, the profiler and the Lightning adapters. The engine's verbs and hooks enter its phases
(``TrainingPhase``) and set its flags; everything else reads it. Transitions assert the phase
they leave, so an illegal one (a second backward inside a backward) raises instead of being
ignored.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from torch.utils.hooks import RemovableHandle


class TrainingPhase(enum.Enum):
    """Where an engine is in a training step (``StepState.phase``)."""

    IDLE = "idle"  # between steps (and forward passes, which need no phase of their own here)
    FORWARD = "forward"  # used by the profiler's timeline
    BACKWARD = "backward"  # inside engine.backward()
    RECOMPUTE = "recompute"  # a checkpointed block's forward, re-run inside backward
    STEP = "step"  # inside engine.step() (adapters: the optimizer step and the closure it runs)


@dataclasses.dataclass
class StepState:
    """The training state of one engine (not global: every engine has its own)."""

    phase: TrainingPhase = TrainingPhase.IDLE
    """Where the engine is in a step (``TrainingPhase``)."""
    final_micro_batch: bool = True
    """The next (or running) backward is a step's last micro-batch: False inside ``no_sync``."""
    manual: bool = False
    """Lightning's manual optimization: the user's ``opt.step()`` ends a step."""
    batch_begun: bool = False
    """``begin_batch`` ran for the training micro-batch now running (reset by its backward)."""
    optimizer_step: bool = False
    """``engine.step()`` is running the optimizer's own ``step`` (its hooks, LR schedulers)."""
    step_closure: bool = False
    """An adapter runs the closure of an optimizer step (Lightning: the step's last micro-batch)."""
    closed: bool = False
    """``engine.close()`` ran: the engine's states are gone, every verb refuses."""

    @property
    def idle(self) -> bool:
        return self.phase is TrainingPhase.IDLE

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

    def accumulating(self):
        """The backward passes inside only accumulate gradients (``engine.no_sync``)."""
        return self._while("final_micro_batch", False)

    def in_optimizer_step(self):
        return self._while("optimizer_step", True)

    def in_step_closure(self):
        return self._while("step_closure", True)

    @contextmanager
    def _while(self, flag: str, value: bool):
        """``flag`` is ``value`` inside, and what it was before afterwards, also on an exception."""
        previous = getattr(self, flag)
        setattr(self, flag, value)
        try:
            yield
        finally:
            setattr(self, flag, previous)

    @property
    def awaiting_batch(self) -> bool:
        """Between steps with no training micro-batch begun yet (``engine.begin_batch`` notifies)."""
        return not (self.batch_begun or self.closed) and self.idle

    def batch_began(self) -> None:
        self.batch_begun = True

    def micro_batch_ended(self) -> None:
        """A backward or a step ended the micro-batch: the next forward with gradients begins one."""
        self.batch_begun = False

    def set_manual(self, enabled: bool = True) -> None:
        """Lightning's manual optimization, or several optimizers: every backward runs as inside
        no_sync and the user's ``opt.step()`` ends the step, so the step's gradients are complete
        after any backward (clipping and norms are allowed then); otherwise only after a backward
        outside no_sync."""
        self.manual = enabled
        self.final_micro_batch = not enabled

    def close(self) -> None:
        self.closed = True

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("This ProTrain engine was closed.")


@runtime_checkable
class StepObserver(Protocol):
    """Hears of an engine's training steps (``engine.observe``). Subclass it to inherit a no-op
    for each event not overridden. All but ``engine_closes`` come when no forward or backward
    is running, so an observer may ``replan``."""

    def batch_begins(self, batch) -> None:
        """Before a training micro-batch's forward (``engine.begin_batch``): its inputs."""

    def backward_begins(self) -> None:
        """Before every ``engine.backward``."""

    def backward_ends(self) -> None:
        """After every ``engine.backward``, also one that raised."""

    def step_ends(self) -> None:
        """After every ``engine.step``."""

    def engine_closes(self) -> None:
        """``engine.close()`` begins (not after a failure)."""


@runtime_checkable
class RecomputeObserver(Protocol):
    """Called when a checkpointed block's recomputation begins and ends (``engine.on_recompute``)."""

    def __call__(self, block_index: int, begin: bool) -> None: ...


class Observers:
    """Observers of one kind, in the order they were added; a handle's ``remove()`` drops one."""

    def __init__(self, kind: type) -> None:
        self._kind = kind
        self._by_handle: OrderedDict[int, object] = OrderedDict()  # RemovableHandle needs a weakref-able dict

    def add(self, observer) -> RemovableHandle:
        if not isinstance(observer, self._kind):
            raise TypeError(
                f"{type(observer).__name__} is not a {self._kind.__name__}: it needs the methods "
                f"{', '.join(sorted(_protocol_methods(self._kind)))}"
                + (" (subclass protrain_core.StepObserver for no-op defaults)." if self._kind is StepObserver else ".")
            )
        handle = RemovableHandle(self._by_handle)
        self._by_handle[handle.id] = observer
        return handle

    def notify(self, event: Callable[..., None]) -> None:
        """``event(observer)`` for each observer; those added or removed meanwhile count from the next event."""
        for observer in list(self._by_handle.values()):
            event(observer)


def _protocol_methods(kind: type) -> set[str]:
    """The methods a Protocol asks for: its public ones, and ``__call__`` where it declares one."""
    return {name for name, value in vars(kind).items()
            if callable(value) and (not name.startswith("_") or name == "__call__")}
