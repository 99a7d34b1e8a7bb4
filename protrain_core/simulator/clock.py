"""The discrete-event clock of a simulated device: lanes that do one thing at a time, events,
and the records a step's summary is made of ([Note: the simulated device] in device.py)."""

from __future__ import annotations

import time
from collections import deque
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


class Link:
    """What carries one transfer at a time (a PCIe direction, the fabric between ranks): a
    transfer takes the first free gap at or after the time it is ready, as a copy engine serves
    whichever copy is ready rather than the host's issue order. Bookings are made as the host
    issues the copies and are not moved afterwards (their events are out already): a copy issued
    later cannot take a gap shorter than itself before one promised to an earlier copy."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy: list[tuple[float, float]] = []  # booked intervals, sorted, disjoint

    def first_gap(self, ready: float, seconds: float) -> float:
        """When a transfer of ``seconds`` ready at ``ready`` would start."""
        start = ready
        for a, b in self.busy:
            if b <= start:
                continue
            if a >= start + seconds:
                break
            start = b
        return start

    def book(self, ready: float, seconds: float, floor: float) -> float:
        """Book a transfer of ``seconds`` ready at ``ready``; return its start. ``floor``: no
        later transfer is ready before it (bookings that end earlier are forgotten)."""
        self.busy = [iv for iv in self.busy if iv[1] > floor]
        start = self.first_gap(ready, seconds)
        self.busy.append((start, start + seconds))
        self.busy.sort()
        return start


class Stream(Lane):
    """A device stream: its work queue's end ``t``, the end of its last piece of work, what it
    waited for since (the latest event: the cause of its idle time), and the ends of the work
    issued to it (``pending``: the launch queue, oldest first)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.last_end = 0.0
        self.held_by = ""
        self.pending: deque[float] = deque()


@dataclass(frozen=True)
class Event:
    """A point on a stream: done at ``time``; ``label`` says what it marks (the copy or
    collective it follows), ``stream`` where it was recorded."""

    time: float
    label: str
    stream: str
    order: dict | None = None  # its stream's vector clock ([Note: the stream-order checker] in races.py)


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


@dataclass(frozen=True)
class Work:
    """A piece of work on a lane: an operator, a copy, a collective, a worker's job."""

    lane: str
    start: float
    end: float
    label: str
    kind: str  # "compute", "copy", "collective", "cpu", "update" (a chunk's whole CPU update), "idle"
    nbytes: int = 0


class Records:
    """Everything the simulation saw since ``reset``: work per lane (the compute stream's idle
    intervals too, ``kind`` "idle", labelled with their cause) and host waits."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.work: list[Work] = []
        self.waits: list[Wait] = []
