"""CPU Adam of streamed chunks runs while backward is still going on (DESIGN §3)."""

import copy
import os
import time

import pytest
import torch

import protrain_core as pt
from conftest import (COMPARED_ACROSS_KERNELS_EPS, assert_same_weights, batches, tiny_gpt2, tiny_llama, train_engine,
                      train_reference)


def first_step(engine, x):
    """One step and zero_grad: an engine's first step holds its updates for a late clipping
    request ([Note: finishing gradients early]); the schedule under test comes after it."""
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    engine.zero_grad()


def _timeline(engine, x):
    rt = engine.scheduler
    rt.events.clear()
    rt.record_events = True
    loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss)
    backward_end = time.perf_counter()
    engine.step()
    engine.wait_for_updates()
    rt.record_events = False
    return list(rt.events), backward_end


@pytest.mark.parametrize("threaded", ["1", "0"])
def test_cpu_adam_starts_before_backward_ends_on_cpu(threaded, monkeypatch):
    """On the CPU too, streamed chunks are updated during backward (by the worker thread, or
    inline -- the CPU default, see [Note: CPU Adam on a CPU device]): the update of the last
    chunk begins before the first chunk's gradients are offloaded."""
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", threaded)
    model = tiny_llama(n_layer=6)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2), device="cpu")
    assert engine.overlap.startswith("cpu-adam-during-next-forward (first step")
    first_step(engine, batches(1)[0])
    assert engine.overlap == "cpu-adam-during-backward"
    events, backward_end = _timeline(engine, batches(1)[0])
    last = engine.layout.n_chunks - 1
    begin_last = next(t for what, c, t in events if what == "cpu_adam_begin" and c == last)
    offload_first = next(t for what, c, t in events if what == "offload" and c == 0)
    assert begin_last < offload_first < backward_end
    assert engine.scheduler.worker.threaded == (threaded == "1")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_threaded_cpu_adam_parity(precision, monkeypatch):
    """The worker-thread path (what CUDA uses) gives the same result as inline CPU Adam."""
    results = []
    for threaded in ("1", "0"):
        monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", threaded)
        torch.manual_seed(0)
        model = tiny_gpt2()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=2),
                         precision=precision, device="cpu",
                         config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
        results.append((train_engine(engine, batches(4)), engine.state_dict()))
    assert results[0][0] == results[1][0]
    for k, v in results[0][1].items():
        assert torch.equal(v, results[1][1][k]), k


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("persist", [0, 2])
def test_cuda_parity(precision, persist):
    model = tiny_gpt2()
    data = batches(10, device="cuda")
    eps = COMPARED_ACROSS_KERNELS_EPS
    if precision == "32-true":
        ref = copy.deepcopy(model).cuda()
        ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=eps, fused=True), data)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=eps), pt.Plan(n_persist=persist, n_buffer=2),
                     precision=precision, device="cuda",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = train_engine(engine, data)
    assert engine.memory.host_locked_bytes() > 0
    if precision == "32-true":
        # CPU fused Adam vs CUDA fused Adam may round differently: compare closely, not bitwise
        # (COMPARED_ACROSS_KERNELS_EPS: why the tolerance holds).
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        assert_same_weights(engine.state_dict(), ref, rtol=1e-5, atol=1e-6)
    else:
        assert losses[-1] < losses[0]


@pytest.mark.cuda
def test_cuda_cpu_adam_overlaps_backward():
    model = tiny_llama(n_layer=8)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2), device="cuda")
    x = batches(1, device="cuda", batch=8)[0]
    _timeline(engine, x)  # warm-up
    events, backward_end = _timeline(engine, x)
    begins = [t for what, c, t in events if what == "cpu_adam_begin"]
    assert begins and min(begins) < backward_end


def test_the_worker_thread_runs_on_its_placement_and_the_caller_keeps_its_threads():
    """[Note: CPU Adam threads]: the worker thread and its intra-op threads are bound to the
    placement's cores; the calling thread keeps its affinity and count (torchrun's
    OMP_NUM_THREADS=1)."""
    import os

    from protrain_core.runtime import device as dev
    from protrain_core.runtime.topology import Placement

    ctx = dev.DeviceContext(torch.device("cpu"))
    main, mine = torch.get_num_threads(), os.sched_getaffinity(0)
    worker = ctx.worker(threaded=True, placement=Placement((0,), 0, "the test's"))
    try:
        assert worker.submit(lambda: (os.sched_getaffinity(0), torch.get_num_threads())).result() == ({0}, 1)
    finally:
        worker.shutdown()
        assert torch.get_num_threads() == main and os.sched_getaffinity(0) == mine  # this thread's are its own ...
        torch.set_num_threads(main)  # ... but the count new threads start with is torch's global: restore it


def _probe_workers(monkeypatch, ctx) -> list:
    """(threads asked for, intra-op threads its jobs run with) of each CPU worker the hardware
    probe of ``ctx`` makes."""
    made, real = [], ctx.worker

    def worker(threaded, placement=None):
        pool = real(threaded, placement)
        made.append((placement and placement.threads, pool.submit(torch.get_num_threads).result()))
        return pool

    monkeypatch.setattr(ctx, "worker", worker)
    return made


def test_the_cpu_adam_probe_asks_for_the_engines_worker_placement(monkeypatch):
    """[Note: CPU Adam threads]: the profiler times CPU Adam on a worker placed as the engine's
    for the same number of processes (``cpu_worker_placement``), not on the process's own
    threads (torchrun's 1). On a CPU device the placement is None for both; here the decision is
    replaced to see that the probe asks it, with the world size it plans for; the engine's
    worker runs there and its pageable host states are first-touched there."""
    from protrain_core.profiler import hardware
    from protrain_core.runtime import engine as engine_module
    from protrain_core.runtime.device import DeviceContext
    from protrain_core.runtime.topology import Placement

    asked, touched = [], []

    class Touching(Placement):
        def touch(self, t):
            touched.append(t.numel())
            super().touch(t)

    def decided(ctx, world=1, cores=None):
        asked.append(world)
        return Touching((0,), 0, "the test's")

    monkeypatch.setattr(hardware, "cpu_worker_placement", decided)
    monkeypatch.setattr(engine_module, "cpu_worker_placement", decided)
    ctx = DeviceContext(torch.device("cpu"))
    made = _probe_workers(monkeypatch, ctx)
    hardware.probe_hardware(ctx, 4096, pt.Precision.FP32)
    assert asked == [1] and [threads for threads, _ in made] == [1]
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")  # the engine's threaded worker asks the same
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2),
                     device="cpu")
    try:
        assert asked == [1, 1] and "CPU worker: 1 thread on cores 0 of NUMA node 0 (the test's)" in engine.summary()
        assert engine.scheduler.worker.submit(lambda: os.sched_getaffinity(0)).result() == {0}
        streamed = [c for c in engine.chunks if not c.persistent]
        assert sorted(touched) == sorted(c.storage.pool.pageable_nbytes for c in streamed) and all(touched)
    finally:
        engine.close()


@pytest.mark.cuda
def test_the_cpu_adam_probe_runs_on_the_engines_worker_threads(monkeypatch):
    from protrain_core.profiler import hardware
    from protrain_core.runtime.device import DeviceContext
    from protrain_core.runtime.topology import worker_placement

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ctx = DeviceContext(torch.device("cuda"))
    made = _probe_workers(monkeypatch, ctx)
    hardware.probe_hardware(ctx, 2**16, pt.Precision.BF16_MIXED)
    n = worker_placement(1).threads
    assert made == [(n, n)]


def test_summary_says_where_the_cpu_adam_runs(monkeypatch):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=2), device="cpu")
    assert "CPU worker: inline" in engine.summary()
    engine.close()
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2), device="cpu")
    assert "CPU worker: the process's intra-op threads" in engine.summary()
    engine.close()


@pytest.mark.cuda
def test_cuda_worker_uses_the_cores_the_process_owns(monkeypatch):
    from protrain_core.runtime.topology import worker_placement

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2), device="cuda")
    n = engine.scheduler.worker.placement.threads
    assert n == worker_placement(1).threads and f"CPU worker: {n} thread" in engine.summary()
    assert engine.scheduler.worker.submit(torch.get_num_threads).result() == n
    engine.close()


# ----- a pass's placeholders ([Note: a pass's placeholders] in runtime/chunk.py) --------------------
def test_autograd_starts_a_second_accumulator_when_data_changes_type_between_two_uses():
    """The PyTorch behaviour the runtime works around: re-pointing ``.data`` at another dtype (or
    device, the same check) between two uses in one forward gives the parameter two gradient
    accumulators, each running its post-accumulate-grad hook; the same dtype keeps one."""
    for other, fired in ((torch.float64, 2), (torch.float32, 1)):
        w = torch.nn.Parameter(torch.ones(3))
        calls = []
        w.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
        y = (w * 2).sum()
        original = w.data
        w.data = torch.zeros(3, dtype=other)
        w.data = original
        (y + (w * 3).sum()).backward()
        assert len(calls) == fired, other


def test_chunks_released_inside_a_pass_point_at_device_placeholders_until_it_ends():
    """GPT-2's embedding is also its LM head: with every chunk streamed through 2 buffers, chunk 0
    is released between the two uses. From the forward to the end of its backward a released
    chunk's parameters are NaN of the device copy's dtype (not its host copy, which on a GPU is
    another device); each parameter's gradient arrives once; after backward they read their
    values at rest."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=0, n_buffer=2),
                     precision="bf16-mixed", device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    arrivals = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: arrivals.__setitem__(name, arrivals.get(name, 0) + 1))
    x = batches(1)[0]
    train_engine(engine, [x])  # a step: the layout of a later forward is the usual one
    arrivals.clear()
    fetches = engine.scheduler.stats["fetches"]
    loss = engine.module(input_ids=x, labels=x).loss
    assert engine.scheduler.stats["fetches"] - fetches > len(engine.chunks)  # chunk 0 came back for the LM head
    released = [c for c in engine.chunks if not c.device_resident]
    assert released
    for c in released:
        host = c.storage.host_copy.untyped_storage().data_ptr()
        assert c.at_placeholders
        for p in c.params:
            assert p.untyped_storage().data_ptr() != host and p.stride() == (0,) * p.dim()
            with torch._C.DisableTorchFunctionSubclass():  # (past the parameter's own __torch_function__)
                assert p.dtype == c.storage.device_copy.dtype and torch.isnan(p).all()
    # Used here by user code, a parameter brings its chunk back: its value, never the placeholder
    # ([Note: parameters used outside their units]); the backward is unchanged.
    assert not any(torch.isnan(p).any() for c in released for p in c.params)
    engine.backward(loss)
    assert arrivals == {name: 1 for name, p in model.named_parameters()}  # the tied weight once
    for c in engine.chunks:
        assert not c.at_placeholders
        if not c.device_resident:
            host = c.storage.host_copy.untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == host for p in c.params)
    engine.step()
    engine.zero_grad()
    assert not any(torch.isnan(p).any() for p in model.parameters())


def test_no_grad_forwards_release_chunks_to_rest():
    """Without gradients no graph can use a parameter again: released chunks point at rest at once."""
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=0, n_buffer=2),
                     device="cpu")
    x = batches(1)[0]
    with torch.no_grad():
        engine.module(input_ids=x)
    assert not any(c.at_placeholders for c in engine.chunks)
    assert not any(torch.isnan(p).any() for p in model.parameters())
