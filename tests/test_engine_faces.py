"""The engine's parts and their faces: ``engine.clipping``, ``engine.states``, ``engine.memory``,
``engine.activations``, ``engine.step_state`` and the typed step observers (issue 29 items 3
and 5). The names they replace keep working for one release, with a FutureWarning.
"""

import warnings

import pytest
import torch

import protrain_core as pt
from conftest import batches, tiny_gpt2

PLAN = pt.Plan(n_persist=1, n_buffer=2, n_swap=0, n_checkpoint=1)


def _engine(**kw):
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return pt.wrap(model, opt, PLAN, precision="32-true", device="cpu", **kw)


def _backward(engine, x):
    engine.backward(engine.module(input_ids=x, labels=x).loss)


def _resolve(engine, path: str):
    value = engine
    for part in path.split("."):
        value = getattr(value, part)
    return value


# old name -> the new path, for the names that are the same attribute there
MOVED = {
    "set_gradient_clipping": "clipping.configure",
    "clip_grad_norm_": "clipping.clip_grad_norm_",
    "clip_grad_value_": "clipping.clip_grad_value_",
    "grad_norm": "clipping.grad_norm",
    "expect_late_clipping": "clipping.expect_late",
    "gradient_clipping": "clipping.configured",
    "last_grad_norm": "clipping.last_norm",
    "step_gradients_ready": "clipping.gradients_ready",
    "optimizer_state_dict": "states.optimizer",
    "load_optimizer_state_dict": "states.load_optimizer",
    "scaler_state_dict": "states.scaler",
    "load_scaler_state_dict": "states.load_scaler",
    "chunk_optimizer": "states.chunk_optimizer",
    "slot_of": "states.slot_of",
    "activation_report": "activations.report",
    "measure_activations": "activations.measure_next_forward",
    "device_bytes": "memory.device_bytes",
    "host_bytes": "memory.host_bytes",
    "set_manual_optimization": "step_state.set_manual",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_warns_and_gives_its_new_place(old):
    engine = _engine()
    try:
        _backward(engine, batches(1)[0])  # the gradients are ready: the clipping reads work
        with pytest.warns(FutureWarning, match=rf"engine\.{old} is deprecated .* use engine\.{MOVED[old]}"):
            got = getattr(engine, old)
        assert got == _resolve(engine, MOVED[old])
    finally:
        engine.close()


def test_the_moved_names_still_work_as_before():
    """A loop written against the old names trains exactly as one on the new names."""
    data = batches(3)
    runs = []
    for old in (True, False):
        engine = _engine()
        norms = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if old else "error", FutureWarning)
            for x in data:
                _backward(engine, x)
                norms.append(engine.clip_grad_norm_(0.5) if old else engine.clipping.clip_grad_norm_(0.5))
                engine.step()
                engine.zero_grad()
            osd = engine.optimizer_state_dict() if old else engine.states.optimizer()
            overlap = engine.steady_overlap() if old else engine.clipping.overlap(steady=True)
        runs.append((torch.stack(norms), engine.state_dict(), osd["state"][0]["exp_avg"], overlap))
        engine.close()
    (n0, w0, m0, o0), (n1, w1, m1, o1) = runs
    assert torch.equal(n0, n1) and torch.equal(m0, m1) and o0 == o1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_an_unknown_attribute_is_an_attribute_error_without_a_warning():
    engine = _engine()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not hasattr(engine, "clip_grad")
            with pytest.raises(AttributeError, match="has no attribute 'clip_grad'"):
                engine.clip_grad  # noqa: B018
    finally:
        engine.close()


def test_the_step_state_follows_the_steps():
    engine = _engine()
    state = engine.step_state
    seen = []

    class Watch(pt.StepObserver):  # only some events: the others are the Protocol's no-ops
        def backward_begins(self):
            seen.append(("backward", state.phase, state.final_micro_batch, state.batch_begun))

        def step_ends(self):
            seen.append(("step", state.phase, state.final_micro_batch, state.batch_begun))

    handle = engine.observe(Watch())
    x, y = batches(2)
    try:
        assert state.idle and state.awaiting_batch
        with engine.no_sync():
            assert not state.final_micro_batch
            _backward(engine, x)
        assert state.final_micro_batch and not state.batch_begun
        engine.module(input_ids=y, labels=y)  # a forward with gradients begins a micro-batch
        assert state.batch_begun and not state.awaiting_batch
        _backward(engine, y)
        engine.step()
        handle.remove()
        _backward(engine, x)  # not heard any more
    finally:
        engine.close()
    assert state.closed and not state.awaiting_batch
    I = pt.TrainingPhase.IDLE
    assert seen == [("backward", I, False, True), ("backward", I, True, True), ("step", I, True, False)]
    with pytest.raises(RuntimeError, match="was closed"):
        engine.step()


def test_an_observer_without_the_protocols_methods_is_refused_with_the_fix():
    engine = _engine()
    try:
        class Partial:
            def step_ends(self):
                pass

        with pytest.raises(TypeError, match="not a StepObserver.*backward_begins.*subclass protrain_core.StepObserver"):
            engine.observe(Partial())
        with pytest.raises(TypeError, match="not a RecomputeObserver"):
            engine.on_recompute(object())
    finally:
        engine.close()


def test_memory_reports_the_plans_bound_and_the_host_copies():
    engine = _engine()
    try:
        x = batches(1)[0]
        _backward(engine, x)
        engine.step()
        streamed = engine.chunks[PLAN.n_persist:]
        assert engine.memory.host_bytes() == sum(c.storage.host_bytes for c in streamed) > 0
        assert 0 < engine.memory.device_bytes() <= engine.memory.device_bound()
        assert engine.memory.host_locked_bytes() == 0  # a CPU device: nothing is page-locked
        assert "device model-state bytes now" in engine.summary()
    finally:
        engine.close()
