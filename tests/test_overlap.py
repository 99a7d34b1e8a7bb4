"""CPU Adam of streamed chunks runs while backward is still going on (DESIGN §3)."""

import copy
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
    assert engine.scheduler.threaded == (threaded == "1")


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


def test_cpu_worker_threads_follow_the_cores_the_process_owns(monkeypatch):
    """[Note: CPU Adam threads]: the worker's share is the process's CPU affinity when a launcher
    bound it, else the machine's cores over the node's processes, minus one for the thread that
    drives the device; its jobs run with that many intra-op threads while the calling thread
    keeps its own count (torchrun's OMP_NUM_THREADS=1)."""
    import os

    from protrain_core.runtime import device as dev

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert dev.worker_threads(1)[0] == 15 and dev.worker_threads(2)[0] == 7 and dev.worker_threads(32)[0] == 1
    assert "16 cores / 2 processes" in dev.worker_threads(2)[1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    assert dev.worker_threads(2) == (3, "4 cores this process is bound to, one left for the thread that drives the device")
    monkeypatch.undo()
    ctx = dev.DeviceContext(torch.device("cpu"))
    main = torch.get_num_threads()
    worker = ctx.worker(threaded=True, threads=1 if main > 1 else 2)
    try:
        assert worker.submit(torch.get_num_threads).result() == (1 if main > 1 else 2)
    finally:
        worker.shutdown()
        assert torch.get_num_threads() == main  # this thread's count is its own ...
        torch.set_num_threads(main)  # ... but the count new threads start with is torch's global: restore it


def _probe_workers(monkeypatch, ctx) -> list:
    """(threads asked for, intra-op threads its jobs run with) of each CPU worker the hardware
    probe of ``ctx`` makes."""
    made, real = [], ctx.worker

    def worker(threaded, threads=None):
        pool = real(threaded, threads)
        made.append((threads, pool.submit(torch.get_num_threads).result()))
        return pool

    monkeypatch.setattr(ctx, "worker", worker)
    return made


def test_the_cpu_adam_probe_asks_for_the_engines_worker_threads(monkeypatch):
    """[Note: CPU Adam threads]: the profiler times CPU Adam on a worker with the engine's thread
    count for the same number of processes (``cpu_worker_threads``), not on the process's own
    count (torchrun's 1). On a CPU device the count is None for both; here the decision is
    replaced to see that the probe asks it, with the world size it plans for."""
    from protrain_core.profiler import hardware
    from protrain_core.runtime import worker as worker_module
    from protrain_core.runtime.device import DeviceContext

    asked = []

    def decided(ctx, world=1):
        asked.append(world)
        return 1, "one thread (the test's)"

    monkeypatch.setattr(hardware, "cpu_worker_threads", decided)
    monkeypatch.setattr(worker_module, "cpu_worker_threads", decided)
    ctx = DeviceContext(torch.device("cpu"))
    made = _probe_workers(monkeypatch, ctx)
    hardware.probe_hardware(ctx, 4096, pt.Precision.FP32)
    assert asked == [1] and [threads for threads, _ in made] == [1]
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")  # the engine's threaded worker asks the same
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2),
                     device="cpu")
    try:
        assert asked == [1, 1] and "CPU worker: 1 thread (one thread (the test's))" in engine.summary()
    finally:
        engine.close()


@pytest.mark.cuda
def test_the_cpu_adam_probe_runs_on_the_engines_worker_threads(monkeypatch):
    from protrain_core.profiler import hardware
    from protrain_core.runtime.device import DeviceContext, worker_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ctx = DeviceContext(torch.device("cuda"))
    made = _probe_workers(monkeypatch, ctx)
    hardware.probe_hardware(ctx, 2**16, pt.Precision.BF16_MIXED)
    assert made == [(worker_threads(1)[0], worker_threads(1)[0])]


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
    from protrain_core.runtime.device import worker_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    model = tiny_gpt2()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2), device="cuda")
    n = engine.scheduler.worker.threads
    assert n == worker_threads(1)[0] and f"CPU worker: {n} thread" in engine.summary()
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
