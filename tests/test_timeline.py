"""Engine.record_timeline: the spans of a step ([Note: the step timeline] in runtime/timeline.py)."""

import copy

import pytest
import torch

import protrain_core as pt
from conftest import batches, tiny_llama

PLAN = pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=1)


def step(engine, x):
    loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss.detach()


def engine_for(model, device="cpu"):
    return pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), PLAN, device=device)


def test_timeline_of_a_step_with_the_worker_thread(monkeypatch):
    """Every lane of a streamed, swapping plan: the compute phases in order, one upload per
    streamed chunk fetch and one gradient offload per streamed chunk, the swapped block's
    activations both ways, and each streamed chunk's CPU Adam on the worker thread, during
    backward."""
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    engine = engine_for(tiny_llama(n_layer=4))
    data = batches(3)
    for x in data[:2]:  # the first step holds its updates for a late clipping request
        step(engine, x)
    fetches = engine.scheduler.stats["fetches"]
    with engine.record_timeline() as timeline:
        step(engine, data[2])
    assert timeline.spans and all(0 <= s.start <= s.end for s in timeline.spans)
    phases = timeline.lane("compute")
    assert [s.label for s in phases] == ["forward", "backward", "step"]
    assert all(a.end <= b.start for a, b in zip(phases, phases[1:]))
    streamed = [c.index for c in engine.chunks if not c.persistent]
    uploads = [s for s in timeline.lane("host->device") if s.label.startswith("chunk")]
    assert len(uploads) == engine.scheduler.stats["fetches"] - fetches
    assert {s.label for s in uploads} == {f"chunk {i}" for i in streamed}
    offloads = [s.label for s in timeline.lane("device->host") if s.label.startswith("chunk")]
    assert sorted(offloads) == sorted(f"chunk {i}" for i in streamed)  # once each, in backward
    assert any(s.label == "activations" for s in timeline.lane("device->host"))  # the swapped block: out in forward
    assert any(s.label == "activations" for s in timeline.lane("host->device"))  # and back in backward
    adam = timeline.lane("CPU Adam")
    assert sorted(s.label for s in adam) == sorted(f"chunk {i}" for i in streamed)
    assert all(s.thread.startswith("protrain-cpu-adam") for s in adam)
    backward = phases[1]
    assert all(backward.start < s.start < backward.end for s in adam)  # begun during backward
    assert not timeline.lane("collectives")
    data = timeline.to_json()
    assert data["lanes"] == ["compute", "host->device", "device->host", "CPU Adam"]
    assert len(data["spans"]) == len(timeline.spans)
    engine.close()


def test_inline_cpu_adam_runs_in_the_main_thread():
    """The CPU default ([Note: CPU Adam on a CPU device]): Adam inline, named by its thread."""
    engine = engine_for(tiny_llama(n_layer=2))
    data = batches(3)
    for x in data[:2]:
        step(engine, x)
    with engine.record_timeline() as timeline:
        step(engine, data[2])
    adam = timeline.lane("CPU Adam")
    assert adam and {s.thread for s in adam} == {"MainThread"}
    engine.close()


def test_recording_changes_nothing_and_only_while_entered(monkeypatch):
    """Losses and weights are bitwise those of the same training without recording; nothing is
    recorded outside the context, and one timeline records at a time."""
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    base = tiny_llama(n_layer=4)
    data = batches(4)
    runs = []
    for record in (False, True):
        engine = engine_for(copy.deepcopy(base))
        losses = []
        for i, x in enumerate(data):
            if record and i == 2:
                with engine.record_timeline() as timeline:
                    losses.append(step(engine, x))
            else:
                losses.append(step(engine, x))
        engine.wait_for_updates()
        runs.append((losses, engine))
    (plain, e0), (recorded, e1) = runs
    assert [float(a) for a in plain] == [float(b) for b in recorded]
    a, b = e0.state_dict(), e1.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Detached on exit: the step after the context records nothing.
    assert e1.ctx.timeline is None
    calls = []
    timeline.add = timeline.begin = lambda *a, **k: calls.append(a)
    step(e1, data[0])
    e1.wait_for_updates()
    assert not calls
    with e1.record_timeline():
        with pytest.raises(RuntimeError, match="already recording"):
            with e1.record_timeline():
                pass
    e0.close()
    e1.close()


def test_an_error_inside_the_recording_detaches_it():
    """The error propagates as it was; the engine records nothing more and trains on."""
    engine = engine_for(tiny_llama(n_layer=2))
    data = batches(2)
    with pytest.raises(ValueError, match="user code"):
        with engine.record_timeline() as timeline:
            step(engine, data[0])
            raise ValueError("user code")
    assert engine.ctx.timeline is None and not timeline.spans
    assert torch.isfinite(step(engine, data[1]))
    with engine.record_timeline() as again:  # and a new recording works
        step(engine, data[0])
    assert [s.label for s in again.lane("compute")] == ["forward", "backward", "step"]
    engine.close()


@pytest.mark.cuda
def test_timeline_on_cuda_comes_from_device_events():
    """On CUDA the copies are timed on their streams: each upload ends before the compute
    stream's step phase ends, and the CPU Adam spans (host clock) fall inside the recording."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = engine_for(tiny_llama(n_layer=4), device="cuda")
    data = [x.cuda() for x in batches(3)]
    for x in data[:2]:
        step(engine, x)
    with engine.record_timeline() as timeline:
        step(engine, data[2])
    phases = timeline.lane("compute")
    assert [s.label for s in phases] == ["forward", "backward", "step"]
    end = phases[-1].end
    for lane in ("host->device", "device->host", "CPU Adam"):
        spans = timeline.lane(lane)
        assert spans and all(0 <= s.start <= s.end for s in spans), lane
    assert all(s.end <= end + 1e-3 for s in timeline.lane("host->device"))
    assert all(s.thread.startswith("protrain-cpu-adam") for s in timeline.lane("CPU Adam"))
    engine.close()
