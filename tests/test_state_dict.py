"""Round trips: weights and optimizer state in plain-PyTorch format, across plans."""

import copy

import pytest
import torch

import protrain_core as pt
from conftest import MODELS, assert_same_weights, batches, n_chunks, train_engine, train_reference


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_state_dict_matches_model_state_dict(arch):
    model = MODELS[arch]()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), precision="bf16-mixed", device="cpu")
    sd = engine.state_dict()
    assert list(sd) == list(expected)  # same keys, same order, tied names included
    for k, v in expected.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_load_state_dict_exact(precision):
    a, b = MODELS["llama"](seed=0), MODELS["llama"](seed=1)
    target = {k: v.clone() for k, v in b.state_dict().items()}
    engine = pt.wrap(a, torch.optim.AdamW(a.parameters()), pt.Plan(n_persist=2, n_buffer=1), precision=precision, device="cpu")
    x = batches(1)[0]
    with torch.no_grad():
        engine.module(input_ids=x)  # some chunks are resident now
    engine.load_state_dict(target)
    sd = engine.state_dict()
    for k, v in target.items():
        assert torch.equal(sd[k], v), k
    if precision == "32-true":
        with torch.no_grad():
            torch.testing.assert_close(engine.module(input_ids=x).logits, b(input_ids=x).logits, rtol=0, atol=0)


def test_load_state_dict_rejects_bad_input_before_changing_anything():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    before = engine.state_dict()
    bad = dict(before)
    bad.pop("transformer.wpe.weight")
    plain = MODELS["gpt2"]()
    for mistakes in ({"missing"}, {"unexpected"}, {"shape"}, {"missing", "unexpected", "shape"}):
        bad = dict(before)
        if "missing" in mistakes:
            bad.pop("transformer.wpe.weight")
        if "unexpected" in mistakes:
            bad["head.extra"] = torch.zeros(2)
        if "shape" in mistakes:
            bad["transformer.h.0.ln_1.weight"] = torch.zeros(3, 3)
        with pytest.raises(RuntimeError) as theirs:  # nn.Module's error, in the same words
            plain.load_state_dict(bad)
        with pytest.raises(RuntimeError) as ours:
            engine.load_state_dict(bad)
        assert str(ours.value) == str(theirs.value)
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # strict=False: what nn.Module's returns, the other entries loaded
    bad = {k: v for k, v in before.items() if k != "lm_head.weight"} | {"head.extra": torch.zeros(2)}
    assert tuple(engine.load_state_dict(bad, strict=False)) == tuple(plain.load_state_dict(bad, strict=False))


@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=2), pt.Plan(n_persist=2, n_buffer=1)], ids=str)
def test_engine_state_continues_in_plain_adamw(plan):
    """Engine trains 5 steps; plain model + AdamW load its state dicts and both continue identically."""
    model = MODELS["gpt2"]()
    data = batches(10)
    # fused=True: the saved param_groups carry the flag into plain_opt, which then runs the same
    # fused kernel (with fused=None it would run torch's for-each kernel and differ by ulps).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    engine = pt.wrap(model, opt, plan, device="cpu")
    train_engine(engine, data[:5])
    plain = MODELS["gpt2"](seed=123)
    plain.load_state_dict(engine.state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1.0, fused=True)  # lr comes from the state dict
    plain_opt.load_state_dict(engine.states.optimizer())
    assert plain_opt.param_groups[0]["lr"] == 3e-3
    assert train_engine(engine, data[5:]) == train_reference(plain, plain_opt, data[5:])
    assert_same_weights(engine.state_dict(), plain)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_plain_adamw_state_continues_in_engine_with_any_plan(arch):
    model = MODELS[arch]()
    data = batches(10)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    train_reference(model, opt, data[:5])
    # Deep copies: torch's load_state_dict keeps the very tensors it is given.
    saved_osd, saved_sd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    ref_opt.load_state_dict(copy.deepcopy(saved_osd))
    ref_losses = train_reference(ref, ref_opt, data[5:])
    for plan in (pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=n_chunks(model), n_buffer=0)):
        m2 = MODELS[arch](seed=7)
        engine = pt.wrap(m2, torch.optim.AdamW(m2.parameters(), lr=0.5), plan, device="cpu")
        engine.load_state_dict(saved_sd)
        engine.states.load_optimizer(saved_osd)
        assert train_engine(engine, data[5:]) == ref_losses
        assert_same_weights(engine.state_dict(), ref)


def test_optimizer_state_dict_is_independent_of_the_plan():
    data = batches(4)
    dicts = []
    for plan in (pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=2, n_buffer=2)):
        model = MODELS["llama"]()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, device="cpu")
        train_engine(engine, data)
        dicts.append(engine.states.optimizer())
    a, b = dicts
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key in a["state"][k]:
            assert torch.equal(a["state"][k][key], b["state"][k][key])


def test_wrap_takes_over_existing_optimizer_state():
    model = MODELS["gpt2"]()
    data = batches(8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    train_reference(model, opt, data[:3])
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    engine = pt.wrap(model, opt, pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    assert not opt.state  # moved into the chunks
    assert train_engine(engine, data[3:]) == train_reference(ref, ref_opt, data[3:])


@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1"])
def test_the_optimizers_own_state_dict_and_load_state_dict_are_the_engines(plan_name):
    """While an engine is open its optimizer's own ``state`` is empty (Adam's states live in the
    chunks); ``optimizer.state_dict()`` and ``optimizer.load_state_dict()`` -- a user's own save
    and resume -- read and write the chunks' states: plain PyTorch's state bit for bit, and a
    resume from it trains on as plain PyTorch does. Before, the state dict held no state and a
    load was ignored (training went on from fresh moments)."""
    from conftest import standard_plans

    data = batches(4)
    ref = MODELS["gpt2"]()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    ref_losses = train_reference(ref, ref_opt, data[:2])
    ref_state, ref_osd = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    ref_losses += train_reference(ref, ref_opt, data[2:])

    def engine_of():
        model = MODELS["gpt2"]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return pt.wrap(model, optimizer, standard_plans(model)[plan_name], device="cpu"), optimizer

    engine, optimizer = engine_of()
    assert train_engine(engine, data[:2]) == ref_losses[:2]
    saved = optimizer.state_dict()
    assert not optimizer.state and saved["state"].keys() == ref_osd["state"].keys()
    for k, entry in ref_osd["state"].items():
        assert saved["state"][k].keys() == entry.keys()
        assert all(torch.equal(saved["state"][k][name], v) for name, v in entry.items()), k
    engine.close()

    engine, optimizer = engine_of()
    engine.load_state_dict(ref_state)
    optimizer.load_state_dict(saved)
    assert not optimizer.state
    assert train_engine(engine, data[2:]) == ref_losses[2:]
    assert_same_weights(engine.state_dict(), ref)
    engine.close()


@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2"])
def test_a_state_read_between_a_backward_that_updated_chunks_and_its_step_is_refused(plan_name, tmp_path):
    """Offloaded chunks are updated during backward: between such a backward and its step (or
    after a backward that raised, until step() or zero_grad()) the weights and moments mix two
    steps, where plain PyTorch's are the last step's. A checkpoint of them (Lightning's
    OnExceptionCheckpoint after a Ctrl-C in backward) would be resumed from silently: refused, with
    the fix; the same reads after the step, before the next backward, or under expect_late()
    (updates held for step()) give plain PyTorch's state. A load there is refused alike (it would
    land in the updated chunks without this step's update, and the step would update the rest)."""
    from conftest import standard_plans

    x = batches(1)[0]
    for late in (False, True):
        model = MODELS["gpt2"]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = pt.wrap(model, optimizer, standard_plans(model)[plan_name], device="cpu")
        if late:
            engine.clipping.expect_late()
        reads = {"engine.state_dict": engine.state_dict, "model.state_dict": model.state_dict,
                 "engine.states.optimizer": engine.states.optimizer, "optimizer.state_dict": optimizer.state_dict,
                 "save_sharded": lambda: engine.save_sharded(tmp_path / "ckpt")}
        for step in range(2):  # (the first step's updates are held until step(): the first is exact)
            saved, saved_optimizer = engine.state_dict(), engine.states.optimizer()
            reads.update({"engine.load_state_dict": lambda: engine.load_state_dict(saved),
                          "model.load_state_dict": lambda: model.load_state_dict(saved),
                          "optimizer.load_state_dict": lambda: optimizer.load_state_dict(saved_optimizer),
                          "engine.states.load_optimizer": lambda: engine.states.load_optimizer(saved_optimizer)})
            engine.backward(model(input_ids=x, labels=x).loss)
            for name, read in reads.items():
                if plan_name == "all-persistent" or late or step == 0:
                    read()
                else:
                    with pytest.raises(RuntimeError, match=r"between backward and step|whose step has not run.*"
                                                           r"engine\.step\(\).*expect_late"):
                        read()
            engine.step()
            saved, saved_optimizer = engine.state_dict(), engine.states.optimizer()  # (the loads: no change)
            for read in reads.values():
                read()
            engine.zero_grad()
        engine.close()
