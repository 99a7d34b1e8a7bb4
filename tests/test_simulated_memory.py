"""The simulated device's memory ([Note: simulated device memory] in protrain_core/simulator/memory.py):
allocations counted as the caching allocator counts them, host memory left out, stream-ordered
frees, chunk buffers freed and re-allocated in place, the allocator's wait and an out-of-memory
error past the device, the profiled engine's memory gone before the training engine is built and
profiling that runs out of memory; and the host's launch queue."""

import dataclasses
import gc
import warnings
import weakref

import pytest
import torch

from benchmarks.bench_simulator import PLANS, Runner
import protrain_core as pt
from protrain_core import models
from protrain_core.api import default_memory_budget
from protrain_core.memtrack import on_host
from protrain_core.precision import parse_precision
from protrain_core.profiler.profiler import profile_model
from protrain_core.runtime.storage import chunk_formats
from protrain_core.simulator.device import LAUNCH_QUEUE_FULL, SimulatedDevice
from protrain_core.simulator.hardware import load_spec
from protrain_core.simulator.memory import ALLOCATOR_WAIT
from protrain_core.simulator.run import simulate
from protrain_core.structure.blocks import find_blocks
from protrain_core.structure.layout import build_layout
from protrain_core.structure.trace import trace

MiB = 2**20


def empty(n_floats: int) -> torch.Tensor:
    return torch.empty(n_floats, device="meta")


def upload(sim: SimulatedDevice, n_floats: int):
    """(a host buffer, a device buffer, the event of its upload on the h2d stream), the device
    buffer recorded on that stream, as the runtime hands a streamed chunk's buffer to it."""
    with on_host():
        host = empty(n_floats)
    buf = empty(n_floats)
    event = sim.copy_async(buf, host, stream=sim.h2d_stream, span=("host->device", "upload"))
    sim.record_stream(buf, sim.h2d_stream)
    return host, buf, event


def test_device_memory_counts_new_storages_in_whole_blocks():
    sim = SimulatedDevice("h100")
    with sim:
        a = empty(1000)  # 4,000 bytes: 4,096 in blocks of 512
        assert sim.memory.live == 4096
        b = a + 1  # a new storage
        view = a[10:]  # views and in-place operators allocate nothing
        a.add_(1)
        assert sim.memory.live == 8192
        del a, view
        assert sim.memory.live == 4096  # freed with its last tensor
        del b
        assert sim.memory.live == 0 and sim.memory.peak == 8192
        c = empty(128)
        sim.memory.reset_peak()
        assert sim.memory.peak == 512
        del c


def test_host_memory_is_not_the_devices():
    sim = SimulatedDevice("h100")
    with sim:
        with on_host():
            host = empty(MiB)
        doubled = host * 2  # an operator on host tensors only: host memory
        job = sim.worker(True).submit(lambda: empty(MiB) + 1)  # the CPU worker's allocations
        assert job.result().shape == (MiB,)
        assert sim.memory.live == 0
        dev = empty(MiB) + host  # the device's (the sum, and the operand until it is freed)
        assert sim.memory.live == 4 * MiB and sim.memory.peak == 2 * 4 * MiB
        del doubled, dev


def test_a_stream_ordered_free_returns_its_memory_once_the_streams_work_has_ended():
    sim = SimulatedDevice("h100")
    with sim:
        _, buf, event = upload(sim, 64 * MiB)
        del buf
        assert event.time > sim.main.t  # the upload is still queued when its buffer is freed ...
        assert sim.memory.live == 256 * MiB  # ... so the allocator keeps the block
        early = empty(128)
        assert sim.memory.live == 256 * MiB + 512  # an allocation before the upload ends: still held
        sim.synchronize(event)
        late = empty(128)  # the allocator finds the upload over: the block is free again
        assert sim.memory.live == 1024 and sim.memory.peak == 256 * MiB + 512
        del early, late


def test_a_chunk_buffer_freed_and_allocated_in_place_is_counted():
    sim = SimulatedDevice(dataclasses.replace(load_spec("h100"), device_memory_bytes=8 * MiB))
    with sim:
        buf = empty(MiB)
        sim.resize(buf.untyped_storage(), 0)
        assert sim.memory.live == 0
        other = empty(MiB)
        sim.resize(buf.untyped_storage(), 4 * MiB)
        assert sim.memory.live == 8 * MiB
        sim.resize(buf.untyped_storage(), 0)
        with pytest.raises(torch.OutOfMemoryError, match="Simulated out of memory"):
            empty(MiB + 1)  # 4 MiB + a block over the 8 MiB device
        del other
        assert sim.memory.live == 0


def test_an_allocation_beyond_the_device_raises_out_of_memory_unless_only_counted():
    small = dataclasses.replace(load_spec("h100"), device_memory_bytes=MiB)
    with SimulatedDevice(small) as sim:
        whole = empty(MiB // 4)  # exactly the device
        with pytest.raises(torch.OutOfMemoryError, match=r"allocating 512 B with 1.00 MiB of 1.00 MiB allocated: the plan does not fit"):
            empty(1)
        del whole
    with SimulatedDevice(small, out_of_memory=False) as sim:
        kept = [empty(MiB // 4) for _ in range(3)]
        assert sim.memory.peak == 3 * MiB
        del kept


@pytest.mark.parametrize("tensors", ["meta", "cpu"])
def test_the_execution_order_is_traced_beside_a_device_smaller_than_the_model(tensors):
    """The trace's meta tensors are no memory: a simulated device too small for the model's
    parameters (the case ProTrain exists for) traced nothing and warned that it fell back to the
    registration order, blaming an out-of-memory the trace cannot cause."""
    model = models.build(models.load_config("tiny-gpt2"), "meta" if tensors == "meta" else "cpu")[0]
    small = dataclasses.replace(load_spec("h100"), device_memory_bytes=MiB)
    with SimulatedDevice(small, tensors=tensors), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trace(model, find_blocks(model)[0]).source == "traced"


def test_simulate_refuses_a_model_on_the_host_with_the_fix():
    """The documented ``simulate(model, optimizer, batch, device=SimulatedDevice("h100"))`` of a
    model built on the host ended deep in the engine (``set_data``: incompatible tensor type)."""
    model = models.build(models.load_config("tiny-gpt2"), "cpu")[0]
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"size-only simulation: build the model on the meta device"):
        simulate(model, torch.optim.AdamW(model.parameters()), {"input_ids": x, "labels": x},
                 device=SimulatedDevice("h100"))


def test_profiling_leaves_on_the_device_only_what_the_models_parameters_point_at():
    """The profiling engine is closed and collected before the training engine is built: its
    chunks, hooks and the activations the profiler kept hold each other in reference cycles
    (once, 37 of the 78 GiB of a simulated H100 during LLaMA-7B's training steps)."""
    config = models.load_config("llama-1b")
    model, opt = models.build(config, "meta")
    batch = models.token_batch(config, 2, 256, "meta")
    block_path, blocks = find_blocks(model)
    layout = build_layout(model, block_path, len(blocks))
    sim = SimulatedDevice("h100")
    with sim:
        precision = parse_precision("bf16-mixed")
        profile_model(model, opt, layout, example_inputs=batch, precision=precision, device=sim, iterations=1,
                      cache=False, formats=chunk_formats(model, opt, layout, precision, pt.ProTrainConfig()))
        assert sim.memory.live > 0  # the persistent chunks' values, the parameters' now
        for p in model.parameters():
            p.data = torch.empty(0, device="meta")
        assert sim.memory.live == 0


@pytest.fixture(scope="module")
def llama7b():
    return Runner("h100", batch=32)


def test_the_searched_plan_fits_the_simulated_device_and_the_cost_model_bounds_its_memory(llama7b):
    result = llama7b.run(None)
    budget = default_memory_budget(SimulatedDevice("h100"))
    assert result.device_peak_bytes <= budget, result.text()
    # The cost model's peak is what the search holds to the budget: within 10 % of the simulated one.
    assert abs(result.memory.peak_bytes / result.device_peak_bytes - 1) <= 0.10, result.text()
    assert "simulated device memory: peak" in result.text()


def test_a_plan_that_does_not_fit_the_simulated_device_ends_in_out_of_memory(llama7b):
    llama7b.run("checkpoint")  # the profile, taken with the memory only counted
    with pytest.raises(torch.OutOfMemoryError, match="Simulated out of memory on simulated NVIDIA H100"):
        simulate(llama7b.model, llama7b.optimizer, llama7b.batch, device=SimulatedDevice("h100"),
                 plan=PLANS["streamed-buf2"], profile=llama7b.profiles[("bf16-mixed", 1)])


def _llama_1b_on(device_gib: int, batch: int):
    config = models.load_config("llama-1b")  # Llama 3.2 1B's shape: 3 chunks, a vocabulary of 128,256
    model, opt = models.build(config, "meta")
    spec = dataclasses.replace(load_spec("h100"), device_memory_bytes=device_gib * 2**30)
    return model, opt, models.token_batch(config, batch, 1024, "meta"), SimulatedDevice(spec)


def test_profiling_runs_out_of_device_memory_then_profiles_again_with_fewer_persistent_chunks():
    """On 28 GiB the safe plan keeps all 3 chunks (12 GiB of parameters, masters and gradients)
    beside 8 x 1024 tokens' logits and loss (about 4 GiB a tensor), which do not fit: profiled
    again with every chunk streamed, and the searched plan trains within the device. Once the
    result is dropped, the simulated device (with the engines and records it held) is freed, the
    model still alive: each storage's free callback holds the device's memory weakly (held
    strongly, the finalizer registry kept every simulated device and engine alive: 2 million
    objects after the simulator's tests)."""
    model, opt, batch, sim = _llama_1b_on(28, 8)
    result = simulate(model, opt, batch, device=sim)
    assert result.device_peak_bytes <= sim.spec.device_memory_bytes, result.text()
    device = weakref.ref(sim)
    del sim, result
    gc.collect()
    assert device() is None


def test_a_batch_whose_activations_fit_no_profiling_plan_is_refused_with_the_fix():
    model, opt, batch, sim = _llama_1b_on(16, 8)
    with pytest.raises(torch.OutOfMemoryError, match="every chunk streamed and every block checkpointed.*smaller batch"):
        simulate(model, opt, batch, device=sim)


def test_the_host_waits_when_a_streams_launch_queue_is_full():
    spec = dataclasses.replace(load_spec("h100"), launch_queue=2)
    with SimulatedDevice(spec) as sim:
        a = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
        ends = []
        for _ in range(4):
            a @ a  # 137 GFLOP: about 0.17 ms each, far longer than their 5 us of issue
            ends.append(sim.compute.t)
        queue_waits = [w for w in sim.records.waits if w.label == LAUNCH_QUEUE_FULL]
        # The third and fourth issues each wait for the oldest of the two queued to finish.
        assert [w.end for w in queue_waits] == ends[:2]
        assert sim.main.t >= ends[1] and sim.main.t < ends[2]


def test_a_chunk_buffer_allocated_again_frees_without_the_streams_of_its_last_life():
    sim = SimulatedDevice("h100")
    with sim:
        host, buf, uploaded = upload(sim, 64 * MiB)
        sim.resize(buf.untyped_storage(), 0)
        assert sim.memory.live == 256 * MiB  # freed in stream order: the upload still reads it
        sim.synchronize(uploaded)
        sim.resize(buf.untyped_storage(), 256 * MiB)  # allocated again (the finished free returned first)
        assert sim.memory.live == 256 * MiB
        other = empty(64 * MiB)
        sim.copy_async(other, host, stream=sim.h2d_stream, span=("host->device", "another upload"))  # h2d busy again
        sim.resize(buf.untyped_storage(), 0)
        assert sim.memory.live == 256 * MiB  # only `other`: no stream is recorded on this allocation of buf
        del other


def test_an_allocation_the_device_cannot_hold_waits_for_the_stream_ordered_frees_first():
    """The caching allocator, out of memory, synchronizes and frees the blocks whose side-stream
    work was pending before it gives up: a host wait, then the allocation."""
    sim = SimulatedDevice(dataclasses.replace(load_spec("h100"), device_memory_bytes=6 * MiB))
    with sim:
        _, buf, uploaded = upload(sim, MiB)  # 4 MiB
        del buf
        assert sim.main.t < uploaded.time and sim.memory.live == 4 * MiB
        bigger = empty(MiB // 2 + 1)  # 2 MiB + a block: fits only once the upload's buffer is back
        (wait,) = [w for w in sim.records.waits if w.label == ALLOCATOR_WAIT]
        assert wait.end == uploaded.time and sim.main.t >= uploaded.time
        assert sim.memory.live == 2 * MiB + 512
        del bigger
