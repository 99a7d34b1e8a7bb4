"""A timeline of training steps from the engine's own events: what ran when on the compute
stream, the copy and communication streams, and the CPU worker.

[Note: the step timeline]
``Engine.record_timeline()`` records, while it is entered:
- compute: the phases of each step -- forward (from the module's call to ``engine.backward``),
  backward, and the rest until ``step()`` returns;
- host->device and device->host: every chunk upload and gradient offload (named by chunk) and
  every activation swap;
- collectives: the all-gathers and reduce-scatters of sharded chunks;
- CPU Adam: each streamed chunk's update, with the name of the thread that ran it (the worker
  thread, or the main thread where Adam runs inline: [Note: CPU Adam on a CPU device]).
Host-side work (CPU Adam, and everything on a CPU device) is timed with the device context's
clock; device-side work on CUDA with timing events on the stream that runs it, converted to
seconds from one event recorded right after a device synchronisation when recording began: a
span shows when the device ran the work. Recording changes nothing that is computed; a
simulated device (protrain_core/simulator) stamps with its own clocks, in simulated seconds.
"""

from __future__ import annotations

import dataclasses
import threading

from protrain_core.phase import StepObserver

LANES = ("compute", "host->device", "device->host", "collectives", "CPU Adam")


@dataclasses.dataclass(frozen=True)
class Span:
    lane: str  # one of LANES
    label: str  # "forward", "chunk 3", "activations", ...
    start: float  # seconds since the recording began
    end: float
    thread: str | None = None  # host work: the thread that ran it

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline(StepObserver):
    """Spans of work, filled by the engine while ``Engine.record_timeline()`` is entered and
    complete when it exits. ``spans``: every span, by start; ``lane(name)``: one lane's."""

    def __init__(self, ctx, *, threaded: bool = False) -> None:
        """``ctx``: the engine's DeviceContext (clock, stamps); ``threaded``: the CPU Adam runs on a thread."""
        self.ctx = ctx
        self.threaded = threaded
        self.spans: list[Span] = []
        self._pending: list[tuple[str, str, object, object, str | None]] = []  # stamps not yet converted
        self._open: dict[tuple[str, object], object] = {}  # (what, key) -> begin stamp
        self._lock = threading.Lock()  # the CPU worker records too
        ctx.synchronize_device()
        self._t0 = ctx.clock()
        self._origin = self.stamp() if self.ctx.is_cuda else None

    # ----- stamps --------------------------------------------------------------------------
    def stamp(self, stream=None):
        """Now on ``stream`` (CUDA: a timing event recorded on it) or on the host (a CPU device)."""
        return self.ctx.stamp(stream)

    def add(self, lane: str, label: str, begin, end, *, host: bool = False) -> None:
        """A span from two stamps (``host``: ``perf_counter`` readings taken by the calling thread)."""
        thread = self.ctx.thread_name() if host or not self.ctx.is_cuda else None
        with self._lock:
            self._pending.append((lane, label, begin, end, thread))

    def begin(self, lane: str, key, *, host: bool = False) -> None:
        with self._lock:
            self._open[(lane, key)] = self.ctx.clock() if host else self.stamp()

    def end(self, lane: str, key, label: str, *, host: bool = False) -> None:
        with self._lock:
            begin = self._open.pop((lane, key), None)
        if begin is not None:  # began before the recording: left out
            self.add(lane, label, begin, self.ctx.clock() if host else self.stamp(), host=host)

    # ----- the engine's events -------------------------------------------------------------------
    def event(self, what: str, index: int) -> None:
        """The runtime's point events (``Scheduler.record``): the CPU Adam of a chunk begins or ends."""
        if what == "cpu_adam_begin":
            self.begin("CPU Adam", index, host=True)
        elif what == "cpu_adam_end":
            self.end("CPU Adam", index, f"chunk {index}", host=True)

    # step observer (Engine.observe): the compute phases
    def batch_begins(self, _batch) -> None:
        self.begin("compute", "forward")

    def backward_begins(self) -> None:
        self.end("compute", "forward", "forward")
        self.begin("compute", "backward")

    def backward_ends(self) -> None:
        self.end("compute", "backward", "backward")
        self.begin("compute", "step")

    def step_ends(self) -> None:
        self.end("compute", "step", "step")

    # ----- the result -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Convert every stamp to seconds since the recording began (CUDA: waits for the device)."""
        if self.ctx.is_cuda:
            self.ctx.synchronize_device()
        with self._lock:
            pending, self._pending = self._pending, []
            self._open.clear()
        spans = [Span(lane, label, self._seconds(b), self._seconds(e), thread)
                 for lane, label, b, e, thread in pending]
        self.spans = sorted(self.spans + spans, key=lambda s: (s.start, s.lane))

    def _seconds(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self._t0
        return self._origin.elapsed_time(stamp) / 1e3

    def lane(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.lane == name]

    def to_json(self) -> dict:
        return {"device": str(self.ctx.device), "threaded": self.threaded,
                "lanes": [lane for lane in LANES if self.lane(lane)],
                "spans": [dataclasses.asdict(s) for s in self.spans]}
