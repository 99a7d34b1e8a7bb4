"""The check at wrap is what the runtime needs ([Note: plan validity] in plan.py): for models
whose modules need several streamed chunks at once -- a T5 encoder-decoder, a parameter shared
by two blocks, a block calling another block's module, a module with parameters calling a child
with parameters (traced, or not: by the modules' nesting), a user's module owning a parameter
around a Hugging Face LM -- every plan wrap accepts trains exactly like plain PyTorch, and one buffer
fewer is refused by wrap with the number to use, before anything is allocated."""

import copy

import pytest
import torch
from torch import nn

import protrain_core as pt
from conftest import assert_same_weights, tiny_gpt2
from protrain_core.plan import check_plan


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.extra: nn.Module | None = None  # a module of another block, called inside this one

    def forward(self, x):
        x = x + torch.tanh(self.lin(x))
        return x if self.extra is None else x + self.extra(x)


class Head(nn.Module):
    """Owns a parameter and calls a child with parameters: a unit running inside another."""

    def __init__(self, d=64):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(x * self.scale)


class Stack(nn.Module):
    def __init__(self, share: str | None, n=5, d=64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = Head(d)
        if share == "parameter":
            self.blocks[3].lin.weight = self.blocks[0].lin.weight
        elif share == "module":
            self.blocks[3].extra = self.blocks[0].lin

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


class Tempered(nn.Module):
    """A user's module owning a parameter around a Hugging Face LM (which is traced alone): its
    unit runs around every unit of the LM."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_gpt2()
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        logits = self.lm(input_ids=x).logits / self.temperature
        return nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())


def tempered():
    torch.manual_seed(0)
    return Tempered()


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    return T5ForConditionalGeneration(cfg)


def stack(share):
    def make():
        torch.manual_seed(0)
        return Stack(share)

    return make


def _inputs(name):
    g = torch.Generator().manual_seed(3)
    if name == "t5":
        x = torch.randint(1, 64, (2, 8), generator=g)
        return {"input_ids": x, "labels": x}
    if name == "hf-wrapper":
        return (torch.randint(0, 96, (2, 16), generator=g),)
    return (torch.randn(4, 64, generator=g),)


def _loss(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out.loss if hasattr(out, "loss") else out


MODELS = {
    "t5": (t5, {}),
    "shared-parameter": (stack("parameter"), {"chunk_size": 64 * 64 + 64}),
    # Blocks 2 and 3 share a chunk: block 3's forward needs chunk 0 while chunk 3, prefetched
    # after block 2, is still arriving -- the unused prefetch must give its buffer up.
    "shared-parameter-packed": (stack("parameter"), {}),
    "shared-module": (stack("module"), {"chunk_size": 64 * 64 + 64}),
    "nested-units": (stack(None), {"chunk_size": 64 * 64 + 64}),
    # Without example inputs nothing is traced: the head's unit is taken to run around its child's.
    "nested-units-untraced": (stack(None), {"chunk_size": 64 * 64 + 64}),
    "hf-wrapper": (tempered, {}),
}
TRACED = ("shared-parameter", "shared-parameter-packed", "shared-module", "nested-units")  # with example inputs


def _wrap(name, plan):
    make, layout_kw = MODELS[name]
    model = make()
    example = _inputs(name) if name in TRACED else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = pt.ProTrainConfig(planning=pt.PlanningConfig(**layout_kw), runtime=pt.RuntimeConfig(check_invariants=True))
    return model, pt.wrap(model, opt, plan, device="cpu", example_inputs=example, config=config)


def _limits(name):
    make, layout_kw = MODELS[name]
    model = make()
    path, blocks = pt.find_blocks(model)
    layout = pt.build_layout(model, path, len(blocks), example_inputs=_inputs(name) if name in TRACED else None,
                             **layout_kw)
    return layout.limits()


def test_the_models_need_more_than_one_buffer():
    """The cases are what they claim: some unit stack needs two streamed chunks at once."""
    for name in (*TRACED, "nested-units-untraced", "hf-wrapper"):
        assert _limits(name).buffers_needed(0) == 2, name
    assert _limits("t5").buffers_needed(0) >= 1
    gpt2 = tiny_gpt2()
    path, blocks = pt.find_blocks(gpt2)
    assert pt.build_layout(gpt2, path, len(blocks)).limits().buffers_needed(0) == 1  # the tied head: one chunk


@pytest.mark.parametrize("name", list(MODELS))
def test_every_accepted_plan_trains_like_plain_pytorch(name):
    limits = _limits(name)
    for n_persist in range(limits.n_chunks):
        need = limits.buffers_needed(n_persist)
        for plan in (pt.Plan(n_persist=n_persist, n_buffer=need),
                     pt.Plan(n_persist=n_persist, n_buffer=need, n_checkpoint=1, n_swap=limits.n_blocks - 1)):
            model, engine = _wrap(name, plan)
            ref = copy.deepcopy(MODELS[name][0]())
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
            for _ in range(3):
                loss = _loss(engine.module, _inputs(name))
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                ref_loss = _loss(ref, _inputs(name))
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                if rounding(name, plan):
                    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5), (name, plan)
                else:
                    assert loss.item() == ref_loss.item(), (name, plan)
            assert_same_weights(engine.state_dict(), ref, atol=1e-5 if rounding(name, plan) else 0.0)
            engine.close()


def rounding(name, plan) -> bool:
    """T5 with recomputed or swapped blocks: its decoder blocks are blocks too (both stacks), and
    the gradients of what they all use (the position bias, the encoder's output) are summed in
    another order when blocks recompute, so the last bit may differ; torch's own gradient
    checkpointing of T5 moves the loss likewise (tests/test_layout.py)."""
    return name == "t5" and bool(plan.n_swap or plan.n_checkpoint)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_buffer_fewer_is_refused_at_wrap(name):
    limits = _limits(name)
    for n_persist in range(limits.n_chunks):
        need = limits.buffers_needed(n_persist)
        with pytest.raises(ValueError, match=f"Use n_buffer >= {need}"):
            _wrap(name, pt.Plan(n_persist=n_persist, n_buffer=need - 1))


def test_plan_limits():
    limits = pt.PlanLimits(n_chunks=4, n_blocks=2, resident_sets=((0,), (1, 3), (2,), (0, 2, 3)))
    assert [limits.buffers_needed(p) for p in range(5)] == [3, 2, 2, 1, 0]
    check_plan(pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=1), limits)
    check_plan(pt.Plan(n_persist=4, n_buffer=0), limits)
    for plan, match in [(pt.Plan(n_persist=1, n_buffer=1), "Use n_buffer >= 2"),
                        (pt.Plan(n_persist=5, n_buffer=0), "only 4 chunks"),
                        (pt.Plan(n_persist=4, n_buffer=0, n_swap=2, n_checkpoint=1), "n_swap \\+ n_checkpoint <= 2")]:
        with pytest.raises(ValueError, match=match):
            check_plan(plan, limits)


def test_a_plan_may_name_its_persistent_chunks():
    """``persistent_chunks``: which chunks persist; the buffers a plan needs follow the set (here
    chunk 3 persisting frees a buffer that chunk 0 persisting does not)."""
    limits = pt.PlanLimits(n_chunks=4, n_blocks=2, resident_sets=((0,), (1, 3), (2,), (0, 2, 3)))
    assert limits.buffers_needed(frozenset({3})) == 2 and limits.buffers_needed(frozenset({0})) == 2
    assert limits.buffers_needed(frozenset({2, 3})) == 1 and limits.buffers_needed(frozenset({0, 1})) == 2
    plan = pt.Plan(n_persist=2, n_buffer=1, persistent_chunks=[3, 2])  # a list, as from a YAML config
    assert plan.persistent_chunks == (2, 3) and plan.persistent() == {2, 3}
    check_plan(plan, limits)
    # Naming the first n is the default plan itself.
    assert pt.Plan(n_persist=2, n_buffer=2, persistent_chunks=(1, 0)) == pt.Plan(n_persist=2, n_buffer=2)
    assert pt.Plan.from_dict({"n_persist": 1, "n_buffer": 2, "persistent_chunks": [3]}).persistent() == {3}
    with pytest.raises(ValueError, match="Use n_buffer >= 2"):
        check_plan(pt.Plan(n_persist=2, n_buffer=1, persistent_chunks=(0, 1)), limits)
    with pytest.raises(ValueError, match="only 4 chunks \\(0 to 3\\)"):
        check_plan(pt.Plan(n_persist=1, n_buffer=2, persistent_chunks=(4,)), limits)
    with pytest.raises(ValueError, match="give n_persist=1"):
        pt.Plan(n_persist=2, n_buffer=2, persistent_chunks=(3, 3))
    with pytest.raises(ValueError, match="chunk indices"):
        pt.Plan(n_persist=1, n_buffer=2, persistent_chunks=(-1,))


class _Resident(torch.autograd.Function):
    """Identity on a parameter; its backward records whether the parameter then reads its
    chunk's device copy (what a backward on a GPU needs)."""

    @staticmethod
    def forward(ctx, p, probe):
        ctx.probe = probe
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe()
        return grad, None


class LayerScale(nn.Module):
    """Changes its input in place and returns it (timm's LayerScale(inplace=True))."""

    def __init__(self, d=64):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 0.5))
        self.probe = lambda: None

    def forward(self, x):
        return x.mul_(_Resident.apply(self.gamma, self.probe))


class ScaledStack(nn.Module):
    def __init__(self, n=4, d=64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.scale = LayerScale(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.scale(x)).square().mean()


def test_an_input_changed_in_place_and_returned_is_an_output():
    """The unit's backward begins (its chunk is on the device) although its output is its
    input object: the gradient flows through the in-place change."""
    torch.manual_seed(0)
    model = ScaledStack()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 64)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu", example_inputs=(x,),
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(chunk_size=64 * 64 + 64), runtime=pt.RuntimeConfig(check_invariants=True)))
    chunk = next(c for c in engine.chunks if any(m.name == "scale.gamma" for m in c.spec.members))
    seen = []
    model.scale.probe = lambda: seen.append(
        model.scale.gamma.untyped_storage().data_ptr() == chunk.storage.device_copy.untyped_storage().data_ptr())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        loss = engine.module(x.clone())
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        ref_loss = ref(x.clone())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == ref_loss.item()
    assert seen == [True, True]
    assert_same_weights(engine.state_dict(), ref)
