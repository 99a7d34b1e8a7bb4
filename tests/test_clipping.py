"""Gradient clipping equals plain PyTorch's clip_grad_norm_ / clip_grad_value_ (DESIGN §3).

fp32: the engine computes the same per-tensor norms of the same fp32 gradients, stacks them in
the same order and runs the same fused AdamW, so losses, norms and weights are bitwise equal.
Mixed precision: the reference clips the fp32 master gradients (after unscaling), as the
engine does; same tolerances as test_parity's mixed-precision test.
"""

import copy

import pytest
import torch

import protrain_core as pt
from conftest import (COMPARED_ACROSS_KERNELS_EPS, MODELS, assert_same_weights, batches, standard_plans, tiny_gpt2, tiny_llama,
                      train_engine, train_reference)
from test_overlap import _timeline
from test_parity import reference_mixed

CACHE_WARNING = "ignore:ProTrain. a key/value cache"  # swapped/checkpointed blocks run without the cache
MAX_NORM = 0.5  # the tiny models' gradient norms are ~1-5: clipping by norm triggers every step
CLIP_VALUE = 0.01  # some gradient elements exceed it every step


class Clipper:
    """Plain PyTorch clipping of a parameter list; records what the engine must reproduce."""

    def __init__(self, algorithm, value=None, norm_type=2.0):
        self.algorithm, self.norm_type = algorithm, norm_type
        self.value = value or (MAX_NORM if algorithm == "norm" else CLIP_VALUE)
        self.norms = []  # "norm": total norm before clipping, per step
        self.clamped = []  # "value": whether an element was outside [-value, value], per step

    def __call__(self, params):
        if self.algorithm == "norm":
            self.norms.append(torch.nn.utils.clip_grad_norm_(params, self.value, self.norm_type))
        else:
            self.clamped.append(any(bool((p.grad.abs() > self.value).any()) for p in params if p.grad is not None))
            torch.nn.utils.clip_grad_value_(params, self.value)

    def assert_triggered(self):
        if self.algorithm == "norm":
            finite = [n for n in self.norms if n.isfinite()]  # fp16 overflow steps give inf/nan
            assert finite and all(n > self.value for n in finite)
        else:
            assert self.clamped and all(self.clamped)

    def assert_same_norms(self, engine_norms):
        if self.algorithm == "norm":
            torch.testing.assert_close(torch.stack(engine_norms), torch.stack(self.norms), rtol=0, atol=0, equal_nan=True)
        else:
            assert all(n is None for n in engine_norms)


def train_recording_norms(engine, data):
    losses, norms = [], []
    for x in data:
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        norms.append(engine.clipping.last_norm)
    return losses, norms


def wrap_clipped(model, plan, algorithm, value):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return pt.wrap(model, opt, plan, device="cpu",
                   config=pt.ProTrainConfig(clipping=(algorithm, value), runtime=pt.RuntimeConfig(check_invariants=True)))


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.grid(ci=lambda arch, plan_name, algorithm: (arch == "llama" and plan_name in ("streamed-buf1", "swap-checkpoint"))
                  or (arch, plan_name, algorithm) in (("gpt2", "all-persistent", "norm"), ("gpt2", "mixed-buf2", "value")))
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fp32_clipping_parity(arch, plan_name, algorithm):
    model = MODELS[arch]()
    ref = copy.deepcopy(model)
    data = batches(6)
    clipper = Clipper(algorithm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    ref_losses = train_reference(ref, ref_opt, data, clip=clipper)
    clipper.assert_triggered()
    engine = wrap_clipped(model, standard_plans(model)[plan_name], algorithm, clipper.value)
    losses, norms = train_recording_norms(engine, data)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.parametrize("norm_type,max_norm", [(1.0, 5.0), (float("inf"), 0.01)])
def test_other_norm_types(norm_type, max_norm):
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    data = batches(5)
    clipper = Clipper("norm", max_norm, norm_type)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data, clip=clipper)
    clipper.assert_triggered()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=2), device="cpu")
    engine.clipping.configure("norm", max_norm, norm_type)
    losses, norms = train_recording_norms(engine, data)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.grid(ci=lambda arch, precision, dtype, plan_name, algorithm: (arch, precision) in (("llama", "16-mixed"), ("gpt2", "bf16-mixed"))
                  and plan_name == ("streamed-buf1" if algorithm == "norm" else "mixed-buf2"))
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("plan_name", ["streamed-buf1", "mixed-buf2"])
@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_mixed_precision_clipping_parity(arch, precision, dtype, plan_name, algorithm):
    """Clipping acts on the fp32 gradients the master update reads, after fp16 unscaling."""
    model = MODELS[arch]()
    data = batches(6)
    clipper = Clipper(algorithm)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    ref_losses, ref_master, _ = reference_mixed(model, dtype, data, lr=3e-3, scaler=scaler, clip=clipper)
    clipper.assert_triggered()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = pt.wrap(model, opt, standard_plans(model)[plan_name], precision=precision, device="cpu",
                     config=pt.ProTrainConfig(clipping=(algorithm, clipper.value), runtime=pt.RuntimeConfig(check_invariants=True)))
    losses, norms = train_recording_norms(engine, data)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    sd = engine.state_dict()
    for name, m in ref_master.items():
        torch.testing.assert_close(sd[name], m.detach(), rtol=1.2e-7, atol=0, msg=name)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_threaded_cpu_adam_clipping_parity(precision, algorithm, monkeypatch):
    """The worker-thread path (what CUDA uses) clips exactly like inline CPU Adam."""
    results = []
    for threaded in ("1", "0"):
        monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", threaded)
        model = tiny_gpt2()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=2),
                         precision=precision, device="cpu",
                         config=pt.ProTrainConfig(clipping=(algorithm, MAX_NORM if algorithm == "norm" else CLIP_VALUE), runtime=pt.RuntimeConfig(check_invariants=True)))
        assert engine.scheduler.worker.threaded == (threaded == "1")
        results.append((train_recording_norms(engine, batches(5)), engine.state_dict()))
    (losses, norms), sd = results[0]
    assert losses == results[1][0][0]
    if algorithm == "norm":
        assert torch.equal(torch.stack(norms), torch.stack(results[1][0][1]))
    for k, v in sd.items():
        assert torch.equal(v, results[1][1][k]), k


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_after_gradient_accumulation(algorithm):
    """Clipping applies to the gradient summed over the micro-batches, at the boundary only."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    data = batches(9, distinct=3)
    clipper = Clipper(algorithm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    ref_losses = train_reference(ref, ref_opt, data, accumulate=3, clip=clipper)
    clipper.assert_triggered()
    engine = wrap_clipped(model, pt.Plan(n_persist=1, n_buffer=1), algorithm, clipper.value)
    losses = train_engine(engine, data, accumulate=3)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)  # sum order of the printed loss only
    assert_same_weights(engine.state_dict(), ref)
    if algorithm == "norm":
        assert torch.equal(engine.clipping.last_norm, clipper.norms[-1])


@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=2, n_buffer=2)], ids=str)
def test_norm_clipping_with_fp16_overflow_skips(plan):
    """Overflowing steps report the inf/nan norm (as clip_grad_norm_ does) and are skipped."""
    model = tiny_gpt2()
    data = batches(8)
    clipper = Clipper("norm")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=3)
    ref_losses, ref_master, _ = reference_mixed(model, torch.float16, data, lr=3e-3, scaler=scaler, clip=clipper)
    assert not clipper.norms[0].isfinite()  # the first step overflowed
    clipper.assert_triggered()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, precision="16-mixed", device="cpu",
                     config=pt.ProTrainConfig(clipping=("norm", MAX_NORM)))
    engine.scaler.init_scale = 2.0**22
    engine.scaler.growth_interval = 3
    engine.scaler.__post_init__()
    losses, norms = train_recording_norms(engine, data)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    sd = engine.state_dict()
    for name, m in ref_master.items():
        torch.testing.assert_close(sd[name], m.detach(), rtol=0, atol=0, msg=name)


def test_norm_clipping_updates_after_backward_and_disabling_restores_the_overlap():
    model = tiny_llama(n_layer=6)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2),
                     device="cpu", config=pt.ProTrainConfig(clipping=("norm", 1.0)))
    assert engine.clipping.configured.value == 1.0
    assert engine.overlap == "cpu-adam-during-next-forward (gradient norm clipping)"
    x = batches(1)[0]
    events, backward_end = _timeline(engine, x)
    engine.zero_grad()
    begins = [t for what, _, t in events if what == "cpu_adam_begin"]
    assert begins and min(begins) > backward_end  # every update waited for the global norm

    engine.clipping.configure("value", 0.5)  # elementwise: keeps the overlap with backward
    assert engine.overlap == "cpu-adam-during-backward" and engine.clipping.last_norm is None
    events, backward_end = _timeline(engine, x)
    engine.zero_grad()
    assert min(t for what, _, t in events if what == "cpu_adam_begin") < backward_end

    engine.clipping.configure("norm", 1.0)
    engine.clipping.configure(None)
    assert engine.clipping.configured is None and engine.overlap == "cpu-adam-during-backward"
    events, backward_end = _timeline(engine, x)
    assert min(t for what, _, t in events if what == "cpu_adam_begin") < backward_end


@pytest.mark.parametrize(
    "args,match",
    [
        (("sum", 1.0), "must be 'norm'"),
        (("norm", None), "finite max_norm > 0"),
        (("norm", 0.0), "finite max_norm > 0"),
        (("value", -1.0), "finite clip_value > 0"),
        (("value", float("inf")), "finite clip_value > 0"),
        (("norm", float("nan")), "finite max_norm > 0"),
        (("norm", True), "finite max_norm > 0"),
        (("norm", 1.0, 0.0), "norm_type must be a number > 0"),
    ],
)
def test_bad_arguments(args, match):
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    with pytest.raises(ValueError, match=match):
        engine.clipping.configure(*args)
    assert engine.clipping.configured is None and engine.overlap.startswith("cpu-adam-during-next-forward (first step")


def test_changing_clipping_within_a_step():
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu",
                     config=pt.ProTrainConfig(clipping=("value", 0.1)))
    x = batches(1)[0]
    loss = engine.module(input_ids=x, labels=x).loss
    loss.register_hook(lambda g: engine.clipping.configure("value", 0.2))
    with pytest.raises(RuntimeError, match="during backward"):
        engine.backward(loss)
    engine.zero_grad()
    engine.backward(engine.module(input_ids=x, labels=x).loss)  # offloaded chunks are updated now
    engine.clipping.configure("value", 0.1)  # the same setting again (as a trainer may do each step)
    with pytest.raises(RuntimeError, match="after engine.step"):
        engine.clipping.configure("norm", 1.0)
    engine.step()
    engine.clipping.configure("norm", 1.0)


def test_explain_and_summary_mention_clipping():
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    assert "clipping" not in engine.explain()
    assert "gradient clipping: off" in engine.summary()
    engine.clipping.configure("norm", 1.0)
    for text in (engine.explain(), engine.summary()):
        assert "clipping by norm" in text and "overlapping the next forward" in text
    engine.clipping.configure("value", 1.0)
    assert "still overlaps backward" in engine.explain()


def test_explain_says_when_a_searched_plan_assumed_the_overlap():
    model = tiny_gpt2()
    x = batches(1)[0]
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), None, example_inputs={"input_ids": x, "labels": x},
                     device="cpu",
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB", profile_cache=False)))
    engine.clipping.configure("norm", 1.0)
    assert ("searched for cpu-adam-during-backward: ProTrainConfig(clipping={'algorithm': 'norm', ...}) searches for "
            "cpu-adam-during-next-forward") in engine.explain()


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("persist", [0, 2])
def test_cuda_clipping(algorithm, persist):
    model = tiny_gpt2()
    data = batches(6, device="cuda")
    ref = copy.deepcopy(model).cuda()
    clipper = Clipper(algorithm)
    eps = COMPARED_ACROSS_KERNELS_EPS  # why the weights' tolerance holds
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=eps, fused=True), data, clip=clipper)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=eps), pt.Plan(n_persist=persist, n_buffer=2),
                     device="cuda",
                     config=pt.ProTrainConfig(clipping=(algorithm, clipper.value), runtime=pt.RuntimeConfig(check_invariants=True)))
    losses, norms = train_recording_norms(engine, data)
    # Host gradients' norms and CPU Adam round differently from CUDA's kernels: close, not bitwise.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    if algorithm == "norm":
        assert all(n.is_cuda for n in norms)
        torch.testing.assert_close(torch.stack(norms), torch.stack(clipper.norms), rtol=1e-5, atol=0)
    assert_same_weights(engine.state_dict(), ref, rtol=1e-5, atol=1e-6)
