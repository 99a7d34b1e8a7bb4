"""The discrete-event clock of a simulated device: lanes that do one thing at a time, events,
and the records a step's summary is made of ([Note: the simulated device] in device.py)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass


class Lane:
    """Something that does one thing at a time, with its own clock ``t`` (seconds): a host
    thread (``t`` is its present), a stream or a link (``t`` is when its queued work ends)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t = 0.0


class MeasuredLane(Lane):
    """A host thread whose time passes as real time does (the CPU device: compute and host work
    are what they measure), except inside modeled regions, whose real time is replaced by the
    modeled one (``exclude``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._real0 = time.perf_counter()
        self._offset = 0.0

    @property
    def t(self) -> float:
        return time.perf_counter() - self._real0 + self._offset

    @t.setter
    def t(self, value: float) -> None:
        self._offset += value - self.t

    def exclude(self, real_seconds: float) -> None:
        self._offset -= real_seconds


class Stream(Lane):
    """A device stream: its work queue's end ``t``, the end of its last piece of work, and what
    it waited for since (the latest event: the cause of its idle time)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.last_end = 0.0
        self.held_by = ""


@dataclass(frozen=True)
class Event:
    """A point on a stream: done at ``time``; ``label`` says what it marks (the copy or
    collective it follows), ``stream`` where it was recorded."""

    time: float
    label: str
    stream: str


@dataclass(frozen=True)
class Wait:
    """A host thread blocked from ``start`` to ``end`` at ``site`` (the runtime's call site),
    for ``label``; ``phase``: the training phase then (``TrainingPhase.value``)."""

    lane: str
    start: float
    end: float
    site: str
    label: str
    phase: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Work:
    """A piece of work on a lane: an operator, a copy, a collective, a worker's job."""

    lane: str
    start: float
    end: float
    label: str
    kind: str  # "compute", "copy", "collective", "cpu", "idle"
    nbytes: int = 0


class Records:
    """Everything the simulation saw since ``reset``: work per lane (the compute stream's idle
    intervals too, ``kind`` "idle", labelled with their cause) and host waits."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.work: list[Work] = []
        self.waits: list[Wait] = []

    def idle_between(self, start: float, end: float) -> dict[str, float]:
        """Compute-stream idle time by cause within [start, end] (from the idle intervals)."""
        out: dict[str, float] = defaultdict(float)
        for w in self.work:
            if w.kind == "idle":
                lo, hi = max(w.start, start), min(w.end, end)
                if hi > lo:
                    out[w.label] += hi - lo
        return dict(out)
