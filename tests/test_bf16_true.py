"""precision="bf16-true" equals plain PyTorch ``model.to(torch.bfloat16)`` + ``AdamW(fused=True)``.

No fp32 master: the bf16 parameters are what Adam updates, gradients and Adam states are bf16
(as torch.optim keeps them for a bf16 module), no autocast, no loss scaling. The engine runs
the same bf16 forward/backward and the same fused kernel on the same bf16 tensors, so losses,
weights and optimizer states are bitwise equal.
"""

import copy

import pytest
import torch

import protrain_core as pt
from conftest import MODELS, batches, standard_plans, tiny_gpt2, tiny_llama, train_engine, train_reference
from test_clipping import CACHE_WARNING, Clipper, train_recording_norms

BF16 = torch.bfloat16


def adamw(params, **kw):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, **kw)


def reference(model, data, **kw):
    ref = copy.deepcopy(model).to(BF16)
    opt = adamw(ref.parameters(), fused=True)
    return ref, opt, train_reference(ref, opt, data, **kw)


def wrap_bf16(model, plan, clipping=None):
    return pt.wrap(model, adamw(model.parameters(), fused=True), plan, precision="bf16-true", device="cpu",
                   config=pt.ProTrainConfig(clipping=clipping, runtime=pt.RuntimeConfig(check_invariants=True)))


def assert_same_state(engine_sd, ref_sd):
    assert list(engine_sd) == list(ref_sd)
    for k, v in ref_sd.items():
        assert engine_sd[k].dtype == v.dtype and torch.equal(engine_sd[k], v), k


def assert_same_optimizer_state(engine_osd, ref_osd):
    assert engine_osd["param_groups"] == ref_osd["param_groups"]
    assert engine_osd["state"].keys() == ref_osd["state"].keys()
    for index, entry in ref_osd["state"].items():
        assert engine_osd["state"][index].keys() == entry.keys()
        for key, v in entry.items():
            assert engine_osd["state"][index][key].dtype == v.dtype and torch.equal(engine_osd["state"][index][key], v), (index, key)


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.grid(ci=lambda arch, plan_name: arch == "llama" or plan_name == "swap-checkpoint")
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_true_parity(arch, plan_name):
    model = MODELS[arch]()
    data = batches(8)
    ref, ref_opt, ref_losses = reference(model, data)
    engine = wrap_bf16(model, standard_plans(model)[plan_name])
    assert engine.precision is pt.Precision.BF16_TRUE and engine.precision.autocast_dtype is None and engine.scaler is None
    assert all(p.dtype == BF16 for p in engine.module.parameters())
    losses = train_engine(engine, data)
    assert losses == ref_losses
    assert ref_losses[-1] < ref_losses[0]  # it trains
    assert_same_state(engine.state_dict(), ref.state_dict())
    osd = engine.states.optimizer()
    assert_same_optimizer_state(osd, ref_opt.state_dict())
    entry = next(iter(osd["state"].values()))
    assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == BF16 and entry["step"].dtype == torch.float32
    if plan_name != "all-persistent":
        assert engine.scheduler.stats["cpu_updates"] > 0


def test_model_already_in_bf16():
    model = tiny_llama()
    data = batches(5)
    ref, _, ref_losses = reference(model, data)
    engine = wrap_bf16(copy.deepcopy(model).to(BF16), pt.Plan(n_persist=1, n_buffer=2))
    assert train_engine(engine, data) == ref_losses
    assert_same_state(engine.state_dict(), ref.state_dict())


def test_gradient_accumulation_in_bf16():
    """Micro-batch gradients are summed in bf16 (staging buffers for streamed chunks), as autograd does."""
    model = tiny_gpt2()
    data = batches(9, distinct=3)
    ref, _, ref_losses = reference(model, data, accumulate=3)
    engine = wrap_bf16(model, pt.Plan(n_persist=1, n_buffer=1))
    losses = train_engine(engine, data, accumulate=3)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)  # sum order of the printed loss only
    assert_same_state(engine.state_dict(), ref.state_dict())


def test_threaded_cpu_adam(monkeypatch):
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    model = tiny_llama()
    data = batches(5)
    ref, _, ref_losses = reference(model, data)
    engine = wrap_bf16(model, pt.Plan(n_persist=0, n_buffer=2))
    assert engine.scheduler.worker.threaded
    assert train_engine(engine, data) == ref_losses
    assert_same_state(engine.state_dict(), ref.state_dict())


@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=2), pt.Plan(n_persist=2, n_buffer=1)], ids=str)
def test_state_round_trip_with_plain_pytorch(plan):
    """Engine -> plain bf16 model + AdamW, and plain -> a fresh engine: all continue identically."""
    model = MODELS["gpt2"]()
    data = batches(8)
    engine = pt.wrap(model, adamw(model.parameters(), fused=True), plan, precision="bf16-true", device="cpu")
    train_engine(engine, data[:4])
    sd, osd = engine.state_dict(), engine.states.optimizer()
    plain = MODELS["gpt2"](seed=5).to(BF16)
    plain.load_state_dict(sd)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1.0, fused=True)  # lr comes from the state dict
    plain_opt.load_state_dict(copy.deepcopy(osd))
    fresh = MODELS["gpt2"](seed=6)
    engine2 = pt.wrap(fresh, torch.optim.AdamW(fresh.parameters(), lr=1.0), plan, precision="bf16-true", device="cpu")
    engine2.load_state_dict(plain.state_dict())
    engine2.states.load_optimizer(plain_opt.state_dict())
    assert_same_state(engine2.state_dict(), sd)
    assert_same_optimizer_state(engine2.states.optimizer(), osd)

    ref_losses = train_reference(plain, plain_opt, data[4:])
    assert train_engine(engine, data[4:]) == ref_losses
    assert train_engine(engine2, data[4:]) == ref_losses
    for e in (engine, engine2):
        assert_same_state(e.state_dict(), plain.state_dict())
        assert_same_optimizer_state(e.states.optimizer(), plain_opt.state_dict())


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2"])
def test_clipping_in_bf16(plan_name, algorithm):
    """clip_grad_norm_ / clip_grad_value_ on the bf16 gradients (bf16 norms, as torch computes them)."""
    model = tiny_llama()
    data = batches(6)
    clipper = Clipper(algorithm)
    ref, _, ref_losses = reference(model, data, clip=clipper)
    clipper.assert_triggered()
    engine = wrap_bf16(model, standard_plans(model)[plan_name], clipping=(algorithm, clipper.value))
    losses, norms = train_recording_norms(engine, data)
    assert losses == ref_losses
    clipper.assert_same_norms(norms)
    if algorithm == "norm":
        assert norms[-1].dtype == BF16
    assert_same_state(engine.state_dict(), ref.state_dict())


def test_precision_names():
    assert pt.Precision("bf16-true") is pt.Precision.BF16_TRUE
    p = pt.Precision.BF16_TRUE
    assert p.compute_dtype == p.master_dtype == BF16 and not p.is_mixed
    assert pt.Precision.BF16_MIXED.master_dtype == torch.float32 and pt.Precision.BF16_MIXED.is_mixed
    model = tiny_gpt2()
    for bad in ("16-true", "64-true", "transformer-engine"):
        with pytest.raises(ValueError, match="'bf16-true'"):
            pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), precision=bad, device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("persist", [0, 2])
def test_cuda_bf16_true(persist):
    model = tiny_gpt2()
    data = batches(8, device="cuda")
    ref = copy.deepcopy(model).cuda().to(BF16)
    ref_losses = train_reference(ref, adamw(ref.parameters(), fused=True), data)
    engine = pt.wrap(model, adamw(model.parameters()), pt.Plan(n_persist=persist, n_buffer=2), precision="bf16-true",
                     device="cuda", config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = train_engine(engine, data)
    assert engine.memory.host_locked_bytes() > 0 and all(p.dtype == BF16 for p in engine.module.parameters())
    # CPU Adam (streamed chunks) and CUDA Adam may round a bf16 result differently: close, not bitwise.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    assert losses[-1] < losses[0]
    assert all(v.dtype == BF16 for v in engine.state_dict().values())
