"""Exact torch.optim semantics: param groups, frozen params, accumulation, schedules, fp16 skips."""

import copy

import pytest
import torch

import protrain_core as pt
from conftest import MODELS, VOCAB, assert_same_weights, batches, n_chunks, tiny_gpt2, train_engine, train_reference

PLANS = [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=2, n_buffer=2)]


def grouped(model, cls=torch.optim.AdamW, **kw):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return cls(
        [
            {"params": decay, "weight_decay": 0.1, "lr": 2e-3},
            {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3, "betas": (0.8, 0.95), "eps": 1e-6},
        ],
        **kw,
    )


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_param_groups(arch, plan):
    model = MODELS[arch]()
    ref = copy.deepcopy(model)
    data = batches(6)
    ref_losses = train_reference(ref, grouped(ref, fused=True), data)
    engine = pt.wrap(model, grouped(model), plan, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    assert train_engine(engine, data) == ref_losses
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_adam_l2_and_amsgrad_and_maximize(plan):
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    data = batches(6)
    kw = dict(lr=2e-3, weight_decay=0.05, amsgrad=True)
    ref_losses = train_reference(ref, torch.optim.Adam(ref.parameters(), fused=True, **kw), data)
    engine = pt.wrap(model, torch.optim.Adam(model.parameters(), **kw), plan, device="cpu")
    assert train_engine(engine, data) == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    osd = engine.states.optimizer()
    assert set(next(iter(osd["state"].values()))) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_frozen_parameters(plan):
    """requires_grad=False params get no gradient, no optimizer state and never change."""
    model = tiny_gpt2()
    for name, p in model.named_parameters():
        if ".h.0." in name or ".h.2.attn" in name or "wpe" in name:
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = batches(6)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, fused=True)
    ref_losses = train_reference(ref, ref_opt, data)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    engine = pt.wrap(model, opt, plan, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    assert train_engine(engine, data) == ref_losses
    sd = engine.state_dict()
    assert_same_weights(sd, ref)
    for n, v in frozen.items():
        assert torch.equal(sd[n], v)
    assert len(engine.states.optimizer()["state"]) == len(ref_opt.state_dict()["state"])
    for c in engine.chunks:  # frozen-only chunks hold no gradient buffer and no Adam state
        if not c.grad_members:
            assert c.storage.grad_acc is None and c.storage.exp_avg is None


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_gradient_accumulation(plan, precision):
    """fp32: plain PyTorch accumulation. bf16-mixed: the same engine with every chunk persistent
    (a chunk plan does not change a bit). Streamed chunks are updated once per step, during the
    last micro-batch's backward."""
    model = tiny_gpt2()
    data = batches(12, distinct=4)
    if precision == "32-true":
        ref = copy.deepcopy(model)
        ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data, accumulate=3)
    else:
        ref = copy.deepcopy(model)
        ref_engine = pt.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3), pt.Plan(n_persist=n_chunks(ref), n_buffer=0),
                             precision=precision, device="cpu")
        ref_losses = train_engine(ref_engine, data, accumulate=3)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, precision=precision, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = train_engine(engine, data, accumulate=3)
    assert len(losses) == 4
    if precision == "32-true":
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)  # sum order of the printed loss only
        assert_same_weights(engine.state_dict(), ref)
    else:
        assert losses == ref_losses
        ref_sd = ref_engine.state_dict()
        assert all(torch.equal(v, ref_sd[k]) for k, v in engine.state_dict().items())
    streamed = engine.layout.n_chunks - plan.n_persist
    assert engine.scheduler.stats["cpu_updates"] == 4 * streamed


def test_accumulation_without_no_sync_is_refused():
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="no_sync"):
        engine.backward(engine.module(input_ids=x, labels=x).loss)


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_lr_schedule(plan):
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    data = batches(8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    ref_losses = train_reference(ref, ref_opt, data, scheduler=torch.optim.lr_scheduler.StepLR(ref_opt, 2, gamma=0.3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.3)
    engine = pt.wrap(model, opt, plan, device="cpu")
    losses = []
    with _no_scheduler_warning():
        for x in data:
            loss = engine.module(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            sched.step()
            losses.append(loss.item())
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.3**4)


class _no_scheduler_warning:
    """LR schedulers warn when optimizer.step() was never called; engine.step() calls it."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")

    def __exit__(self, *a):
        return self._cm.__exit__(*a)


def test_lr_change_between_backward_and_step_is_refused():
    """Refused once offloaded chunks are updated during backward (after the first step, which
    holds its updates for a late clipping request: there the change is simply used)."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    opt.param_groups[0]["lr"] = 5e-3
    engine.step()
    engine.zero_grad()
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    opt.param_groups[0]["lr"] = 1e-3
    with pytest.raises(RuntimeError, match="after engine.step"):
        engine.step()


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_fp16_overflow_skips_exactly_like_grad_scaler(plan):
    """A huge initial scale overflows the first steps: both skip them and back off identically."""
    from test_parity import reference_mixed

    model = tiny_gpt2()
    data = batches(8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=3)
    ref_losses, ref_master, _ = reference_mixed(model, torch.float16, data, lr=3e-3, scaler=scaler)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, precision="16-mixed", device="cpu")
    engine.scaler.init_scale = 2.0**22
    engine.scaler.growth_interval = 3
    engine.scaler.__post_init__()
    skipped_before = engine.state_dict()
    losses = []
    scales = []
    for x in data:
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        scales.append(engine.scaler.scale.item())
    assert losses == ref_losses
    assert scales[0] < 2.0**22  # the first step overflowed and was skipped
    assert any(b > a for a, b in zip(scales, scales[1:]))  # later clean steps grew it again
    assert engine.states.scaler()["scale"] == scaler.get_scale()
    assert engine.states.scaler()["_growth_tracker"] == scaler.state_dict()["_growth_tracker"]
    sd = engine.state_dict()
    for name, m in ref_master.items():
        torch.testing.assert_close(sd[name], m.detach(), rtol=0, atol=0, msg=name)
    assert any(not torch.equal(sd[k], skipped_before[k]) for k in sd)


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_no_grad_evaluation_and_generation(plan):
    model = tiny_gpt2()
    ref = copy.deepcopy(model).eval()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    engine.module.eval()
    x = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(engine.module(input_ids=x).logits, ref(input_ids=x).logits, rtol=0, atol=0)
        prompt = x[:1, :4]
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(engine.module.generate(prompt, **kw), ref.generate(prompt, **kw))
    # Training after evaluation still matches.
    engine.module.train()
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    assert train_engine(engine, batches(3)) == train_reference(ref, ref_opt, batches(3))


def test_unused_parameters_are_skipped_like_torch():
    """A parameter that gets no gradient is not updated and gets no state (torch skips grad=None)."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 16)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
            self.unused = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, input_ids):
            h = self.emb(input_ids)
            for layer in self.layers:
                h = torch.tanh(layer(h))
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), input_ids.flatten())

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu", example_inputs=(batches(1)[0],),
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    for x in batches(4):
        loss = engine.module(x)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_weights(engine.state_dict(), ref)
    assert len(engine.states.optimizer()["state"]) == len(ref_opt.state_dict()["state"])
