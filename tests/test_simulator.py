"""The simulated device (protrain_core/simulator): the runtime's CUDA code path on CPU or meta
tensors, timed by a model of an H100 ([Note: the simulated device]).

The contract a GPU needs from the runtime, checked on a LLaMA-7B-shaped model on the meta device
with the H100 preset, for plans from all-persistent to all-streamed with swapped and
checkpointed blocks, with and without norm clipping, in bf16-mixed and 16-mixed
(benchmarks/bench_simulator.py prints the same runs):
- no host wait on the thread that drives the device during backward but the named ones
  (``BACKWARD_HOST_WAITS``, [Note: host waits] in runtime/device.py);
- host->device and device->host copies overlap in backward when the plan streams;
- without clipping (bf16-mixed), at least 90 % of the CPU Adam time falls inside backward
  where the CPU keeps up with backward;
- the simulated step is within 10 % of the cost model's prediction;
- sharded over 2 and 4 simulated ranks: collectives run on the communication stream, and the
  compute stream waits during backward for all-gathers only (a fetched chunk's).
Small real tensors through the same path train bitwise like plain PyTorch in fp32.
"""

import copy

import pytest
import torch

import protrain_core as pt
from benchmarks.bench_simulator import PLANS, SHARDED, VARIANTS, Runner, unnamed_backward_waits
from conftest import batches, standard_plans, tiny_gpt2, train_engine, train_reference
from protrain_core.simulator.device import SimulatedDevice


@pytest.fixture(scope="module")
def llama7b():
    return Runner("h100", batch=32, seq=2048)  # tokens at which the H100 host's CPU Adam keeps pace with backward


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("plan", list(PLANS))
def test_gpu_contract_on_a_simulated_h100(llama7b, plan, variant):
    result = llama7b.run(plan, variant)
    r, summary = result.report, result.text()
    assert unnamed_backward_waits(result) == [], summary
    if PLANS[plan].n_persist < 34:
        shorter = min(r.copy_busy_backward_s.values())
        assert shorter > 0 and r.duplex_backward_s >= 0.5 * shorter, summary
    if variant == "bf16" and r.cpu_adam_s and r.cpu_adam_s <= r.backward_s:
        assert r.cpu_adam_inside_backward >= 0.9, summary
    assert abs(result.error) <= 0.10, summary


@pytest.mark.parametrize("plan, world", SHARDED)
def test_sharded_collectives_stay_off_the_compute_stream(llama7b, plan, world):
    result = llama7b.run(plan, "bf16", world)
    r, summary = result.report, result.text()
    assert set(r.collectives) == {"comm"}, summary  # none on the compute stream
    # The compute stream waits for a chunk's all-gather before using it (a fetch), for nothing
    # else during backward: the reduce-scatters are waited for once, after it.
    assert r.waits_for_backward_s("reduce-scatter", "all-reduce") == 0, summary
    assert unnamed_backward_waits(result) == [], summary
    assert abs(result.error) <= 0.10, summary


@pytest.mark.parametrize("name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
def test_simulated_path_trains_bitwise_like_pytorch(name):
    """Small real tensors through the simulated device's asynchronous path (streams, events,
    the CPU worker on its simulated thread): the same losses and weights as plain PyTorch."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    data = batches(4)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data)
    sim = SimulatedDevice("h100", tensors="cpu")
    with sim:
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), standard_plans(model)[name], device=sim,
                         check_invariants=True)
        assert engine.runtime.threaded  # the GPU's path: the worker on its own (simulated) thread
        losses = train_engine(engine, data)
    assert losses == ref_losses
    state = engine.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k
    assert sim.records.work and sim.compute.t > 0  # it was timed
