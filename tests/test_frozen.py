"""Frozen parameters (requires_grad=False) on every plan and in every precision: a chunk's
device copy stays until every module reading it has finished its backward, and a frozen
parameter holds only its compute-dtype copy ([Note: chunk storage] in chunk_format.py).

References: fp32 -- plain ``AdamW(fused=True)`` over the trainable parameters (bitwise);
bf16-true -- the model in bf16, the same (bitwise); mixed -- the recipe the engine implements:
every parameter cast once to the compute dtype (frozen ones stay so), fp32 masters for the
trainable ones, autocast, and ``GradScaler`` in 16-mixed (losses bitwise, masters within 1 ulp).
"""

import copy

import pytest
import torch

import protrain_core as pt
from conftest import MODELS, batches, n_chunks, train_engine, train_reference

FREEZE = {
    # frozen before the trainable ones in a block: the norm and the attention, the MLP trains
    "before": {"gpt2": (".ln_1.", ".attn."), "llama": (".input_layernorm.", ".self_attn.")},
    # frozen between trainable ones: the attention; the norms and the MLP train
    "between": {"gpt2": (".attn.",), "llama": (".self_attn.",)},
    # frozen after the trainable ones: the MLP
    "after": {"gpt2": (".mlp.",), "llama": (".mlp.",)},
    # whole blocks frozen
    "blocks": {"gpt2": (".h.0.", ".h.2."), "llama": (".layers.0.", ".layers.2.")},
    # the embedding (GPT-2: tied with the head) or the embedding and the untied head (LLaMA)
    "embedding": {"gpt2": ("wte",), "llama": ("embed_tokens", "lm_head")},
}
PRECISIONS = {"32-true": None, "bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
LR = 3e-3


def frozen_model(arch, pattern, seed=0):
    model = MODELS[arch](seed=seed)
    for name, p in model.named_parameters():
        if any(part in name for part in FREEZE[pattern][arch]):
            p.requires_grad_(False)
    assert any(not p.requires_grad for p in model.parameters()) and any(p.requires_grad for p in model.parameters())
    return model


def plans(model):
    path, blocks = pt.find_blocks(model)
    limits = pt.build_layout(model, path, len(blocks)).limits()
    return {
        "all-persistent": pt.Plan(n_persist=limits.n_chunks, n_buffer=0),
        "all-streamed": pt.Plan(n_persist=0, n_buffer=limits.buffers_needed(0)),
        "mixed-swap-checkpoint": pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2),
    }


def reference(model, data, precision):
    """(losses, {name: value}) of the plain recipe for ``precision``."""
    dtype = PRECISIONS[precision]
    ref = copy.deepcopy(model)
    if precision in ("32-true", "bf16-true"):
        if dtype is not None:
            ref = ref.to(dtype)
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, fused=True)
        losses = train_reference(ref, opt, data)
        return losses, {k: v.float() if dtype is None else v for k, v in ref.state_dict().items()}
    trained = [(p_lp, p) for p_lp, p in zip(ref.parameters(), model.parameters()) if p.requires_grad]
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    masters = [p.detach().clone().requires_grad_(True) for _, p in trained]  # from the fp32 weights
    opt = torch.optim.AdamW(masters, lr=LR, fused=True)
    device_type = data[0].device.type
    scaler = torch.amp.GradScaler(device_type) if precision == "16-mixed" else None
    losses = []
    for x in data:
        with torch.autocast(device_type, dtype=dtype):
            loss = ref(input_ids=x, labels=x).loss
        (scaler.scale(loss) if scaler else loss).backward()
        for m, (p_lp, _) in zip(masters, trained):
            m.grad, p_lp.grad = p_lp.grad.float(), None
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            for m, (p_lp, _) in zip(masters, trained):
                p_lp.copy_(m)
        losses.append(loss.item())
    master_of = {id(p_lp): m.detach() for m, (p_lp, _) in zip(masters, trained)}
    return losses, {k: master_of.get(id(v), v.detach().float()) for k, v in ref.state_dict(keep_vars=True).items()}


def _ci(arch, pattern, plan_name, precision):
    """The CI subset: every pattern and every plan in fp32 on LLaMA, every precision streamed."""
    return (arch == "llama" and precision == "32-true") or (plan_name == "all-streamed" and arch == "gpt2") \
        or (pattern == "before" and plan_name == "mixed-swap-checkpoint")


@pytest.mark.filterwarnings("ignore:ProTrain. a key/value cache")
@pytest.mark.grid(ci=_ci)
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("plan_name", ["all-persistent", "all-streamed", "mixed-swap-checkpoint"])
@pytest.mark.parametrize("pattern", list(FREEZE))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_frozen_parameters_train_like_the_recipe(arch, pattern, plan_name, precision):
    model = frozen_model(arch, pattern)
    data = batches(4)
    ref_losses, ref_values = reference(model, data, precision)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine = pt.wrap(model, opt, plans(model)[plan_name], precision=precision, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    assert train_engine(engine, data) == ref_losses
    sd = engine.state_dict()
    assert set(sd) == set(ref_values)
    ulp = 1.2e-7 if precision.endswith("mixed") else 0.0  # the masters of the mixed recipe: 1 ulp of fp32
    for k, v in ref_values.items():
        torch.testing.assert_close(sd[k], v, rtol=ulp, atol=0, msg=k)
    if plan_name != "all-persistent":
        assert engine.scheduler.stats["offloads"] > 0 and engine.scheduler.stats["cpu_updates"] > 0


def test_a_frozen_chunk_is_uploaded_and_never_offloaded():
    model = frozen_model("llama", "blocks")
    engine = pt.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
                     pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    frozen = {c.index for c in engine.chunks if not c.storage.fmt.trains}
    assert frozen
    engine.scheduler.record_events = True
    train_engine(engine, batches(2))
    events = engine.scheduler.events
    assert {i for what, i, _ in events if what == "fetch"} >= frozen
    assert not {i for what, i, _ in events if what == "offload"} & frozen


def test_an_optimizer_over_every_parameter_keeps_no_state_for_frozen_ones():
    """torch skips parameters without gradients: no state, no update; so does the engine."""
    model = frozen_model("gpt2", "between")
    ref = copy.deepcopy(model)
    data = batches(3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    ref_losses = train_reference(ref, ref_opt, data)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    assert train_engine(engine, data) == ref_losses
    osd, ref_osd = engine.states.optimizer(), ref_opt.state_dict()
    assert osd["state"].keys() == ref_osd["state"].keys()
    for i, entry in ref_osd["state"].items():
        assert all(torch.equal(osd["state"][i][k], v) for k, v in entry.items())


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_model_states_are_proportional_to_what_trains(precision):
    """Bytes of model states (host pool + persistent chunks) with most of the model frozen:
    the frozen parameters' compute copies, the trainable ones' full states, and the chunks'
    padding -- within 1.1x of compute-dtype bytes x frozen + state bytes x trainable."""
    model = frozen_model("llama", "before")
    n = n_chunks(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cb = 2 if precision == "bf16-mixed" else 4
    per_trainable = 18 if precision == "bf16-mixed" else 16  # compute copy (2) + master, gradient, 2 moments (4 each)
    ideal = cb * frozen + per_trainable * trainable
    for plan in (pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=n, n_buffer=0)):
        m = frozen_model("llama", "before")
        engine = pt.wrap(m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]), plan,
                         precision=precision, device="cpu")
        held = engine.memory.host_bytes() + sum(c.storage.device_bytes() for c in engine.chunks if c.persistent)
        padding = engine.layout.waste * cb  # chunk rounding: capacity no parameter uses
        assert held <= 1.1 * ideal + padding, (held, ideal, padding)
        engine.close()
