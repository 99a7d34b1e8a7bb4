"""Clipping and fp16 with the CPU Adam still overlapped ([Note: finishing gradients early]).

Under norm clipping and fp16 the streamed chunks' gradients are finished (unscaled, their norms
taken) as they land, and their Adam runs after backward, overlapping the next forward. The
results are those of plain PyTorch's clip_grad_norm_ / clip_grad_value_ and GradScaler: bitwise
in fp32, and with the tolerances of test_clipping in mixed precision -- whether the clipping is
configured ahead (``ProTrainConfig(clipping=...)``) or requested between backward and step
(``engine.clipping.clip_grad_norm_``, as ``fabric.clip_gradients`` does), active or not, with or
without gradient accumulation.
"""

import contextlib
import copy
import threading
import time

import pytest
import torch

import protrain_core as pt
from conftest import assert_same_weights, batches, standard_plans, tiny_gpt2, tiny_llama, train_reference
from protrain_core.profiler.boundaries import Boundary as B
from protrain_core.runtime.optim import ChunkOptimizer
from test_clipping import CACHE_WARNING, CLIP_VALUE, MAX_NORM, Clipper
from test_parity import reference_mixed

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def run_engine(engine, data, *, accumulate=1, late=None, clip_at=None):
    """Train; ``late`` = (algorithm, value) is requested between backward and step, at the steps
    ``clip_at(step)`` selects (default every step). Returns the losses and the norms seen (the
    late call's return value, or ``last_grad_norm`` of a configured norm clipping)."""
    losses, norms = [], []
    for step, i in enumerate(range(0, len(data), accumulate)):
        micro, total = data[i:i + accumulate], 0.0
        for j, x in enumerate(micro):
            with engine.no_sync() if j < len(micro) - 1 else contextlib.nullcontext():
                loss = engine.module(input_ids=x, labels=x).loss / len(micro)
                engine.backward(loss)
            total += loss.item()
        if late is not None and (clip_at is None or clip_at(step)):
            if late[0] == "norm":
                norms.append(engine.clipping.clip_grad_norm_(late[1]))
            else:
                engine.clipping.clip_grad_value_(late[1])
        engine.step()
        if late is None and engine.clipping.configured is not None and engine.clipping.configured.algorithm == "norm":
            norms.append(engine.clipping.last_norm)
        engine.zero_grad()
        losses.append(total)
    return losses, norms


def reference(model, precision, data, *, clip, accumulate=1, scaler_kw=None, prepare=None):
    """Plain PyTorch: (losses, the state to compare: a model (fp32) or its fp32 masters)."""
    if precision == "32-true":
        ref = copy.deepcopy(model)
        if prepare is not None:
            prepare(ref)
        opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
        return train_reference(ref, opt, data, accumulate=accumulate, clip=clip), ref
    scaler = torch.amp.GradScaler("cpu", **(scaler_kw or {})) if precision == "16-mixed" else None
    losses, master, _ = reference_mixed(model, DTYPES[precision], data, lr=3e-3, scaler=scaler, clip=clip,
                                        accumulate=accumulate, prepare=prepare)
    return losses, (master, scaler)


def assert_same_state(engine, precision, ref_state):
    if precision == "32-true":
        assert_same_weights(engine.state_dict(), ref_state)
        return
    master, scaler = ref_state
    sd = engine.state_dict()
    for name, m in master.items():
        torch.testing.assert_close(sd[name], m.detach(), rtol=1.2e-7, atol=0, msg=name)
    if scaler is not None:
        assert engine.scaler.state_dict()["scale"] == scaler.get_scale()


def wrap(model, plan, precision, clipping=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return pt.wrap(model, opt, plan, precision=precision, device="cpu",
                   config=pt.ProTrainConfig(clipping=clipping, runtime=pt.RuntimeConfig(check_invariants=True)))


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.grid(ci=lambda plan_name, precision, active, accumulate, how: (plan_name == "streamed-buf1" and active and how == "late")
                  or (plan_name, precision, active, accumulate, how) in {("mixed-buf2", "16-mixed", False, 1, "ahead"),
                                                                         ("swap-checkpoint", "bf16-mixed", True, 2, "ahead"),
                                                                         ("all-persistent", "32-true", True, 1, "late")})
@pytest.mark.parametrize("how", ["ahead", "late"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
def test_norm_clipping_grid(plan_name, precision, active, accumulate, how):
    model = tiny_llama()
    data = batches(8)
    clipper = Clipper("norm", MAX_NORM if active else 1e4)
    ref_losses, ref_state = reference(model, precision, data, clip=clipper, accumulate=accumulate)
    finite = [n for n in clipper.norms if n.isfinite()]
    assert finite and (all(n > clipper.value for n in finite) if active else all(n < clipper.value for n in finite))
    setting = ("norm", clipper.value)
    engine = wrap(model, standard_plans(model)[plan_name], precision,
                  clipping=setting if how == "ahead" else None)
    losses, norms = run_engine(engine, data, accumulate=accumulate, late=setting if how == "late" else None)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    assert_same_state(engine, precision, ref_state)
    if plan_name != "all-persistent":
        assert engine.overlap.startswith("cpu-adam-during-next-forward")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_late_value_clipping(precision):
    model = tiny_gpt2()
    data = batches(5)
    clipper = Clipper("value")
    ref_losses, ref_state = reference(model, precision, data, clip=clipper)
    clipper.assert_triggered()
    engine = wrap(model, pt.Plan(n_persist=1, n_buffer=1), precision)
    losses, _ = run_engine(engine, data, late=("value", CLIP_VALUE))
    assert losses == ref_losses
    assert_same_state(engine, precision, ref_state)


def test_conditional_late_clipping_when_expected():
    """An adapter that clips late but not at every step (an overridden
    configure_gradient_clipping) says so ahead: every step stays exact."""
    model = tiny_llama()
    data = batches(6)
    torch_clip = Clipper("norm")
    steps = iter(range(100))

    def clip_odd_steps(params):
        if next(steps) % 2 == 1:
            torch_clip(params)

    ref_losses, ref = reference(model, "32-true", data, clip=clip_odd_steps)
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=1), "32-true")
    engine.clipping.expect_late()
    assert engine.overlap == "cpu-adam-during-next-forward (gradient clipping or gradient changes expected after backward)"
    losses, norms = run_engine(engine, data, late=("norm", MAX_NORM), clip_at=lambda step: step % 2 == 1)
    assert losses == ref_losses
    torch_clip.assert_same_norms(norms)
    assert_same_weights(engine.state_dict(), ref)


def test_late_clipping_after_an_unclipped_step_is_refused():
    model = tiny_gpt2()
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=1), "32-true")
    x = batches(1)[0]
    run_engine(engine, [x])  # the first step holds its updates; none was requested
    assert engine.overlap == "cpu-adam-during-backward"
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="Clip from the first step on, or say so before training"):
        engine.clipping.clip_grad_norm_(1.0)
    engine.step()


def test_clipping_at_the_first_step_keeps_later_steps_exact():
    """The first step holds its updates; a late request there keeps every later step held."""
    model = tiny_gpt2()
    data = batches(4)
    clipper = Clipper("norm")
    ref_losses, ref = reference(model, "32-true", data, clip=clipper)
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=2), "32-true")
    assert engine.overlap.startswith("cpu-adam-during-next-forward (first step")
    losses, norms = run_engine(engine, data, late=("norm", MAX_NORM))
    assert engine.overlap == "cpu-adam-during-next-forward (gradient clipping requested after backward in an earlier step)"
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    assert_same_weights(engine.state_dict(), ref)
    assert "requested after backward" in engine.summary()


def test_late_request_and_configured_clipping():
    model = tiny_gpt2()
    data = batches(4)
    clipper = Clipper("norm")
    ref_losses, ref = reference(model, "32-true", data, clip=clipper)
    engine = wrap(model, pt.Plan(n_persist=1, n_buffer=1), "32-true",
                  clipping=("norm", MAX_NORM))
    losses, norms = run_engine(engine, data, late=("norm", MAX_NORM))  # the same setting: not clipped twice
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    assert_same_weights(engine.state_dict(), ref)
    x = data[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(ValueError, match=r"already clips with by norm \(max_norm 0.5"):
        engine.clipping.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="Configure one of the two"):
        engine.clipping.clip_grad_value_(0.1)
    engine.step()


def test_late_calls_outside_a_step_are_refused():
    model = tiny_gpt2()
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=1), "32-true")
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="after engine.backward"):
        engine.clipping.clip_grad_norm_(1.0)
    with engine.no_sync():
        engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="outside no_sync"):
        engine.clipping.grad_norm()
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.clipping.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="once per step"):
        engine.clipping.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="finite max_norm"):
        engine.clipping.clip_grad_norm_(-1.0)
    engine.step()


@pytest.mark.parametrize("error_if_nonfinite", [True, False])
def test_nonfinite_norm(error_if_nonfinite):
    """fp16 overflow: the late norm is inf/nan; error_if_nonfinite raises as clip_grad_norm_ does."""
    model = tiny_gpt2()
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=1), "16-mixed")
    engine.scaler.init_scale = 2.0**40
    engine.scaler.__post_init__()
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    if error_if_nonfinite:
        with pytest.raises(RuntimeError, match="non-finite"):
            engine.clipping.clip_grad_norm_(1.0, error_if_nonfinite=True)
    # Nothing was recorded by the refused call: the step may still clip.
    assert not engine.clipping.clip_grad_norm_(1.0).isfinite()
    before = engine.state_dict()
    engine.step()  # skipped
    for k, v in engine.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert engine.scaler.state_dict()["scale"] == 2.0**39


def test_grad_norm_without_clipping_in_every_schedule():
    """engine.clipping.grad_norm() equals torch's total norm whether the chunks were updated during
    backward (after the first step) or not; it clips nothing."""
    model = tiny_llama()
    data = batches(3)
    ref = copy.deepcopy(model)
    expected = []
    train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data,
                    clip=lambda params: expected.append(torch.nn.utils.get_total_norm([p.grad for p in params])))
    engine = wrap(model, pt.Plan(n_persist=1, n_buffer=1), "32-true")
    got = []
    for x in data:
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        got.append(engine.clipping.grad_norm())
        engine.step()
        engine.zero_grad()
    assert engine.overlap == "cpu-adam-during-backward"
    assert torch.equal(torch.stack(got), torch.stack(expected))
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=2, n_buffer=2)], ids=str)
def test_injected_inf_skips_the_step_like_grad_scaler(plan):
    """An inf in one gradient at step 2 (a tensor hook on both models): the step is skipped and
    the scale backs off exactly as GradScaler's; the steps around it train as usual."""
    model = tiny_gpt2()
    data = batches(5)
    clipper = Clipper("norm")

    def inject(m):
        calls = iter(range(100))
        weight = m.transformer.h[1].mlp.c_fc.weight  # a streamed chunk's member in both plans
        weight.register_hook(lambda g: g * float("inf") if next(calls) == 2 else g)

    ref_losses, ref_state = reference(model, "16-mixed", data, clip=clipper, prepare=inject)
    assert [bool(n.isfinite()) for n in clipper.norms] == [True, True, False, True, True]
    inject(model)
    engine = wrap(model, plan, "16-mixed", clipping=("norm", MAX_NORM))
    losses, norms = run_engine(engine, data)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    assert_same_state(engine, "16-mixed", ref_state)
    assert engine.scaler.state_dict()["scale"] == 2.0**15  # backed off once from 2**16


def slow_cpu_adam(monkeypatch, seconds):
    """The CPU worker's Adam takes ``seconds`` longer per chunk (device Adam is unchanged)."""
    update = ChunkOptimizer.update

    def slow(self, *args, **kwargs):
        if threading.current_thread().name.startswith("protrain-cpu-adam"):
            time.sleep(seconds)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(ChunkOptimizer, "update", slow)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("precision,clipping", [("32-true", ("norm", 1.0)), ("16-mixed", None)])
def test_cpu_adam_overlaps_the_next_forward(precision, clipping, device, monkeypatch):
    """Evidence of the overlap (not a timing test): with a slow CPU Adam on the worker thread,
    every streamed update of a clipped (or fp16) step begins after its backward, step() returns
    before they end, and the next forward is already running while some of them still run."""
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    slow_cpu_adam(monkeypatch, 0.05)
    model = tiny_llama(n_layer=6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=2), precision=precision, device=device,
                     config=pt.ProTrainConfig(clipping=clipping, runtime=pt.RuntimeConfig(check_invariants=True)))
    if engine.scaler is not None:  # no overflow: a skipped step updates nothing
        engine.scaler.init_scale = 1.0
        engine.scaler.__post_init__()
    assert engine.overlap.startswith("cpu-adam-during-next-forward")
    forward_starts = []
    for block in model.model.layers:
        block.register_forward_pre_hook(lambda *_: forward_starts.append(time.perf_counter()))
    x = batches(1, device=device)[0]
    run_engine(engine, [x])  # warm-up
    engine.wait_for_updates()
    rt = engine.scheduler
    rt.events.clear()
    rt.record_events = True
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    backward_end = time.perf_counter()
    engine.step()
    step_returned = time.perf_counter()
    engine.zero_grad()
    forward_starts.clear()
    loss = engine.module(input_ids=x, labels=x).loss  # the next step
    next_backward = time.perf_counter()
    engine.backward(loss)
    engine.step()
    engine.wait_for_updates()
    rt.record_events = False
    # The first step's updates end before the next backward: every chunk's forward waited for its own.
    ends = sorted(t for what, _, t in rt.events if what == "cpu_adam_end" and t < next_backward)
    begins = [t for what, _, t in rt.events if what == "cpu_adam_begin" and t < next_backward]
    assert len(ends) == engine.layout.n_chunks  # every chunk of the first step was updated...
    assert min(begins) > backward_end  # ... after its backward,
    assert step_returned < ends[-1]  # ... step() did not wait for them,
    assert forward_starts[0] < ends[-1]  # ... and the next forward ran while they did.


def test_grad_norm_is_refused_after_value_clipping_updated_chunks():
    model = tiny_gpt2()
    engine = wrap(model, pt.Plan(n_persist=1, n_buffer=1), "32-true",
                  clipping=("value", CLIP_VALUE))
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)  # value clipping: updated during backward
    with pytest.raises(RuntimeError, match="clamped when they were updated during backward"):
        engine.clipping.grad_norm()
    engine.step()


def test_zero_grad_without_a_step_forgets_the_finished_gradients(monkeypatch):
    """A discarded backward (zero_grad, no step) under fp16 with the worker thread: its overflow
    must not leak into the next step, however late the worker finishes it."""
    from protrain_core.runtime.gradients import Finishing

    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    finish = Finishing.unscaled

    def slow_finish(self, found):
        if threading.current_thread().name.startswith("protrain-cpu-adam"):
            time.sleep(0.05)
        return finish(self, found)

    monkeypatch.setattr(Finishing, "unscaled", slow_finish)
    model = tiny_llama(n_layer=2)
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=2), "16-mixed")
    x = batches(1)[0]
    run_engine(engine, [x])
    engine.backward(engine.module(input_ids=x, labels=x).loss * float("inf"))  # a bad batch, discarded
    engine.zero_grad()
    engine.replan(pt.Plan(n_persist=engine.layout.n_chunks, n_buffer=0))
    before, scale = engine.state_dict(), engine.scaler.state_dict()["scale"]
    run_engine(engine, [x])
    after = engine.state_dict()
    assert engine.scaler.state_dict()["scale"] == scale  # the good step was not skipped
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_model_state_dict_right_after_step_waits_for_the_updates(monkeypatch):
    """model.state_dict() (what save_pretrained calls) between step() and the next forward reads
    the updated weights."""
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    slow_cpu_adam(monkeypatch, 0.02)
    model = tiny_gpt2()
    engine = wrap(model, pt.Plan(n_persist=0, n_buffer=1), "32-true", clipping=("norm", 1.0))
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    direct = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in engine.state_dict().items():
        assert torch.equal(direct[k], v), k


@pytest.mark.parametrize("clipping", [None, ("norm", 1.0)])
def test_live_profiling_does_not_time_the_updates_as_forward(clipping, monkeypatch):
    """The profiled steps let the updates that would overlap the next forward finish first, so
    a slow CPU Adam does not show in the profile's forward times (clipped or not). An ordering,
    not a timing: no CPU update is running when a profiled forward starts its clock."""
    import protrain_core.api
    from protrain_core.profiler.live import LiveProfiler

    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    slow_cpu_adam(monkeypatch, 0.05)
    running, starts = [0], []  # CPU updates running now; at each profiled forward's start, how many ran
    lock = threading.Lock()
    update, boundary = ChunkOptimizer.update, LiveProfiler._boundary

    def counted_update(self, *args, **kwargs):
        with lock:
            running[0] += 1
        try:
            return update(self, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    def recorded_boundary(self, kind, seg):
        if kind == B.FORWARD and seg == 0:
            with lock:
                starts.append(running[0])
        return boundary(self, kind, seg)

    monkeypatch.setattr(ChunkOptimizer, "update", counted_update)
    monkeypatch.setattr(LiveProfiler, "_boundary", recorded_boundary)
    # The safe plan a model larger than the device gets (on a CPU device every chunk would persist).
    monkeypatch.setattr(protrain_core.api, "safe_plan",
                        lambda formats, limits, *a, **k: pt.Plan(n_persist=0, n_buffer=2, n_checkpoint=limits.n_blocks))
    model = tiny_llama(n_layer=6)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), None, device="cpu",
                     report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB", profile_cache=False), clipping=clipping))
    assert engine.plan.n_persist == 0  # profiling on the streamed safe plan
    run_engine(engine, batches(8))
    assert engine.profile is not None and len(starts) >= 3, starts  # profiled forwards after updates
    assert starts == [0] * len(starts), starts
