"""engine.replan(plan) between steps: every knob changes, every state stays. A run that changes
plan at every step -- and between the micro-batches of one step -- equals plain PyTorch bit for
bit in fp32; the device never holds more model states than the larger of the two plans."""

import copy
import itertools

import pytest
import torch

import protrain_core as pt
from conftest import MODELS, assert_same_runs, assert_same_weights, batches, n_chunks, train_engine, train_reference

CACHE_WARNING = "ignore:ProTrain. a key/value cache"


def plan_cycle(model):
    n = n_chunks(model)
    return [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=n, n_buffer=0, n_checkpoint=2),
            pt.Plan(n_persist=2, n_buffer=2, n_swap=2, n_checkpoint=1), pt.Plan(n_persist=n - 1, n_buffer=1, n_swap=4),
            pt.Plan(n_persist=1, n_buffer=3, n_checkpoint=4),
            # Named persistent chunks: the last one alone, then a middle and the first one.
            pt.Plan(n_persist=1, n_buffer=1, persistent_chunks=(n - 1,)),
            pt.Plan(n_persist=2, n_buffer=2, n_checkpoint=1, persistent_chunks=(n // 2, 0))]


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_new_plan_at_every_step_equals_plain_pytorch(arch):
    model = MODELS[arch]()
    ref = copy.deepcopy(model)
    data = batches(14)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True), data)
    cycle = plan_cycle(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), cycle[-1], device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = []
    for step, x in enumerate(data):
        engine.replan(cycle[step % len(cycle)])
        assert engine.plan == cycle[step % len(cycle)]
        assert {c.index for c in engine.chunks if c.persistent} == engine.plan.persistent()
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    assert engine.states.optimizer()["state"].keys() == ref_optimizer_keys(ref)


def ref_optimizer_keys(model):
    return set(range(len(list(model.parameters()))))


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_replanning_does_not_change_a_bit_in_mixed_precision(precision):
    """Against the same engine on one plan: the masters, the moments and the loss scaler move
    with the chunks unchanged."""
    data = batches(7)
    runs = []
    for replan in (False, True):
        model = MODELS["llama"]()
        cycle = plan_cycle(model)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cycle[0], precision=precision,
                         device="cpu")
        losses = []
        for step, x in enumerate(data):
            if replan:
                engine.replan(cycle[step % len(cycle)])
            loss = engine.module(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        runs.append((losses, engine.state_dict(), engine.states.optimizer(), engine.states.scaler()))
    assert_same_runs(*runs)


def test_a_replan_between_micro_batches_keeps_the_accumulated_gradients():
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    data = batches(8)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data, accumulate=2)
    cycle = plan_cycle(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cycle[0], device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    plans = itertools.cycle(cycle)
    losses = train_engine(engine, data, accumulate=2, before_micro_batch=lambda e: e.replan(next(plans)))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)  # the printed sum's order only
    assert_same_weights(engine.state_dict(), ref)


def test_device_memory_during_a_switch_stays_within_the_larger_plan(monkeypatch):
    """Chunks leave the device before others join it: after every single move the device holds
    at most the model states of the larger of the two plans (buffers are empty between steps)."""
    from protrain_core.runtime.chunk import Chunk

    model = MODELS["llama"]()
    n = n_chunks(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=3, n_buffer=1), device="cpu")
    x = batches(1)[0]
    seen = []
    for verb in ("persist", "unpersist"):
        original = getattr(Chunk, verb)

        def moved(self, original=original):
            original(self)
            seen.append(engine.memory.device_bytes())

        monkeypatch.setattr(Chunk, verb, moved)

    def states(plan):
        return sum(c.storage.fmt.persistent_device_bytes for c in engine.chunks[:plan.n_persist])

    previous = engine.plan
    for plan in (pt.Plan(n_persist=1, n_buffer=2), pt.Plan(n_persist=n, n_buffer=0), pt.Plan(n_persist=2, n_buffer=2)):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        seen.clear()
        engine.replan(plan)
        assert seen and max(seen) <= max(states(previous), states(plan))
        previous = plan


def test_replan_refuses_what_it_cannot_do():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    with pytest.raises(ValueError, match="Use n_buffer >= 1"):
        engine.replan(pt.Plan(n_persist=0, n_buffer=0))
    with pytest.raises(ValueError, match="only 4 transformer blocks"):
        engine.replan({"n_persist": 0, "n_buffer": 1, "n_checkpoint": 5})
    train_engine(engine, [x])  # the first step holds its updates for a late clipping request
    engine.backward(engine.module(input_ids=x, labels=x).loss)  # the streamed chunks are updated already
    with pytest.raises(RuntimeError, match="after engine.step"):
        engine.replan(pt.Plan(n_persist=2, n_buffer=1))
    engine.step()
    engine.replan(pt.Plan(n_persist=2, n_buffer=1))
    assert engine.plan == pt.Plan(n_persist=2, n_buffer=1)
