"""What one simulated step did: its time, the compute stream's idle time by cause, host waits by
call site, the CPU Adam inside backward, bytes per direction -- from the simulated device's
records over a window (``StepReport.of``), with a text summary."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from protrain_core.simulator.clock import Records, Wait, Work
from protrain_core.utils import format_bytes, format_seconds


@dataclass(frozen=True)
class HostWaits:
    """The host waits of one call site in one training phase."""

    site: str
    label: str
    phase: str
    count: int
    seconds: float


@dataclass(frozen=True)
class StepReport:
    """One simulated step, from its backward to the next step's backward (a whole period of the
    steady state: backward, the update, the next forward with what it waits for)."""

    step_s: float
    backward_s: float
    compute_busy_s: float
    idle_s: dict[str, float]  # compute stream idle time by cause
    host_waits: tuple[HostWaits, ...]  # the thread that drives the device
    cpu_adam_s: float
    cpu_adam_in_backward_s: float
    bytes: dict[str, int]  # per direction ("host->device", "device->host", "collectives")
    copy_busy_backward_s: dict[str, float]  # per direction: time its link copied during backward
    duplex_backward_s: float  # both directions copying at once during backward
    idle_backward: tuple[tuple[str, float], ...] = ()  # each idle interval during backward: (cause, seconds)
    half_duplex_s: float = 0.0  # copies that waited for a copy of the other direction on their stream
    asynchronous: bool = True  # False: the CPU device, where everything runs in turn on the host thread
    collectives: dict[str, float] = field(default_factory=dict)  # stream -> seconds of collectives on it

    @property
    def cpu_adam_inside_backward(self) -> float:
        return self.cpu_adam_in_backward_s / self.cpu_adam_s if self.cpu_adam_s else 1.0

    def waits_for_backward(self, *prefixes: str) -> list[float]:
        """Each compute idle interval during backward whose cause starts with ``prefixes``."""
        return [s for cause, s in self.idle_backward if cause.startswith(prefixes)]

    @property
    def idle_total_s(self) -> float:
        return sum(self.idle_s.values())

    @classmethod
    def of(cls, records: Records, bwd: tuple[float, float], hi: float, worker_lane: str, *,
           asynchronous: bool = True) -> StepReport:
        """The window from ``bwd[0]`` to ``hi``, the step's backward ``bwd`` (compute-stream positions)."""
        lo = bwd[0]
        work = [w for w in records.work if w.end > lo and w.start < hi]
        busy = sum(_clip(w, lo, hi) for w in work if w.lane == "compute" and w.kind != "idle")
        adam = [w for w in work if w.lane == worker_lane and w.kind == "update"]
        # Each direction's copies, clipped to backward: one link each (clock.Link), so they never overlap.
        copies = {d: sorted((max(w.start, bwd[0]), min(w.end, bwd[1])) for w in work
                            if w.kind == "copy" and w.label == d and _clip(w, *bwd) > 0)
                  for d in ("host->device", "device->host")}
        idle, collectives = defaultdict(float), defaultdict(float)  # by cause, by stream
        for w in work:
            if w.kind == "idle":
                idle[w.label] += _clip(w, lo, hi)
            elif w.kind == "collective":
                collectives[w.lane] += _clip(w, lo, hi)
        return cls(
            step_s=hi - lo,
            backward_s=bwd[1] - bwd[0],
            compute_busy_s=busy,
            idle_s=dict(idle),
            host_waits=_waits(records.waits, lo, hi),
            cpu_adam_s=sum(_clip(w, lo, hi) for w in adam),
            cpu_adam_in_backward_s=sum(_clip(w, *bwd) for w in adam),
            bytes=_bytes(work, lo, hi),
            copy_busy_backward_s={d: sum(b - a for a, b in v) for d, v in copies.items()},
            duplex_backward_s=_overlap(copies["host->device"], copies["device->host"]),
            idle_backward=tuple((w.label, _clip(w, *bwd)) for w in work if w.kind == "idle" and _clip(w, *bwd) > 0),
            half_duplex_s=sum(_clip(w, lo, hi) for w in work if w.kind == "stall"),
            asynchronous=asynchronous,
            collectives=dict(collectives),
        )

    def text(self, predicted_s: float | None = None) -> str:
        """The summary ``protrain plan --simulate`` prints."""
        pct = lambda part, whole: f"{100 * part / whole:.0f} %" if whole else "-"  # noqa: E731
        lines = [f"simulated step {format_seconds(self.step_s)}"
                 + ("" if predicted_s is None else
                    f"; cost model {format_seconds(predicted_s)} ({100 * (self.step_s / predicted_s - 1):+.1f} %)")
                 + f"; backward {format_seconds(self.backward_s)}"]
        if not self.asynchronous:
            lines.append("the CPU device: compute, copies and the CPU Adam run in turn on the host thread")
        else:
            lines.append(f"compute stream busy {format_seconds(self.compute_busy_s)} "
                         f"({pct(self.compute_busy_s, self.step_s)}), idle {format_seconds(self.idle_total_s)}"
                         + (":" if self.idle_s else ""))
        causes = sorted(self.idle_s.items(), key=lambda kv: -kv[1])
        lines += [f"  {format_seconds(s):>9}  {cause}" for cause, s in causes[:8]]
        if len(causes) > 8:
            lines.append(f"  {format_seconds(sum(s for _, s in causes[8:])):>9}  {len(causes) - 8} other causes")
        lines.append("host waits of the thread that drives the device:" + ("" if self.host_waits else " none"))
        lines += [f"  {w.phase:>9} {w.count:4d} x {format_seconds(w.seconds):>9}  {w.label}  [{w.site}]"
                  for w in self.host_waits]
        lines.append(f"CPU Adam {format_seconds(self.cpu_adam_s)}, {pct(self.cpu_adam_in_backward_s, self.cpu_adam_s)} "
                     "of it inside backward")
        moved = ", ".join(f"{d} {format_bytes(b)}" for d, b in self.bytes.items() if b)
        lines.append(f"bytes: {moved or 'none'}; during backward host->device copied "
                     f"{format_seconds(self.copy_busy_backward_s['host->device'])}, device->host "
                     f"{format_seconds(self.copy_busy_backward_s['device->host'])}, both at once "
                     f"{format_seconds(self.duplex_backward_s)}"
                     + (f"; copies queued behind the other direction's on one stream "
                        f"{format_seconds(self.half_duplex_s)}" if self.half_duplex_s else ""))
        if self.collectives:
            on = ", ".join(f"{format_seconds(s)} on the {lane} stream" for lane, s in sorted(self.collectives.items()))
            lines.append(f"collectives: {on}; during backward the compute stream waited "
                         f"{format_seconds(sum(self.waits_for_backward('all-gather')))} for all-gathers, "
                         f"{format_seconds(sum(self.waits_for_backward('reduce-scatter')))} for reduce-scatters")
        return "\n".join(lines)


def _clip(w: Work, lo: float, hi: float) -> float:
    return max(0.0, min(w.end, hi) - max(w.start, lo))


def _waits(waits: list[Wait], lo: float, hi: float) -> tuple[HostWaits, ...]:
    """The host thread's waits by call site, label and phase, the longest first."""
    groups: dict[tuple[str, str, str], list[Wait]] = defaultdict(list)
    for w in waits:
        if w.lane == "host" and w.end > lo and w.start < hi:
            groups[(w.site, w.label if not w.label.startswith("chunk ") else "a chunk's copy", w.phase)].append(w)
    out = [HostWaits(site, label, phase, len(ws), sum(min(w.end, hi) - max(w.start, lo) for w in ws))
           for (site, label, phase), ws in groups.items()]
    return tuple(sorted(out, key=lambda h: -h.seconds))


def _bytes(work: list[Work], lo: float, hi: float) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for w in work:
        if w.nbytes and lo <= w.start < hi:
            out["collectives" if w.kind == "collective" else w.label] += w.nbytes
    return dict(out)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """The time two sorted lists of disjoint intervals share."""
    total, i, j = 0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total
