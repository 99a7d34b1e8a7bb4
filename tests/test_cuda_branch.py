"""DeviceContext's CUDA branch without a GPU (issue 55, item 5): ``torch.cuda``'s streams, events
and stream context replaced by recording stubs, so that a wiring mistake in the branch -- one
stream for both copy directions, a copy not ordered after the compute stream's work or after
the event it is given, an event recorded on the wrong stream, a wait on the wrong side -- fails
here instead of training wrong on the first GPU that runs it. (The simulated device replaces
this branch; these tests read the branch itself.)"""

import contextlib
import itertools

import pytest
import torch

from protrain_core.runtime.device import DeviceContext


class Recording:
    """The calls the branch makes, in order: (what, stream name, detail)."""

    def __init__(self):
        self.calls = []
        self.active = "compute"
        self._ids = itertools.count()
        self.compute = self.stream("compute")

    def stream(self, name=None):
        log = self

        class Stream:
            def __init__(self):
                self.name = name or f"side-{next(log._ids)}"

            def wait_stream(self, other):
                log.calls.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                log.calls.append(("wait_event", self.name, event.name))

            def record_event(self):
                event = Event(self.name)
                log.calls.append(("record", self.name, event.name))
                return event

            def synchronize(self):
                log.calls.append(("synchronize stream", self.name, ""))

        class Event:
            def __init__(self, stream):
                self.stream, self.name = stream, f"event-{next(log._ids)}"

            def synchronize(self):
                log.calls.append(("synchronize event", self.stream, self.name))

            def query(self):
                return True

        return Stream()

    @contextlib.contextmanager
    def on(self, stream):
        previous, self.active = self.active, stream.name
        self.calls.append(("enter", stream.name, ""))
        try:
            yield
        finally:
            self.active = previous


@pytest.fixture
def cuda(monkeypatch):
    rec = Recording()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: rec.stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec.compute)
    monkeypatch.setattr(torch.cuda, "stream", rec.on)
    ctx = DeviceContext(torch.device("cuda", 0))
    return ctx, rec


def test_each_side_stream_is_its_own(cuda):
    ctx, rec = cuda
    streams = [ctx.h2d_stream, ctx.d2h_stream, ctx.swap_stream, ctx.comm_stream]
    assert len({s.name for s in streams} | {rec.compute.name}) == 5  # the two copy directions never share one


def test_a_copy_runs_on_its_stream_after_the_compute_streams_work_and_its_event(cuda):
    ctx, rec = cuda
    seen = []
    src, dst = torch.ones(4), torch.zeros(4)
    up = ctx.copy_async(dst, src, stream=ctx.h2d_stream, span=("host->device", "chunk 0"))
    down = ctx.run_on(ctx.d2h_stream, lambda: seen.append(rec.active), span=("device->host", "grads"))
    after = ctx.copy_async(src, dst, stream=ctx.swap_stream, after=down, span=("device->host", "swap"))
    h2d, d2h, swap = ctx.h2d_stream.name, ctx.d2h_stream.name, ctx.swap_stream.name
    assert rec.calls == [
        ("wait_stream", h2d, "compute"), ("enter", h2d, ""), ("record", h2d, up.name),
        ("wait_stream", d2h, "compute"), ("enter", d2h, ""), ("record", d2h, down.name),
        ("wait_stream", swap, "compute"), ("wait_event", swap, down.name), ("enter", swap, ""),
        ("record", swap, after.name),
    ]
    assert seen == [d2h] and torch.equal(dst, src)  # the work ran inside its stream's context


def test_waits_land_on_the_right_side(cuda):
    ctx, rec = cuda
    event = ctx.copy_async(torch.zeros(2), torch.ones(2), stream=ctx.h2d_stream, span=("host->device", "x"))
    rec.calls.clear()
    ctx.wait_on_compute(event)  # the compute stream waits, the host does not
    ctx.synchronize(event)  # the host waits
    ctx.synchronize_stream(ctx.d2h_stream)
    assert rec.calls == [("wait_event", "compute", event.name), ("synchronize event", ctx.h2d_stream.name, event.name),
                         ("synchronize stream", ctx.d2h_stream.name, "")]


def test_a_collective_runs_on_the_communication_stream(cuda):
    ctx, rec = cuda
    ran = []
    event = ctx.collective(lambda: ran.append(rec.active), then=lambda: ran.append("then " + rec.active))
    comm = ctx.comm_stream.name
    assert ran == [comm, "then " + comm] and event.stream == comm
    assert rec.calls[:2] == [("wait_stream", comm, "compute"), ("enter", comm, "")]
