"""engine.offload_states() / onload_states() ([Note: parking] in runtime/parking.py): every device
byte of the training state goes to the host and comes back, between steps and between the
micro-batches of one step. Training with a round trip at every step equals plain PyTorch bit for
bit in fp32 and equals the same engine without round trips in the mixed modes."""

import copy
import dataclasses
import re
import gc

import pytest
import torch

import protrain_core as pt
from _background import background_run
from conftest import (MODELS, assert_same_runs, assert_same_weights, batches, n_chunks, standard_plans, train_engine,
                      train_reference)

CACHE_WARNING = "ignore:ProTrain. a key/value cache"


def _assert_offloaded(engine):
    """Nothing of the engine on the device: every chunk streamed and without a device copy or
    gradient buffer, the memory accounting at zero, no block kept in a CPU device's cache."""
    assert engine.memory.device_bytes() == 0
    assert engine.ctx.blocks is None or engine.ctx.blocks.nbytes == 0
    for c in engine.chunks:
        assert not c.persistent and not c.storage.device_copy_allocated and c.storage.grad_buffer is None, c


def _train(engine, data, *, round_trip, accumulate=1, non_blocking=False, offloaded=None):
    """Train on ``data``; with ``round_trip``, offload and onload before every micro-batch
    (``offloaded(engine, handle)`` checks what is left in between) and after every step."""
    if not round_trip:
        return train_engine(engine, data, accumulate=accumulate)
    offloaded = offloaded or (lambda engine, handle: _assert_offloaded(engine))

    def before_micro_batch(engine):
        offloaded(engine, engine.offload_states(non_blocking=non_blocking))
        engine.onload_states()

    def after_step(engine):  # after the step, before zero_grad: the gradients travel too
        engine.offload_states()
        engine.onload_states()

    return train_engine(engine, data, accumulate=accumulate, before_micro_batch=before_micro_batch,
                        after_step=after_step)


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_round_trip_at_every_step_equals_plain_pytorch(arch, plan_name):
    model = MODELS[arch]()
    ref = copy.deepcopy(model)
    data = batches(6)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True), data)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                     standard_plans(model)[plan_name], device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    persistent = {c.index for c in engine.chunks if c.persistent}
    assert _train(engine, data, round_trip=True, non_blocking=plan_name == "mixed-buf2") == ref_losses
    assert {c.index for c in engine.chunks if c.persistent} == persistent == engine.plan.persistent()
    assert_same_weights(engine.state_dict(), ref)
    assert engine.states.optimizer()["state"].keys() == set(range(len(list(ref.parameters()))))


def test_a_round_trip_between_micro_batches_keeps_the_accumulated_gradients():
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    data = batches(8)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data, accumulate=2)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=2, n_buffer=1),
                     device="cpu")
    losses = _train(engine, data, round_trip=True, accumulate=2)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)  # the printed sum's order only
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_a_round_trip_does_not_change_a_bit_in_low_precision(precision):
    """Against the same engine without round trips: masters, moments, step counters and the
    loss scaler come back unchanged, with a frozen embedding in a persistent chunk."""
    data = batches(5)
    runs = []
    for round_trip in (False, True):
        model = MODELS["llama"]()
        model.get_input_embeddings().weight.requires_grad_(False)
        if precision == "bf16-true":
            model = model.to(torch.bfloat16)
        n = n_chunks(model)
        engine = pt.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3),
                         pt.Plan(n_persist=n - 1, n_buffer=1, n_checkpoint=1), precision=precision, device="cpu")
        losses = _train(engine, data, round_trip=round_trip)
        runs.append((losses, engine.state_dict(), engine.states.optimizer(), engine.states.scaler()))
    assert_same_runs(*runs)


def test_states_can_be_read_and_written_while_offloaded():
    """The state dicts read the host copies; a loaded state dict goes to the device with them."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=2, n_buffer=1),
                     device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    before, osd = engine.state_dict(), engine.states.optimizer()
    engine.offload_states()
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.states.optimizer()["state"][0]["exp_avg"].equal(osd["state"][0]["exp_avg"])
    changed = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in before.items()}
    engine.load_state_dict(changed)
    engine.onload_states()
    assert all(torch.equal(v, changed[k]) for k, v in engine.state_dict().items())
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())


def test_the_model_cannot_run_while_offloaded_and_a_step_cannot_be_offloaded():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=1),
                     device="cpu")
    x = batches(1)[0]
    for _ in range(2):  # the second step updates the streamed chunks during backward
        loss = engine.module(input_ids=x, labels=x).loss
        with pytest.raises(RuntimeError, match="within a step; call it after engine.step"):
            engine.offload_states()  # between a forward and its backward: autograd holds the device copies
        engine.backward(loss)
        if any(c.applied for c in engine.chunks):
            with pytest.raises(RuntimeError, match="within a step"):
                engine.offload_states()  # streamed chunks were updated, the persistent ones wait for step()
        engine.step()
        engine.zero_grad()
    assert "during-backward" in engine.overlap
    handle = engine.offload_states()
    assert engine.offload_states() is handle  # offloading twice is once
    calls = []
    model.transformer.h[0].register_forward_pre_hook(lambda *a: calls.append(1))
    for run in (lambda: engine.module(input_ids=x, labels=x), engine.step,
                lambda: engine.replan(pt.Plan(n_persist=0, n_buffer=1))):
        with pytest.raises(RuntimeError, match=r"engine.onload_states\(\) first"):
            run()
    assert calls == []  # refused before any of the model ran
    engine.onload_states()
    engine.onload_states()  # nothing to do
    engine.module(input_ids=x, labels=x)
    assert calls == [1]


def test_a_second_round_trip_allocates_no_host_memory():
    """The persistent chunks keep the host buffers they were offloaded to."""
    model = MODELS["gpt2"]()
    n = n_chunks(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=n, n_buffer=0),
                     device="cpu")
    assert engine.memory.host_bytes() == 0
    engine.offload_states()
    parked = engine.memory.host_bytes()
    pools = [c.storage.pool for c in engine.chunks]
    assert parked == sum(c.storage.fmt.streamed_host_bytes for c in engine.chunks) > 0
    engine.onload_states()
    assert engine.memory.host_bytes() == parked  # kept, and counted
    engine.offload_states()
    assert [c.storage.pool for c in engine.chunks] == pools  # the same buffers, nothing new
    engine.onload_states()


def test_a_non_blocking_offload_copies_on_the_device_to_host_stream():
    """On the simulated GPU every byte goes over the device-to-host link, after the host has
    returned; ``wait()`` blocks the host until the last copy ends; state reads wait too."""
    from protrain_core.simulator import SimulatedDevice

    model = MODELS["gpt2"]()
    n = n_chunks(model)
    with SimulatedDevice("h100", tensors="cpu") as sim:
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=n, n_buffer=0),
                         device=sim)
        x = batches(1)[0]
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        sim.synchronize_device()
        sim.records.reset()
        handle = engine.offload_states(non_blocking=True)
        issued = sim.main.t
        copies = [w for w in sim.records.work if w.kind == "copy"]
        assert {w.label for w in copies} == {"device->host"} and {w.lane for w in copies} == {sim.d2h_stream.name}
        assert sum(w.nbytes for w in copies) == handle.copied_bytes > sum(
            c.storage.fmt.persistent_device_bytes for c in engine.chunks) // 2
        assert not handle.done() and max(w.end for w in copies) > issued
        engine.state_dict()  # waits for the copies before reading the host tensors
        assert sim.main.t >= max(w.end for w in copies) and handle.done()
        handle.wait()
        engine.onload_states()
        engine.close()


def _two_process_round_trips(rank, world):
    """Per plan and precision: (losses, state dict) with and without a round trip at every step
    (and between micro-batches), sharded over ``world`` gloo processes."""
    out = []
    for plan_name, precision in (("all-persistent", "32-true"), ("mixed-buf2", "32-true"), ("mixed-buf2", "bf16-mixed")):
        runs = []
        for round_trip in (False, True):
            model = MODELS["gpt2"]()
            model.get_input_embeddings().weight.requires_grad_(False)
            engine = pt.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3),
                             standard_plans(model)[plan_name], precision=precision, device="cpu")
            assert engine.world_size == world
            losses = _train(engine, batches(6, seed=30 + rank), round_trip=round_trip, accumulate=2)
            runs.append((losses, engine.state_dict(), engine.states.optimizer()))
        out.append(runs)
    return out


def test_round_trips_on_two_processes_change_nothing(tmp_path):
    from _distributed import spawn

    for rank, cases in enumerate(spawn(_two_process_round_trips, 2, tmp_path)):
        for without, with_trips in cases:
            if rank == 0:  # rank0_only state dicts
                assert_same_runs(without, with_trips)
            else:
                assert without[0] == with_trips[0]


@pytest.mark.cuda
@pytest.mark.parametrize("non_blocking", [False, True])
def test_on_cuda_an_offloaded_engine_holds_no_device_memory_and_trains_on_exactly(non_blocking):
    """The allocator's own count: after the offload (and ``wait()``) the device holds what it
    held before the engine existed, within 64 KiB (the batches, small scalars; the plan keeps
    about 360 KiB of model states on the device); the reserved memory is given back but for a
    few small-block segments; training continues bitwise."""
    runs = []
    for round_trip in (False, True):
        gc.collect()  # the previous round's engine and model (reference cycles hold their device tensors)
        torch.cuda.empty_cache()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        model = MODELS["gpt2"]()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=2, n_buffer=1,
                                                                                         n_swap=1),
                         precision="bf16-mixed", device="cuda")
        assert engine.memory.device_bound() > 4 * 2**16  # what the plan keeps on the device: something to offload

        def offloaded(engine, handle, base=base, base_reserved=base_reserved):
            handle.wait()
            assert torch.cuda.memory_allocated() - base < 2**16
            assert torch.cuda.memory_reserved() - base_reserved <= 4 * 2**21

        losses = _train(engine, batches(4, device="cuda"), round_trip=round_trip, non_blocking=non_blocking,
                        offloaded=offloaded)
        runs.append((losses, engine.state_dict()))
        engine.close()
        del engine, model
    (l0, sd0), (l1, sd1) = runs
    assert l0 == l1 and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


def test_the_colocation_example_learns_with_the_engine_offloaded_while_generating():
    """examples/rl_colocation.py on the CPU: generation from an exported copy while the engine
    holds nothing on the device (the example asserts it), REINFORCE steps after onloading; the
    reward rises."""
    from examples.rl_colocation import main

    rounds = main(["--rounds", "12"])
    rewards = [r["reward"] for r in rounds]
    assert len(rounds) == 12 and all(r["generation_device_bytes"] < r["training_device_bytes"] for r in rounds)
    assert sum(rewards[-3:]) > 2 * sum(rewards[:3])


# ----- host memory that matches the plan ---------------------------------------------------------
def test_a_plan_over_the_host_budget_is_refused_before_anything_is_allocated(monkeypatch):
    """On a (simulated) GPU whose host has less RAM than the streamed chunks' states: the given
    plan is refused with the numbers, before a chunk or host buffer exists; a plan that keeps
    enough chunks on the device is built."""
    import dataclasses

    from protrain_core.runtime import host_pool
    from protrain_core.simulator import H100, SimulatedDevice

    pools = []
    monkeypatch.setattr(host_pool.HostPool, "__init__", lambda self, *a, _init=host_pool.HostPool.__init__, **k:
                        (pools.append(1), _init(self, *a, **k))[1])
    model = MODELS["gpt2"]()
    n = n_chunks(model)
    states = sum(p.numel() for p in model.parameters()) * 16  # fp32 weights, gradients, two moments
    with SimulatedDevice(dataclasses.replace(H100, host_memory_bytes=states // 2), tensors="cpu") as sim:
        with pytest.raises(MemoryError, match=r"keeps .* of model states in host memory .* over its host budget of "
                                              r"[0-9.]+ KiB .*larger n_persist.*nothing was allocated"):
            pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=1), device=sim)
        assert pools == [] and getattr(model, "_protrain_engine", None) is None
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=n - 1, n_buffer=1),
                         device=sim)
        assert 0 < engine.memory.host_bytes() <= states // 2 * 0.9
        engine.close()


def test_the_explanation_lists_every_host_byte_the_plan_allocates():
    """Chunk states, swap buffers (with their size-class rounding) and the fp32 staging, summed."""
    from protrain_core.planner.cost import CostModel

    model = MODELS["gpt2"]()
    x = batches(1)[0]
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
                     example_inputs={"input_ids": x, "labels": x}, report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="3MiB", profile_cache=False)))
    plan = pt.Plan(n_persist=1, n_buffer=2, n_swap=2)
    m = CostModel(engine.choice.profile).memory(plan)
    streamed = sum(c.storage.fmt.streamed_host_bytes for c in engine.chunks if c.index not in plan.persistent())
    largest = max(c.storage.fmt.state_numel for c in engine.chunks if c.index not in plan.persistent())
    assert m.host_bytes - m.swap_host_bytes == streamed and m.swap_host_bytes > 0
    assert m.staging_host_bytes == 2 * largest * 4  # fp32: the worker's two staging buffers
    assert m.planned_host_bytes == m.host_bytes + m.swap_host_bytes // 8 + m.staging_host_bytes
    assert "host memory" in engine.explain() and "chunk states" in engine.explain()
    # The page-locked part (issue 54, item 2): fp32 locks the host copy and the accumulator the
    # gradients land in, 8 of 16 bytes per parameter; nothing is registered on a CPU (no rate),
    # a measured rate predicts wrap's registration time.
    pinned = sum(c.storage.fmt.streamed_pinned_bytes for c in engine.chunks if c.index not in plan.persistent())
    assert m.pinned_host_bytes == pinned == streamed // 2 and m.page_lock_s == 0.0
    hw = dataclasses.replace(engine.choice.profile.hardware, page_lock_bytes_per_s=8e9)
    on_gpu = CostModel(dataclasses.replace(engine.choice.profile, hardware=hw)).memory(plan)
    assert on_gpu.page_lock_s == pytest.approx(pinned / 8e9)
    from protrain_core.planner.search import _host_line
    assert re.search(r"chunk states [0-9.]+ [KM]iB \([0-9.]+ KiB page-locked, locked at wrap in [0-9.]+ us "
                     r"\(predicted\)\)", _host_line(on_gpu, None))


def _rss_runs(cases: str, world: int = 1, env=None) -> list[dict]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(env or os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "tests" / "scripts" / "host_rss.py"), cases, str(world)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@background_run("peak-rss")
def _peak_rss(folder, env, results):
    return _rss_runs("streamed,lora", 1, env)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="reads Linux's /proc")
# Two processes (14 s) with -m "slow or not slow"; test_round_trips_on_two_processes_change_nothing stays in CI.
@pytest.mark.parametrize("cases,world", [pytest.param("streamed,lora", 1, marks=pytest.mark.background("peak-rss")),
                                         pytest.param("two-processes", 2, marks=pytest.mark.slow)])
def test_peak_resident_memory_stays_within_the_plan(cases, world, background):
    """Issue 30: the peak resident size over steady steps is at most 1.10x the plan's bytes plus
    the process before ``wrap`` (on a CPU device the plan's bytes are its host bytes and its
    predicted device peak: the same RAM), for a plan that streams chunks and swaps
    activations, a LoRA model and each of 2 processes; the chunk states' host memory is the
    plan's to the byte."""
    runs = background if background is not None else _rss_runs(cases, world)
    assert len(runs) == len(cases.split(",")) * world
    for r in runs:
        planned = r["planned_host"] + r["planned_device"]
        assert r["peak"] <= 1.10 * (planned + r["baseline"]), r
        assert r["host_allocated"] == r["planned_states"], r
    assert any(r["planned_states"] > 0 for r in runs)  # some chunks stream
