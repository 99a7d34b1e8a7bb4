"""The per-chunk residency state machine and the device-memory invariants."""

import itertools

import pytest
import torch

import protrain_core as pt
from protrain_core.chunk import TRANSITIONS, VERBS, Chunk, ChunkState, IllegalTransition
from protrain_core.layout import ChunkSpec, ParamSlot
from conftest import batches, tiny_gpt2, tiny_llama


def _chunk(state):
    spec = ChunkSpec(index=0, members=(ParamSlot("w", 0, 4, (4,)),), units=("u",), capacity=16)
    c = Chunk(spec, persistent=state is ChunkState.PERSISTENT, params=[torch.nn.Parameter(torch.zeros(4))], compute_dtype=torch.float32)
    c.state = state
    return c


EXPECTED = {
    ("begin_fetch", ChunkState.HOST): ChunkState.FETCHING,
    ("end_fetch", ChunkState.FETCHING): ChunkState.RESIDENT,
    ("release", ChunkState.RESIDENT): ChunkState.HOST,
    ("begin_offload", ChunkState.RESIDENT): ChunkState.OFFLOADING,
    ("end_offload", ChunkState.OFFLOADING): ChunkState.UPDATING,
    ("begin_update", ChunkState.HOST): ChunkState.UPDATING,
    ("end_update", ChunkState.UPDATING): ChunkState.HOST,
}


def test_transition_table_is_the_documented_one():
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize("verb,state", list(itertools.product(VERBS, list(ChunkState))), ids=lambda v: getattr(v, "name", v))
def test_every_verb_from_every_state(verb, state):
    c = _chunk(state)
    target = EXPECTED.get((verb, state))
    if target is None:
        with pytest.raises(IllegalTransition, match=f"cannot {verb} in state {state.name}"):
            getattr(c, verb)()
        assert c.state is state  # an illegal verb changes nothing
    else:
        getattr(c, verb)()
        assert c.state is target


def test_persistent_chunks_never_move():
    c = _chunk(ChunkState.PERSISTENT)
    for verb in VERBS:
        with pytest.raises(IllegalTransition):
            getattr(c, verb)()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=0, n_buffer=2), pt.Plan(n_persist=1, n_buffer=2)], ids=str)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_device_bytes_invariant_at_every_hook(make, plan, precision):
    """At every hook: at most n_buffer streamed chunks hold device memory, parameters point at
    the copy that is valid, and the device bytes (read from the storages) stay within
    persistent bytes + n_buffer x (chunk params + chunk grads)."""
    model = make()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan, precision=precision, device="cpu")
    rt = engine.runtime
    calls = {"n": 0, "max_resident": 0, "max_bytes": 0}
    original = rt.assert_invariants

    def counting():
        original()
        calls["n"] += 1
        calls["max_resident"] = max(calls["max_resident"], len(rt._resident()))
        calls["max_bytes"] = max(calls["max_bytes"], rt.device_bytes())

    rt.assert_invariants = counting
    rt.check_invariants = True
    for x in batches(3):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
    n_hooks = len(engine.chunks)  # at least one pre-forward per streamed unit, plus grad hooks
    assert calls["n"] > 3 * n_hooks
    assert calls["max_resident"] == plan.n_buffer  # the buffers are used, never exceeded
    assert calls["max_bytes"] <= rt.device_bytes_bound()
    size = engine.layout.chunk_size * torch.tensor([], dtype=engine.precision.compute_dtype).element_size()
    persistent = sum(c.device_bytes() for c in engine.chunks if c.persistent)
    assert rt.device_bytes_bound() == persistent + plan.n_buffer * 2 * size
    # At rest (after step) only persistent chunks and idle buffers are on the device.
    assert engine.device_bytes() <= persistent + plan.n_buffer * size


def test_streamed_parameters_read_the_host_copy_at_rest():
    """Outside forward/backward a streamed parameter holds its current value, never garbage."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    sd = engine.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), sd[name]), name


def test_fetch_waits_for_the_chunks_own_update():
    """After backward, the first chunk's forward use waits for that chunk's CPU update only."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    states = [c.state for c in engine.chunks]
    assert ChunkState.UPDATING in states or all(s is ChunkState.HOST for s in states)
    # A forward without step(): each chunk's update is collected when the chunk is fetched.
    with torch.no_grad():
        engine.module(input_ids=x)
    assert not any(c.state is ChunkState.UPDATING for c in engine.chunks)  # every chunk was used
    engine.step()
    assert all(c.state in (ChunkState.HOST, ChunkState.RESIDENT) for c in engine.chunks)
