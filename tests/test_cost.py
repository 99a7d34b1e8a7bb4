"""Cost models (eq. 3-10) on hand-built profiles; every expected value is worked out here."""

import dataclasses

import pytest
import torch

import protrain_core as pt
from protrain_core.chunk_format import ChunkFormat
from protrain_core.planner.profiles import Hardware, Profile, Segment
from protrain_core.update import UpdateSchedule


def hand_profile(*, async_copies=True) -> Profile:
    """3 chunks of 128 trainable fp32 elements (512 B): X = 512/512 = 1 s per upload, Y =
    512/1024 = 0.5 s per offload; CPU Adam 128 params/s (U = 1 s a chunk), device Adam 1280/s
    (V = 0.1 s). Their records ([Note: chunk storage]): persistent, 2048 B (compute copy,
    accumulator, two moments); streamed, 2048 B of host memory and a 1024 B buffer (compute copy
    and gradients).
    Segments: pre on chunk 0, block.0 on chunk 1, block.1 on chunk 2, post on chunks 0 and 2
    (a tied head: chunk 0 is an *extra* fetch of the post segment, homed at chunk 2)."""

    def block(name, chunk):
        return Segment(name=name, kind="block", chunks=(chunk,), fwd_s=2.0, bwd_s=4.0, recompute_s=2.0,
                       out_bytes=10, saved_bytes=100, fwd_peak_bytes=50, bwd_peak_bytes=120, recompute_peak_bytes=110)

    segments = (
        Segment(name="pre", kind="pre", chunks=(0,), fwd_s=1.0, bwd_s=1.0, recompute_s=0.0,
                out_bytes=20, saved_bytes=0, fwd_peak_bytes=25, bwd_peak_bytes=30, recompute_peak_bytes=0),
        block("block.0", 1),
        block("block.1", 2),
        Segment(name="post", kind="post", chunks=(0, 2), fwd_s=1.0, bwd_s=1.0, recompute_s=0.0,
                out_bytes=30, saved_bytes=0, fwd_peak_bytes=40, bwd_peak_bytes=60, recompute_peak_bytes=0),
    )
    hw = Hardware(device="hand", async_copies=async_copies, h2d_bytes_per_s=512.0, d2h_bytes_per_s=1024.0,
                  cpu_adam_params_per_s=128.0, device_adam_params_per_s=1280.0, device_memory_bytes=10**6)
    return Profile(key="hand", description="hand-built", precision="32-true", chunks=(CHUNK,) * 3,
                   resident_sets=((0,), (1,), (2,)), segments=segments, base_bytes=5, fragmentation=1.0, hardware=hw)


CHUNK = ChunkFormat(numel=128, compute_dtype=torch.float32, master_dtype=torch.float32)


def rt(profile, schedule=UpdateSchedule.DURING_BACKWARD, **plan):
    return pt.estimate_runtime(profile, pt.Plan(**plan), schedule=schedule)


def test_each_chunk_is_charged_its_own_upload():
    """Chunks differ (an embedding chunk, a rank's shard): chunk 0 uploads 1024 bytes (X_0 = 2 s:
    a frozen span as large as its trainable one), the others 512 (1 s). p=0, B=1 as in test_one_buffer_serialises: forward c0 1 + 2, c1 2 + 1,
    c2 3 + 1 + 2 (its extra fetch is chunk 0's) -> 12; backward c2 5 + 2 (extra) + 0.5, c1 4 + 1
    + 0.5, c0 1 + 2 + 0.5 -> 16.5. The search's vectorised grid charges the same."""
    embedding = ChunkFormat(numel=256, compute_dtype=torch.float32, master_dtype=torch.float32, trainable_start=128)
    profile = dataclasses.replace(hand_profile(), chunks=(embedding, CHUNK, CHUNK))
    r = rt(profile, n_persist=0, n_buffer=1)
    assert (r.forward_s, r.backward_s) == pytest.approx((12.0, 16.5))
    assert r.h2d_s == pytest.approx(2 + 1 + 1 + 2 + 2 + 1 + 2)
    persistent_embedding = rt(profile, n_persist=1, n_buffer=1)  # chunk 0's uploads are gone
    assert persistent_embedding.h2d_s == pytest.approx(1 + 1 + 1)
    cm = pt.CostModel(profile)
    grid = cm.grid().phases_of_set(frozenset(), torch.ones(len(cm.grid().pairs), dtype=torch.int64))
    row = cm.grid().pairs.index((0, 0))  # no swapped, no checkpointed block
    assert float(grid[row]) == pytest.approx(r.forward_s + r.backward_s + r.device_adam_s)


def test_a_named_persistent_set_is_charged_chunk_by_chunk():
    """Plan.persistent_chunks=(2,), B=1: chunk 2 persists, chunks 0 and 1 stream.
    Forward: c0 1 + X 1 = 2; c1 2 + 1 = 3; c2 (persistent) 3 + its extra fetch of chunk 0, 1 -> 4: 9.
    Backward: the last streamed chunk (1) is still resident: c2 max(5, 1) = 5; c1 4 + off 0.5 = 4.5;
    c0 1 + X 1 + 0.5 = 2.5 -> 12. CPU chain: c1 max(0, 9.5 + 0.5) + 1 = 11; c0 max(11, 12 + 0.5) + 1
    = 13.5; device Adam of chunk 2 alone 0.1: T = 9 + max(12.1, 13.5) = 22.5. Memory: chunk 2's
    device bytes, chunks 0 and 1's host bytes."""
    plan = pt.Plan(n_persist=1, n_buffer=1, persistent_chunks=(2,))
    r = pt.estimate_runtime(hand_profile(), plan)
    assert (r.forward_s, r.backward_s, r.total_s) == pytest.approx((9.0, 12.0, 22.5))
    assert (r.h2d_s, r.d2h_s, r.device_adam_s) == pytest.approx((5.0, 1.0, 0.1))
    m = pt.estimate_memory(hand_profile(), plan)
    assert (m.persistent_bytes, m.buffer_bytes, m.host_bytes) == (2048, 1024, 2 * 2048)
    # The first chunk instead (the default plan with n_persist=1): forward 1 + 3 + 4, backward
    # 5.5 + 5.5 + 1, T = 8 + max(12.1, 12.5).
    assert rt(hand_profile(), n_persist=1, n_buffer=1).total_s == pytest.approx(20.5)


def test_all_persistent():
    # F per chunk: c0 = pre 1, c1 = 2, c2 = block 2 + post 1 = 3 -> forward 6; G: 1, 4, 4 + 1 -> backward 10;
    # device Adam 3 x 0.1; no CPU Adam: T = 6 + max(10 + 0.3, 0) = 16.3.
    r = rt(hand_profile(), n_persist=3, n_buffer=0)
    assert r.forward_s == pytest.approx(6.0)
    assert r.backward_s == pytest.approx(10.0)
    assert r.device_adam_s == pytest.approx(0.3)
    assert r.total_s == pytest.approx(16.3)
    assert r.h2d_s == 0 and r.d2h_s == 0 and r.cpu_adam_s == 0
    assert r.bottleneck == "device compute"


def test_streamed_with_prefetch_and_resident_window():
    # p=1, B=2. Forward: c0 1; c1 max(2, X=1) = 2; c2 max(3, 1) = 3 (its extra chunk 0 is persistent) -> 6.
    # Backward: the window N-B = 1 keeps chunks 1, 2 resident: c2 max(5, 0, Y) = 5, c1 4, c0 1 -> 10.
    # CPU chain: c2 done at 5, offloaded 5.5, Adam to 6.5; c1 done at 9, offloaded 9.5, Adam to 10.5.
    # T = 6 + max(10 + 0.1, 10.5) = 16.5.
    r = rt(hand_profile(), n_persist=1, n_buffer=2)
    assert (r.forward_s, r.backward_s) == pytest.approx((6.0, 10.0))
    assert r.total_s == pytest.approx(16.5)
    assert r.optimizer_s == pytest.approx(0.5)
    assert r.h2d_s == pytest.approx(2.0) and r.d2h_s == pytest.approx(1.0)
    assert r.cpu_adam_s == pytest.approx(2.0) and r.device_adam_s == pytest.approx(0.1)


def test_one_buffer_serialises():
    # p=0, B=1. Forward: c0 1 + 1 = 2; c1 2 + 1 = 3; c2 3 + X(1 + extra chunk 0) = 5 -> 10.
    # Backward, window 3-1 = 2: c2 5 + 1 (extra) + 0.5 = 6.5; c1 4 + 1 + 0.5 = 5.5; c0 1 + 1 + 0.5 = 2.5 -> 14.5.
    # CPU chain: 6.5+0.5+1 = 8; max(8, 12+0.5)+1 = 13.5; max(13.5, 14.5+0.5)+1 = 16.
    # T = 10 + max(14.5, 16) = 26.
    r = rt(hand_profile(), n_persist=0, n_buffer=1)
    assert (r.forward_s, r.backward_s, r.total_s) == pytest.approx((10.0, 14.5, 26.0))
    assert r.bottleneck == "device compute"


def test_recompute_adds_to_backward():
    # interleaved_modes(2, 0, 1) checkpoints block 0: G c1 = 4 + 2 -> backward 12, T = 6 + 12.3.
    r = rt(hand_profile(), n_persist=3, n_buffer=0, n_checkpoint=1)
    assert r.recompute_s == pytest.approx(2.0)
    assert r.total_s == pytest.approx(18.3)


def test_swap_hidden_with_async_copies_but_not_without():
    # Swapping block 0: out 100/1024 s, in 100/512 s. With CUDA streams both hide behind compute
    # (16.3 as with keep); on the CPU they add: (6 + 100/1024) + (10 + 100/512) + 0.3.
    assert rt(hand_profile(), n_persist=3, n_buffer=0, n_swap=1).total_s == pytest.approx(16.3)
    sync = hand_profile(async_copies=False)
    r = rt(sync, n_persist=3, n_buffer=0, n_swap=1)
    assert (r.forward_s, r.backward_s, r.total_s) == pytest.approx((6 + 100 / 1024, 10 + 100 / 512, 16.3 + 300 / 1024))


def test_measured_swap_times_replace_the_bandwidth():
    # A CPU profile measures what swapping adds per block: block 0 +0.5 s forward, +1.0 s backward
    # (instead of 0.125 / 0.25 from the bandwidth): 6.5 + 11 + 0.3 = 17.8. Its grid form agrees.
    import dataclasses

    sync = hand_profile(async_copies=False)
    segs = list(sync.segments)
    segs[1] = dataclasses.replace(segs[1], swap_out_s=0.5, swap_in_s=1.0)
    measured = dataclasses.replace(sync, segments=tuple(segs))
    plan = pt.Plan(n_persist=3, n_buffer=0, n_swap=1)
    r = rt(measured, **dataclasses.asdict(plan))
    assert (r.forward_s, r.backward_s, r.total_s) == pytest.approx((6.5, 11.0, 17.8))
    grid = pt.CostModel(measured).grid()
    row = grid.pairs.index((1, 0))
    bound = grid.phases_of_set(frozenset(range(3)), torch.zeros(len(grid.pairs), dtype=torch.long))
    assert bound[row].item() == pytest.approx(17.8)


def test_sync_streaming_adds_up():
    # CPU device, p=1, B=2: forward 1 + (2 + 1) + (3 + 1) = 8; backward (window 1: no re-upload)
    # (5 + 0.5) + (4 + 0.5) + 1 = 11; T = 8 + 11 + 0.1 + 2 = 21.1.
    r = rt(hand_profile(async_copies=False), n_persist=1, n_buffer=2)
    assert (r.forward_s, r.backward_s, r.total_s) == pytest.approx((8.0, 11.0, 21.1))


def test_adam_after_backward_overlaps_the_next_forward():
    # p=1, B=2 as in test_streamed_with_prefetch_and_resident_window, Adam after backward
    # (NEXT_FORWARD): backward 10; the last gradients (chunk 1's) land at 9 + 0.5 = 9.5, before
    # backward ends, so the worker starts at once. Next forward: device Adam 0.1 first; c0
    # (persistent) to 1.1; c1's update ends at 1, its forward (upload hidden) 2 -> 3.1; c2's
    # update ends at 2, forward 3 -> 6.1. T = 10 + 6.1 = 16.1 (during backward: 16.5, where the
    # CPU chain ends 0.4 after backward's device work).
    r = rt(hand_profile(), UpdateSchedule.NEXT_FORWARD, n_persist=1, n_buffer=2)
    assert r.total_s == pytest.approx(16.1) and r.forward_s == pytest.approx(6.0)
    # A slow CPU Adam (U = 10 s a chunk): c1 waits to 10, c2 to 20: T = 10 + 20 + 3 = 33, where
    # updating during backward gives 6 + max(10.1, (5.5 + 10 = 15.5, then 25.5)) = 31.5.
    slow = dataclasses.replace(hand_profile(), hardware=dataclasses.replace(hand_profile().hardware, cpu_adam_params_per_s=12.8))
    assert rt(slow, UpdateSchedule.NEXT_FORWARD, n_persist=1, n_buffer=2).total_s == pytest.approx(33.0)
    assert rt(slow, n_persist=1, n_buffer=2).total_s == pytest.approx(31.5)


def test_each_part_of_the_cpu_update_is_charged_where_the_runtime_runs_it():
    # The slow CPU above (U = 10 s a chunk) of which the landing is L = 128 / 64 = 2 s. After
    # backward (NEXT_FORWARD) the landing and the compute copy's restore (2 L) run when the
    # gradients arrive: chunk 2's land at 5.5 -> 9.5, chunk 1's at max(9.5, 9.5) -> 13.5, 3.5
    # after backward's 10. Then U - L = 8 a chunk: c1 done 11.5, its forward to 13.5; c2 done
    # 19.5, forward to 22.5: T = 32.5 (33 when the whole update waited for the last landing).
    hw = dataclasses.replace(hand_profile().hardware, cpu_adam_params_per_s=12.8, cpu_land_params_per_s=64.0,
                             cpu_pass_params_per_s=128.0)
    split = dataclasses.replace(hand_profile(), hardware=hw)
    assert rt(split, UpdateSchedule.NEXT_FORWARD, n_persist=1, n_buffer=2).total_s == pytest.approx(32.5)
    # One clipping pass (1 s a chunk) is part of the update, wherever it runs: after backward
    # c1 is done at 12.5 -> 14.5, c2 at 21.5 -> 24.5: T = 34.5; during backward the chain is
    # 5.5 + 11 = 16.5, then 27.5: T = 6 + 27.5 = 33.5 (31.5 without the pass).
    def clipped(schedule):
        return pt.estimate_runtime(split, pt.Plan(n_persist=1, n_buffer=2), schedule=schedule, gradient_passes=1)

    assert clipped(UpdateSchedule.NEXT_FORWARD).total_s == pytest.approx(34.5)
    assert clipped(UpdateSchedule.DURING_BACKWARD).total_s == pytest.approx(33.5)
    assert rt(split, n_persist=1, n_buffer=2).total_s == pytest.approx(31.5)  # the landing's place changes nothing here


def test_speculative_update_is_between_the_two():
    # p=1, B=2: during backward 16.5 (test_streamed_with_prefetch_and_resident_window), after
    # backward 16.1 (above): a speculative step (benchmarks/bench_clipping.py) is the first when
    # kept, the second when redone.
    from benchmarks.bench_clipping import speculative_step

    plan = pt.Plan(n_persist=1, n_buffer=2)
    assert speculative_step(hand_profile(), plan, 0.0) == pytest.approx(16.5)
    assert speculative_step(hand_profile(), plan, 0.5) == pytest.approx(16.3)


def test_memory_keep_all():
    # Walk: pre fwd 25, bwd 30, holds 20; block.0 fwd 20 + max(50, 110) = 130, bwd 140, holds
    # 20 + 10 + 100; block.1 fwd 240, bwd 250, holds 240; post fwd 280, bwd 240 + 60 = 300.
    m = pt.estimate_memory(hand_profile(), pt.Plan(n_persist=3, n_buffer=0))
    assert m.activation_bytes == 300 and m.peak_at == "backward of post"
    assert m.persistent_bytes == 3 * 2048 and m.buffer_bytes == 0 and m.host_bytes == 0
    assert m.peak_bytes == 3 * 2048 + 5 + 300


def test_memory_checkpoint_and_swap():
    # All checkpointed: block.0 bwd 20 + max(120, 110) = 140, holds 30; block.1 bwd 30 + 120 = 150.
    m = pt.estimate_memory(hand_profile(), pt.Plan(n_persist=3, n_buffer=0, n_checkpoint=2))
    assert (m.activation_bytes, m.peak_at) == (150, "backward of block.1")
    # Both swapped, p=1, B=2: block.1 bwd 30 + 120 + block.0's prefetched 100 = 250 (the peak);
    # states 2048 + 2 x 1024; host: chunks 1, 2 (2 x 2048) + 200 swapped bytes.
    m = pt.estimate_memory(hand_profile(), pt.Plan(n_persist=1, n_buffer=2, n_swap=2))
    assert (m.activation_bytes, m.peak_at) == (250, "backward of block.1")
    assert m.peak_bytes == 2048 + 2 * 1024 + 5 + 250
    assert m.host_bytes == 2 * 2048 + 200


def test_fragmentation_scales_activations_only():
    prof = dataclasses.replace(hand_profile(), fragmentation=1.1)
    m = pt.estimate_memory(prof, pt.Plan(n_persist=3, n_buffer=0))
    assert m.activation_bytes == 330 and m.peak_bytes == 3 * 2048 + 5 + 330


def test_buffers_capped_by_streamed_chunks():
    a = pt.estimate_memory(hand_profile(), pt.Plan(n_persist=2, n_buffer=5))
    assert a.buffer_bytes == 1024  # one streamed chunk needs one buffer


def test_sharded_chunks_add_the_collectives():
    """Sharded over W=2 processes: a rank uploads and offloads its half (256 B: X 0.5 s, Y
    0.25 s), a fetch also all-gathers the chunk (512 B at 512 B/s: +1 s), an offload
    reduce-scatters the gradients first (512 B at 1024 B/s: +0.5 s), each rank's Adam updates
    half of the elements; the persistent chunks' reduce-scatters and gathers run beside backward
    and the updates (communication stream): what sticks out is charged."""
    one = hand_profile()
    hw = dataclasses.replace(one.hardware, gather_bytes_per_s=512.0, reduce_bytes_per_s=1024.0)
    two = dataclasses.replace(one, chunks=tuple(c.sharded(2) for c in one.chunks), hardware=hw)
    cm1, cm2 = pt.CostModel(one), pt.CostModel(two)
    assert cm2.X == pytest.approx([x / 2 + 1.0 for x in cm1.X])
    assert cm2.Y == pytest.approx([y / 2 + 0.5 for y in cm1.Y])
    assert cm2.U == pytest.approx([u / 2 for u in cm1.U])
    assert [cm1.device_updates(range(k)) for k in range(4)] == pytest.approx([0.0, 0.1, 0.2, 0.3])  # the Adam times
    # W=2: updates of 0.05 each; each chunk's gather (1 s) after its update and the one before;
    # the reduce-scatter of chunk 0, the last to finish backward (0.5 s), sticks out too.
    assert [cm2.device_updates(range(k)) for k in range(4)] == pytest.approx([0.0, 1.05 + 0.5, 2.05 + 0.5, 3.05 + 0.5])
    # All persistent: forward 6, backward 10, then the updates and what sticks out of them.
    assert rt(two, n_persist=3, n_buffer=0).total_s == pytest.approx(6 + 10 + 3.55)
    streamed = rt(two, n_persist=0, n_buffer=1)
    assert streamed.total_s > rt(one, n_persist=0, n_buffer=1).total_s  # the gathers are not hidden with one buffer
    # Measured in one process (world_size 1, no rates): nothing is added.
    assert pt.CostModel(dataclasses.replace(one, hardware=hw)).X == cm1.X
