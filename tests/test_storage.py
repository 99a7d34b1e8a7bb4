"""Chunk storage: the one byte formula (the chunk format record, chunk_format.py) is what the
engine allocates and what the profile hands the planner, for trainable, frozen (compute copy only), partly frozen
(a trainable span) and sharded chunks."""

import contextlib

import pytest
import torch

import protrain_core as pt
from conftest import n_chunks, tiny_gpt2
from protrain_core.chunk_format import ChunkFormat, align, dtype_name
from protrain_core.runtime.device import as_context
from protrain_core.runtime.host_pool import HostPool
from protrain_core.runtime.sharding import Sharding, piece
from protrain_core.runtime.storage import ChunkStorage, chunk_formats


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed", "16-mixed"])
def test_profile_facts_match_the_allocation(precision, amsgrad):
    """The profiler's per-chunk bytes (what the search plans with) are what the engine allocates."""
    model = tiny_gpt2()
    for name, p in model.named_parameters():
        if ".h.1." in name:
            p.requires_grad_(False)  # a chunk without gradients or Adam states
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], amsgrad=amsgrad)
    n = n_chunks(model)
    for n_persist in (0, n):
        engine = pt.wrap(model, opt, pt.Plan(n_persist=n_persist, n_buffer=2), precision=precision, device="cpu")
        records = tuple(chunk_formats(model, opt, engine.layout, engine.precision, engine.config))
        assert records == tuple(c.storage.fmt for c in engine.chunks)
        streamed = [c.index for c in engine.chunks if not c.persistent]
        # The host pool aligns each tensor to 64 bytes: at most 6 tensors per chunk.
        host = [f.streamed_host_bytes for f in records]
        assert 0 <= engine.memory.host_bytes() - sum(host[i] for i in streamed) < 64 * 6 * max(1, len(streamed))
        for c in engine.chunks:
            if c.persistent:
                assert c.storage.device_bytes() == records[c.index].persistent_device_bytes
        assert engine.memory.device_bound() == (
            sum(f.persistent_device_bytes for f in records[:n_persist])
            + min(2, n - n_persist) * max((f.buffer_device_bytes for f in records[n_persist:]), default=0))
        engine.close()
    S = engine.layout.chunk_size
    cb = engine.precision.compute_dtype.itemsize
    per_param = {"32-true": 16, "bf16-true": 8, "bf16-mixed": 18, "16-mixed": 18}[precision]
    per_trainable = per_param - cb + (engine.precision.master_dtype.itemsize if amsgrad else 0)
    # A chunk keeps its frozen span and its trainable span, each rounded up to the alignment: not
    # the chunk's waste after its last trainable member (a frozen chunk is its frozen span).
    spans = {c.index: (align(c.spec.trainable_start if c.spec.trainable_numel else S), align(c.spec.trainable_numel))
             for c in engine.chunks}
    for c in engine.chunks:  # the compute copy of both spans, the states of its trainable span
        f, t = spans[c.index]
        assert host[c.index] == (f + t) * cb + per_trainable * t
    assert [f.buffer_device_bytes for f in records] == [(f + 2 * t) * cb for f, t in spans.values()]
    assert [f.upload_bytes for f in records] == [(f + t) * cb for f, t in spans.values()]
    dtypes = {"32-true": ("float32", "float32"), "bf16-true": ("bfloat16", "bfloat16"),
              "bf16-mixed": ("bfloat16", "float32"), "16-mixed": ("float16", "float32")}[precision]
    assert {(dtype_name(f.compute_dtype), dtype_name(f.master_dtype)) for f in records} == {dtypes}
    assert any(f + t < S for f, t in spans.values())  # the last chunk's waste is not stored
    frozen = [c for c in engine.chunks if not c.storage.fmt.trains]  # block 1's chunk: its compute copy only
    assert frozen and all(host[c.index] == align(S) * cb and records[c.index].offload_bytes == 0 for c in frozen)


def _storage(fmt, *, persistent):
    storage = ChunkStorage(fmt, persistent=persistent, ctx=as_context("cpu"), pin=False, n_members=1)
    return storage, storage.pool


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)], ids=["fp32", "mixed", "bf16-true"])
def test_a_trainable_chunk(dtypes):
    cdt, mdt = dtypes
    S, cb, mb = 1024, cdt.itemsize, mdt.itemsize
    fmt = ChunkFormat(numel=S, compute_dtype=cdt, master_dtype=mdt, adam_states=3)
    separate = cdt != mdt
    assert fmt.persistent_device_bytes == S * cb + (int(separate) + 1 + 3) * S * mb
    assert fmt.streamed_host_bytes == S * cb + (int(separate) + 1 + 3) * S * mb
    assert (fmt.buffer_device_bytes, fmt.upload_bytes, fmt.offload_bytes) == (2 * S * cb, S * cb, S * cb)
    persistent, _ = _storage(fmt, persistent=True)
    assert persistent.device_bytes() == fmt.persistent_device_bytes
    assert (persistent.master.data_ptr() == persistent.device_copy.data_ptr()) is not separate
    streamed, pool = _storage(fmt, persistent=False)
    assert streamed.device_bytes() == 0 and streamed.host_copy.numel() == S
    assert sum(n * d.itemsize for n, d, _ in fmt.host_tensors()) == fmt.streamed_host_bytes <= pool.nbytes
    assert (streamed.master.data_ptr() == streamed.host_copy.data_ptr()) is not separate
    streamed.allocate_device_copy()
    streamed.allocate_grad_buffer(zero=())
    assert streamed.device_bytes() == fmt.buffer_device_bytes


@pytest.mark.parametrize("mixed", [False, True])
def test_a_chunk_with_no_trainable_member_holds_its_compute_copy_only(mixed):
    cdt = torch.bfloat16 if mixed else torch.float32
    S = 1024
    fmt = ChunkFormat(numel=S, compute_dtype=cdt, master_dtype=torch.float32, trainable_numel=0, adam_states=0)
    assert fmt.persistent_device_bytes == fmt.streamed_host_bytes == fmt.buffer_device_bytes == S * cdt.itemsize
    assert fmt.host_tensors() == [(S, cdt, True)] and fmt.offload_bytes == 0
    for persistent in (True, False):
        storage, _ = _storage(fmt, persistent=persistent)
        assert storage.master is storage.grad_acc is storage.exp_avg is storage.max_exp_avg_sq is None
        assert storage.compute_home.numel() == S
    with pytest.raises(ValueError, match="a chunk with no trainable member has no optimizer state"):
        ChunkFormat(numel=S, compute_dtype=cdt, master_dtype=torch.float32, trainable_numel=0, adam_states=2)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_partly_frozen_chunk_trains_its_span_only(mixed):
    """Frozen members first, a trainable span of T elements after them: only the span has a
    master, gradients and Adam states; the compute copy holds both spans, not the chunk's waste
    after its last member."""
    cdt = torch.bfloat16 if mixed else torch.float32
    S, start, T = 1000, 800, 160  # 40 elements of waste at the end
    fmt = ChunkFormat(numel=S, compute_dtype=cdt, master_dtype=torch.float32, trainable_start=start,
                      trainable_numel=T, adam_states=2)
    states = (int(mixed) + 1 + 2) * T * 4
    assert fmt.persistent_device_bytes == fmt.streamed_host_bytes == (start + T) * cdt.itemsize + states
    assert fmt.buffer_device_bytes == (start + 2 * T) * cdt.itemsize and fmt.offload_bytes == T * cdt.itemsize
    for persistent in (True, False):
        storage, _ = _storage(fmt, persistent=persistent)
        assert storage.grad_acc.numel() == storage.exp_avg.numel() == storage.master.numel() == T
        assert storage.compute_home.numel() == start + T
        if not mixed:  # the master is the span of the compute copy
            assert storage.master.data_ptr() == storage.compute_home[start:].data_ptr()


def test_one_process_is_rank_0_of_one():
    """The shard layout of one process: whole members at their layout offsets, in the host and
    the device copy alike, uploaded in one copy; the trainable span, padded to the alignment,
    follows the frozen one."""
    from protrain_core.runtime.storage import ShardLayout
    from protrain_core.structure.layout import ParamSlot
    fmt = ChunkFormat(numel=1000, compute_dtype=torch.bfloat16, master_dtype=torch.float32, trainable_start=800,
                      trainable_numel=150)
    layout = ShardLayout(fmt)
    frozen, trainable = ParamSlot("a", 16, 100, (10, 10), trainable=False), ParamSlot("b", 816, 120, (120,))
    assert fmt.whole and (fmt.frozen_shard, fmt.state_numel, fmt.padded_numel) == (800, 160, 960)
    assert layout.device_offset(frozen) == 16 and layout.device_offset(trainable) == 816
    assert layout.host_piece(frozen) == (0, 16, 100) and layout.host_piece(trainable) == (0, 816, 120)
    assert layout.state_piece(trainable) == (0, 16, 120) and layout.span_offset(trainable) == 16
    assert layout.compute_span(persistent=False) == layout.compute_span(persistent=True) == (800, 160)
    assert layout.upload_places == ((0, 0, 960),)
    rank1 = ShardLayout(fmt.sharded(2), rank=1)  # the same questions, answered for rank 1 of 2
    assert not rank1.fmt.whole and rank1.upload_places == ((0, 400, 400), (400, 800 + 80, 80))
    assert rank1.host_piece(frozen) is None and rank1.state_piece(trainable) == (64, 0, 56)


def test_one_process_is_the_group_of_one(monkeypatch):
    """One process is a ``Sharding`` too, the group of one: its collectives give what they would
    with W = 1 without calling torch.distributed, and a one-process engine trains a streamed and
    a persistent chunk, clipping and fp16's overflow check included, without issuing one
    collective on the device (no gather, no reduce-scatter, no broadcast of its weights)."""
    import torch.distributed as dist

    from conftest import batches
    from protrain_core.runtime import device as D
    from protrain_core.runtime import sharding as S
    one = Sharding.resolve()
    assert one is S.ONE_PROCESS and one.whole and (one.group, one.rank, one.world, one.pre_scale) == (None, 0, 1, None)
    for name in ("all_reduce", "broadcast", "all_gather_object", "barrier", "isend", "irecv", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "get_backend_config"):
        monkeypatch.setattr(dist, name, lambda *a, name=name, **k: pytest.fail(f"dist.{name} in one process"))
    full = torch.arange(8.0)
    one.gather_(full)
    one.broadcast_(full)
    assert one.all_reduce_(full) is full and full.tolist() == list(range(8))
    out = torch.empty(8)
    one.reduce_scatter_mean(out, full)
    assert torch.equal(out, full)
    assert one.max_on_host([1.0, -2.0]) == [1.0, -2.0] and one.gather_objects("x") == ["x"]
    assert one.broadcast_object("x") == "x" and S.agree(one, "plan") == "plan"
    assert S.agree_budgets(one, 10, 20) == (10, 20)
    S.check_same_configuration(one, {"precision": "32"})
    one.barrier()
    one.check_device(torch.device("cpu"))

    def no_collective(self, *a, **k):
        raise AssertionError("a device collective in one process")

    monkeypatch.setattr(D.DeviceContext, "collective", no_collective)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    engine = pt.wrap(model, opt, pt.Plan(n_persist=1, n_buffer=2), precision="16-mixed", device="cpu")
    assert engine.sharding is one and {c.persistent for c in engine.chunks} == {True, False}
    for x in batches(2):
        engine.backward(model(x, labels=x).loss)
        engine.clipping.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
    engine.close()


@pytest.mark.parametrize("mixed", [False, True])
def test_a_shard_of_a_chunk(mixed):
    """Two processes ([Note: sharded chunks]): each keeps half of the frozen and of the trainable
    span, padded to equal aligned shards; the compute copy is gathered to the padded size, and
    the trainable span starts after the padded frozen span in it."""
    cdt = torch.bfloat16 if mixed else torch.float32
    S, F, world = 1000, 100, 2
    fmt = ChunkFormat(numel=S, compute_dtype=cdt, master_dtype=torch.float32, trainable_start=F, adam_states=2,
                      world_size=world)
    # T = 900: ceil(900 / 2) = 450 -> 464 (aligned to 16); F = 100: 50 -> 64.
    assert (fmt.frozen_shard, fmt.state_numel, fmt.shard_numel, fmt.padded_numel) == (64, 464, 528, 1056)
    assert fmt.trainable_device_start == 128 and fmt.grad_buffer_numel == 928
    # As in one process, an fp32 master is this rank's piece of the compute copy where it rests.
    assert fmt.separate_master is mixed
    states = (int(mixed) + 1 + 2) * 464 * 4
    assert fmt.persistent_device_bytes == (1056 + 928) * cdt.itemsize + states  # with its gradient buffer
    assert fmt.streamed_host_bytes == 528 * cdt.itemsize + states
    assert fmt.upload_bytes == 528 * cdt.itemsize and fmt.offload_bytes == 464 * cdt.itemsize
    assert fmt.gather_bytes == 1056 * cdt.itemsize and fmt.reduce_bytes == 928 * cdt.itemsize
    rank1 = Sharding(group=None, rank=1, world=world)
    kw = dict(ctx=as_context("cpu"), pin=False, n_members=1, sharding=rank1)
    storage = ChunkStorage(fmt, persistent=True, **kw)
    assert storage.device_copy.numel() == 1056 and storage.grad_acc.numel() == storage.exp_avg.numel() == 464
    assert storage.master.numel() == 464
    span = storage.compute_span()  # rank 1's piece of the trainable span, in the gathered copy
    assert span.storage_offset() == 128 + 464 and span.numel() == 464
    assert (storage.master.data_ptr() == span.data_ptr()) is not mixed
    streamed = ChunkStorage(fmt, persistent=False, **kw)
    assert streamed.host_copy.numel() == 528 and streamed.device_copy.numel() == 1056
    streamed.allocate_device_copy()
    places = [(h.storage_offset() - streamed.host_copy.storage_offset(), d.storage_offset(), d.numel())
              for h, d in streamed.shard_places()]
    assert places == [(0, 64, 64), (64, 128 + 464, 464)]


def test_an_empty_member_is_whole_on_rank_0():
    """A zero-size parameter has a (empty) piece on rank 0 only: whole there (so its views keep
    its shape and a checkpoint saves it once), none elsewhere."""
    from protrain_core.runtime.storage import ShardLayout
    from protrain_core.structure.layout import ParamSlot
    fmt = ChunkFormat(numel=64, compute_dtype=torch.float32, master_dtype=torch.float32, trainable_start=16,
                      trainable_numel=32)
    empty, frozen = ParamSlot("e", 32, 0, (0, 4)), ParamSlot("f", 16, 0, (0,), trainable=False)
    one = ShardLayout(fmt)
    assert one.state_piece(empty) == (0, 16, 0) and one.host_piece(empty) == (0, 32, 0)
    assert one.host_piece(frozen) == (0, 16, 0)
    rank1 = ShardLayout(fmt.sharded(2), rank=1)
    assert rank1.state_piece(empty) is None and rank1.host_piece(frozen) is None


def test_a_member_split_between_ranks():
    """piece(): the part of a member each rank owns."""
    assert piece(10, 20, 16, 0) == (0, 10, 6) and piece(10, 20, 16, 1) == (6, 0, 14) and piece(10, 20, 16, 2) is None


def test_host_pool_is_exact_and_aligned():
    pool = HostPool([(10, torch.float32, False), (3, torch.bfloat16, False)], pin=False)
    assert pool.nbytes == 64 + 64
    a, b = pool.take(10, torch.float32), pool.take(3, torch.bfloat16)
    assert a.data_ptr() % 64 == 0 and b.data_ptr() - a.data_ptr() == 64


def _chunks_of(world: int):
    """A tiny GPT-2 with some frozen matrices, every chunk streamed: its engine's chunks, in one
    process, or sharded over ``world`` simulated ranks (size-only, on the meta device)."""
    from protrain_core.simulator.device import SimulatedDevice, SimulatedGroup

    sim = SimulatedDevice("h100") if world > 1 else None
    with torch.device("meta") if sim else contextlib.nullcontext():
        model = tiny_gpt2()
    for name, p in model.named_parameters():
        if "attn.c_proj" in name or ".h.1." in name:
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with sim or contextlib.nullcontext():
        return pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=2), device=sim or "cpu",
                       process_group=SimulatedGroup(sim, world) if sim else None)


@pytest.mark.parametrize("world", [1, 3])
def test_a_gradient_buffer_is_zeroed_exactly_where_no_gradient_is_written(world):
    """Issue 26: a chunk's gradient buffer is allocated uninitialised and zeroed only in the
    ranges no member's gradient is written to (``ChunkValues.span_gaps``): with the members'
    places they cover the buffer once -- in one process the members alone (no gap), sharded
    the padding to ``W`` equal pieces too."""
    engine = _chunks_of(world)
    padded = 0
    for c in engine.chunks:
        numel = c.storage.fmt.grad_buffer_numel
        covered = torch.zeros(numel, dtype=torch.int32)
        gaps = c.values.span_gaps(c.grad_members)
        for start, end in gaps:
            assert 0 <= start < end <= numel
            covered[start:end] += 1
        for i in c.grad_members:
            covered[c.values.span_view(torch.arange(numel), i).flatten()] += 1
        assert bool((covered == 1).all()), c
        assert world > 1 or gaps == (), (c, gaps)
        padded += bool(gaps)
    assert padded if world > 1 else not padded
    engine.close()
