"""The engine's parts and their faces: ``engine.clipping``, ``engine.states``, ``engine.memory``,
``engine.activations``, ``engine.step_state`` and the typed step observers (issue 29 items 3
and 5).
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


def test_the_names_the_parts_replaced_are_gone():
    """Issue 56, item 3: no compatibility layer for a project that has not released -- the
    engine's old names (``engine.clip_grad_norm_``, ``engine.optimizer_state_dict``, ...) are
    plain AttributeErrors; the parts hold them."""
    engine = _engine()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for old in ("clip_grad_norm_", "optimizer_state_dict", "steady_overlap", "host_bytes", "activation_report"):
                with pytest.raises(AttributeError, match=f"has no attribute '{old}'"):
                    getattr(engine, old)
        _backward(engine, batches(1)[0])
        assert engine.clipping.clip_grad_norm_(0.5) > 0 and engine.memory.host_bytes() > 0
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


def test_an_engine_dropped_unclosed_with_its_model_is_collected():
    """An engine and its model dropped without ``close`` (a notebook cell run again) are freed by
    the garbage collector, on every plan. Before, each parameter's gradient hook, which autograd
    holds where the collector cannot see it, held the engine: every such engine stayed for the
    life of the process (57 of them after tests/test_activations.py)."""
    import gc
    import weakref

    from conftest import standard_plans, tiny_llama, train_engine

    refs = {}
    for name, plan in standard_plans(tiny_llama(n_layer=3)).items():
        model = tiny_llama(n_layer=3)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu")
        train_engine(engine, batches(2))
        refs[name] = [weakref.ref(engine), *(weakref.ref(c.storage) for c in engine.chunks)]
        del engine, model
    gc.collect()
    assert {name: [r() is None for r in rs] for name, rs in refs.items()} == {
        name: [True] * len(rs) for name, rs in refs.items()}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_closed_engine_is_freed_with_its_last_reference_without_the_garbage_collector(precision):
    """No reference cycle keeps a closed engine (its chunks' device and host memory) alive until
    the garbage collector runs: on every plan, with a recorded timeline, and the profiler's own
    engine when ``wrap`` profiles ahead. Before, the runtime hooks' callback to the engine and the
    CPU worker's to the scheduler held every closed engine, which the profiler freed by
    ``gc.collect()`` after each profile."""
    import gc
    import weakref

    from conftest import standard_plans, tiny_llama, train_engine
    from protrain_core.runtime.engine import RuntimeEngine

    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, RuntimeEngine)}  # (earlier tests' engines still referenced)
    gc.disable()
    try:
        for name, plan in standard_plans(tiny_llama(n_layer=4)).items():
            model = tiny_llama(n_layer=4)
            engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu",
                             precision=precision)
            with engine.record_timeline():
                train_engine(engine, batches(2))
            refs = [weakref.ref(engine), *(weakref.ref(c.storage) for c in engine.chunks)]
            engine.close()
            del engine
            assert all(r() is None for r in refs), name
        model = tiny_llama(n_layer=4)
        x = batches(1)[0]
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", precision=precision,
                         example_inputs={"input_ids": x, "labels": x}, report=lambda *a, **k: None)
        assert [o for o in gc.get_objects() if isinstance(o, RuntimeEngine) and id(o) not in before] == [engine]
        engine.close()
    finally:
        gc.enable()


def test_a_wrapped_model_pickled_whole_is_refused_with_the_fix_and_pickles_after_close(tmp_path):
    """``torch.save(model)`` while the engine is open met one of the engine's locks ("cannot
    pickle '_thread.lock' object"); now the engine and its parameters refuse with the fix. The
    weights save as they are, and after ``close`` the model pickles as a plain one."""
    engine = _engine()
    model = engine.module
    _backward(engine, batches(1)[0])
    engine.step()
    for obj in (model, list(model.parameters()), engine.optimizers[0]):
        with pytest.raises(TypeError, match=r"cannot be pickled whole.*torch.save\(model.state_dict\(\), path\).*"
                                            r"engine.close\(\) first"):
            torch.save(obj, tmp_path / "model.pt")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    weights = torch.load(tmp_path / "weights.pt")
    engine.close()
    torch.save(model, tmp_path / "model.pt")
    plain = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(torch.equal(weights[k], v) for k, v in plain.state_dict().items())
