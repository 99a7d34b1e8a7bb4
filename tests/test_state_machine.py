"""The chunk lifecycle ([Note: chunk lifecycle] in runtime/chunk.py): residency and gradient
state machines, verbs that do their own storage work and set the state last, and the
device-memory invariants of the runtime."""

import itertools
from concurrent.futures import Future

import pytest
import torch

import protrain_core as pt
from conftest import batches, tiny_gpt2, tiny_llama, train_engine
from protrain_core.runtime.chunk import (
    GRAD_TRANSITIONS, GRAD_VERBS, TRANSITIONS, VERBS, Chunk, ChunkState, GradState, IllegalTransition, _next,
)
from protrain_core.chunk_format import ChunkFormat
from protrain_core.chunk_format import align
from protrain_core.runtime.device import DeviceContext, as_context
from protrain_core.runtime.storage import ChunkStorage
from protrain_core.structure.layout import ChunkSpec, ParamSlot

H, F, R, O, U, P = (ChunkState.HOST, ChunkState.FETCHING, ChunkState.RESIDENT, ChunkState.OFFLOADING,
                    ChunkState.UPDATING, ChunkState.PERSISTENT)
EXPECTED = {
    ("persist", H): P,
    ("unpersist", P): H,
    ("begin_fetch", H): F,
    ("end_fetch", F): R,
    ("release", R): H,
    ("begin_offload", R): O,
    ("end_offload", O): U,
    ("begin_update", H): U,
    ("end_update", U): H,
}
G = GradState
EXPECTED_GRAD = {
    ("receive", G.EMPTY): G.FIRST, ("receive", G.READY): G.MORE, ("receive", G.FIRST): G.FIRST,
    ("receive", G.MORE): G.MORE,
    ("land", G.FIRST): G.READY, ("land", G.MORE): G.READY,
    ("land_applied", G.FIRST): G.APPLIED, ("land_applied", G.MORE): G.APPLIED,
    ("apply", G.READY): G.APPLIED,
    ("finish_step", G.APPLIED): G.READY, ("finish_step", G.READY): G.READY, ("finish_step", G.EMPTY): G.EMPTY,
    ("zero", G.EMPTY): G.EMPTY, ("zero", G.READY): G.EMPTY, ("zero", G.APPLIED): G.EMPTY,
}
CTX = DeviceContext(torch.device("cpu"))


def test_transition_tables_are_the_documented_ones():
    assert TRANSITIONS == EXPECTED
    assert GRAD_TRANSITIONS == EXPECTED_GRAD


def _chunk(persistent=False):
    spec = ChunkSpec(index=0, members=(ParamSlot("w", 0, 4, (4,)),), units=("u",), capacity=16)
    fmt = ChunkFormat(numel=16, compute_dtype=torch.float32, master_dtype=torch.float32, trainable_numel=4, adam_states=2)
    storage = ChunkStorage(fmt, persistent=persistent, ctx=as_context("cpu"), pin=False, n_members=1)
    chunk = Chunk(spec, params=[torch.nn.Parameter(torch.arange(4.0))], storage=storage, opt_members={0: [0]})
    chunk.adopt()
    return chunk


def _done(value=None):
    future = Future()
    future.set_result(value)
    return future


def _offload(c, applied=False):
    if c.state is ChunkState.RESIDENT and not c.receiving:
        c.receive(0, torch.ones(4))  # a chunk offloads the gradients it received
    c.begin_offload(CTX, applied=applied, landing_for=lambda replace: c.storage.grad_acc,
                    submit=lambda event, landing, replace: _done())


VERB_CALLS = {
    "persist": lambda c: c.persist(),
    "unpersist": lambda c: c.unpersist(),
    "begin_fetch": lambda c: c.begin_fetch(CTX),
    "end_fetch": lambda c: c.end_fetch(CTX),
    "release": lambda c: c.release(),
    "begin_offload": _offload,
    "end_offload": lambda c: c.end_offload(CTX),
    "begin_update": lambda c: c.begin_update(_done),
    "end_update": lambda c: c.end_update(),
}


def _in_state(state) -> Chunk:
    """A chunk brought to ``state`` by legal verbs only (nothing assigns its fields)."""
    c = _chunk(persistent=state is P)
    path = {H: [], F: ["begin_fetch"], R: ["begin_fetch", "end_fetch"], O: ["begin_fetch", "end_fetch", "recv", "begin_offload"],
            U: ["begin_update"], P: []}[state]
    for verb in path:
        if verb == "recv":
            c.receive(0, torch.ones(4))
        else:
            VERB_CALLS[verb](c)
    assert c.state is state
    return c


def _footprint(c: Chunk):
    st = c.storage
    return (c.state, c.grad_state, st.device_copy_allocated, st.grad_buffer is not None,
            c.params[0].untyped_storage().data_ptr())


@pytest.mark.parametrize("verb,state", list(itertools.product(VERBS, [H, F, R, O, U, P])), ids=lambda v: getattr(v, "name", v))
def test_every_verb_from_every_state(verb, state):
    c = _in_state(state)
    target = EXPECTED.get((verb, state))
    if target is None:
        before = _footprint(c)
        with pytest.raises(IllegalTransition, match=f"cannot {verb} in state {state.name}"):
            VERB_CALLS[verb](c)
        assert _footprint(c) == before  # an illegal verb changes nothing, storage included
        return
    VERB_CALLS[verb](c)
    assert c.state is target
    st, param = c.storage, c.params[0]
    if target in (F, R, O, P):  # the device copy exists exactly while the chunk is on the device
        assert st.device_copy_allocated
    else:
        assert not st.device_copy_allocated and st.grad_buffer is None
    if target in (R, P):
        assert param.untyped_storage().data_ptr() == st.device_copy.untyped_storage().data_ptr()
        assert torch.equal(param.detach(), torch.arange(4.0))  # the fetched values
    if target in (H, U):
        assert param.untyped_storage().data_ptr() == st.host_copy.untyped_storage().data_ptr()


class _FailingCopies(DeviceContext):
    def copy_async(self, dst, src, stream=None, after=None, **_):
        raise RuntimeError("copy failed")


def test_the_state_is_set_after_the_storage_work():
    """A verb whose storage work fails leaves the chunk in its state."""
    c = _in_state(H)
    with pytest.raises(RuntimeError, match="copy failed"):
        c.begin_fetch(_FailingCopies(torch.device("cpu")))
    assert c.state is H
    c = _in_state(R)
    c.receive(0, torch.ones(4))
    with pytest.raises(RuntimeError, match="copy failed"):
        c.begin_offload(_FailingCopies(torch.device("cpu")), applied=True, landing_for=lambda r: c.storage.grad_acc,
                        submit=lambda e, landing, r: _done())
    assert (c.state, c.grad_state) == (R, G.FIRST)
    failed = Future()
    failed.set_exception(ValueError("worker failed"))
    c = _in_state(H)
    c.begin_update(lambda: failed)
    with pytest.raises(ValueError, match="worker failed"):
        c.end_update()
    assert c.state is U


def test_gradient_lifecycle_of_a_persistent_chunk():
    c = _in_state(P)
    acc = c.storage.grad_acc
    assert c.grad_state is G.EMPTY and not c.has_gradients
    assert c.receive(0, torch.ones(4))  # its one member has its gradient: complete
    assert c.grad_state is G.FIRST and c.has_grad(0) and torch.equal(c.values.view(acc, 0), torch.ones(4))
    c.end_pass()
    c.land()
    assert c.grad_state is G.READY
    c.receive(0, torch.full((4,), 2.0))  # a second micro-batch adds
    assert c.grad_state is G.MORE and torch.equal(c.values.view(acc, 0), torch.full((4,), 3.0))
    c.end_pass()
    c.land()
    c.apply()
    assert c.applied
    with pytest.raises(IllegalTransition, match="cannot receive in state APPLIED"):
        c.receive(0, torch.ones(4))
    c.finish_step()
    assert c.grad_state is G.READY and c.has_grad(0)  # kept until zero_grad, as p.grad in torch
    with pytest.raises(IllegalTransition):
        c.land()  # nothing is being received
    c.zero()
    assert c.grad_state is G.EMPTY and not c.has_gradients
    c.receive(0, torch.full((4,), 5.0))  # after zero_grad the accumulator is overwritten, not added to
    assert torch.equal(c.values.view(acc, 0), torch.full((4,), 5.0))
    with pytest.raises(IllegalTransition, match="cannot zero in state FIRST"):
        c.zero()


@pytest.mark.parametrize("verb,state", list(itertools.product(GRAD_VERBS, list(GradState))), ids=lambda v: getattr(v, "name", v))
def test_every_gradient_verb_from_every_state(verb, state):
    target = EXPECTED_GRAD.get((verb, state))
    if target is None:
        with pytest.raises(IllegalTransition, match=f"cannot {verb} in state {state.name}"):
            _next(GRAD_TRANSITIONS, verb, state, 0)
    else:
        assert _next(GRAD_TRANSITIONS, verb, state, 0) is target


def test_offload_lands_replacing_after_zero_grad_and_adding_after_that():
    """The first pass since zero_grad lands over the accumulator's garbage, a further one adds."""
    c = _in_state(R)
    c.receive(0, torch.ones(4))
    seen = []
    c.begin_offload(CTX, applied=False, landing_for=lambda replace: seen.append(replace) or c.storage.grad_acc,
                    submit=lambda e, landing, replace: _done())
    assert c.grad_state is G.READY
    c.end_offload(CTX)
    c.end_update()
    VERB_CALLS["begin_fetch"](c)
    VERB_CALLS["end_fetch"](c)
    c.receive(0, torch.ones(4))
    assert c.grad_state is G.MORE
    c.begin_offload(CTX, applied=True, landing_for=lambda replace: seen.append(replace) or c.storage.grad_acc,
                    submit=lambda e, landing, replace: _done())
    assert seen == [True, False] and c.grad_state is G.APPLIED


def _resident(engine):
    return [c for c in engine.chunks if not c.persistent and c.device_resident]


@pytest.mark.grid(ci=lambda make, plan, precision: (make is tiny_llama and precision == "bf16-mixed")
                  or (make is tiny_gpt2 and precision == "32-true" and plan.n_buffer == 1))
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=0, n_buffer=2), pt.Plan(n_persist=1, n_buffer=2)], ids=str)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_device_bytes_invariant_at_every_hook(make, plan, precision, monkeypatch):
    """At every hook: at most n_buffer streamed chunks hold device memory, parameters point at
    the copy that is valid, and the device bytes (read from the storages) stay within
    persistent bytes + n_buffer x (chunk params + chunk grads)."""
    model = make()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan, precision=precision, device="cpu")
    rt = engine.scheduler
    calls = {"n": 0, "max_resident": 0, "max_bytes": 0}
    from protrain_core.runtime import scheduler as S
    original = S.assert_invariants

    def counting(scheduler):
        original(scheduler)
        calls["n"] += 1
        calls["max_resident"] = max(calls["max_resident"], len(_resident(engine)))
        calls["max_bytes"] = max(calls["max_bytes"], engine.memory.device_bytes())

    monkeypatch.setattr(S, "assert_invariants", counting)
    rt.check_invariants = True
    for x in batches(3):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
    n_hooks = len(engine.chunks)  # at least one pre-forward per streamed unit, plus grad hooks
    assert calls["n"] > 3 * n_hooks
    assert calls["max_resident"] == plan.n_buffer  # the buffers are used, never exceeded
    assert calls["max_bytes"] <= engine.memory.device_bound()
    cb = engine.precision.compute_dtype.itemsize
    size = engine.layout.chunk_size * cb
    persistent = sum(c.storage.device_bytes() for c in engine.chunks if c.persistent)
    # A buffer: a chunk's compute copy and the gradients of its trainable span (each span rounded
    # up to the alignment; the chunk's waste after its last member is not stored).
    spans = [(align(c.spec.trainable_start), align(c.spec.trainable_numel)) for c in engine.chunks if not c.persistent]
    per_buffer = max((f + 2 * t) * cb for f, t in spans)
    assert size < per_buffer <= 2 * size
    assert engine.memory.device_bound() == persistent + plan.n_buffer * per_buffer
    # At rest (after step) only persistent chunks and idle buffers are on the device.
    assert engine.memory.device_bytes() <= persistent + plan.n_buffer * size


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_streamed_parameters_read_the_host_copy_at_rest(precision):
    """Outside forward/backward a streamed parameter holds its current value, never garbage: in
    mixed precision the host compute copy, where the offloaded gradients landed during backward,
    is rewritten from the updated fp32 master."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1),
                     precision=precision, device="cpu")
    before = engine.state_dict()
    for x in batches(2):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
    sd = engine.state_dict()
    cdt = engine.precision.compute_dtype
    for name, p in model.named_parameters():
        assert p.dtype == cdt and not torch.equal(sd[name], before[name]), name  # it trained
        assert torch.equal(p.detach(), sd[name].to(cdt)), name


def test_fetch_waits_for_the_chunks_own_update():
    """After backward every streamed chunk is being updated; a forward's fetch of a chunk waits
    for that chunk's update only: when the first chunk is on the device again, the others are
    still updating."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    train_engine(engine, [x])  # the first step holds its updates for a late clipping request
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    assert all(c.state is ChunkState.UPDATING for c in engine.chunks)
    seen = []
    first = model.transformer.wte
    handle = first.register_forward_hook(lambda *a: seen.append([c.state for c in engine.chunks]))
    with torch.no_grad():
        engine.module(input_ids=x)
    handle.remove()
    assert seen[0][0] is ChunkState.RESIDENT and all(s is ChunkState.UPDATING for s in seen[0][2:])
    assert not any(c.state is ChunkState.UPDATING for c in engine.chunks)  # every chunk was used
    engine.step()
    assert all(c.state in (ChunkState.HOST, ChunkState.RESIDENT) for c in engine.chunks)


def test_updates_after_step_are_waited_for_by_their_own_fetch():
    """Under norm clipping step() hands the streamed chunks' Adam to the worker and returns with
    the chunks UPDATING; zero_grad does not wait for them; the next forward's fetch of a chunk
    waits for that chunk's update only; state_dict waits for all of them."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu", config=pt.ProTrainConfig(clipping=("norm", 1.0)))
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    assert not any(c.applied for c in engine.chunks)  # landed and finished, not updated
    engine.step()
    engine.zero_grad()
    assert all(c.state is ChunkState.UPDATING for c in engine.chunks)
    seen = []
    handle = model.transformer.wte.register_forward_hook(lambda *a: seen.append([c.state for c in engine.chunks]))
    with torch.no_grad():
        engine.module(input_ids=x)
    handle.remove()
    assert seen[0][0] is ChunkState.RESIDENT and all(s is ChunkState.UPDATING for s in seen[0][2:])
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    assert any(c.state is ChunkState.UPDATING for c in engine.chunks)
    engine.state_dict()
    assert not any(c.state is ChunkState.UPDATING for c in engine.chunks)


def test_the_buffer_policy_chooses_the_chunk_that_gives_its_buffer_up():
    """``BufferPolicy.victim`` (the policy; the scheduler moves the chunks): a free buffer needs
    no victim; an issued offload goes first (its copy done first, then the least recently
    used); then the least recently used idle chunk that is neither pinned nor protected nor
    holding gradients; a chunk holding some of its gradients only when spilling is allowed;
    False when every buffer is busy."""
    from types import SimpleNamespace

    from protrain_core.runtime.scheduler import BufferPolicy

    def chunk(index, state, last_use, *, pins=0, grads=False, done=True):
        return SimpleNamespace(index=index, state=state, last_use=last_use, pins=pins, holds_gradient_buffer=grads,
                               device_resident=state in (F, R, O), copy_done=lambda ctx, done=done: done)

    policy = BufferPolicy(n_buffer=3)
    idle_old, idle_new, on_host = chunk(0, R, 1), chunk(1, F, 5), chunk(2, H, 0)
    assert policy.victim([idle_old, idle_new, on_host], set(), CTX, spill=False) is None  # 2 of 3 buffers used
    pinned, partial = chunk(3, R, 0, pins=1), chunk(4, R, 0, grads=True)
    assert policy.victim([idle_old, idle_new, pinned], set(), CTX, spill=False) is idle_old
    assert policy.victim([idle_old, idle_new, pinned], {0}, CTX, spill=False) is idle_new
    assert policy.victim([idle_old, partial, pinned], {0}, CTX, spill=False) is False
    assert policy.victim([idle_old, partial, pinned], {0}, CTX, spill=True) is partial
    copying, copied = chunk(5, O, 0, done=False), chunk(6, O, 9)
    assert policy.victim([idle_old, copying, copied], set(), CTX, spill=False) is copied
    assert policy.victim([idle_old, copying, pinned], set(), CTX, spill=False) is copying
