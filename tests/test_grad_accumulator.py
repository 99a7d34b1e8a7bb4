"""Issue 31: streamed chunks without an fp32 gradient accumulator
(``ProTrainConfig(grad_accumulator=False)``, [Note: gradients consumed where they land] in
protrain_core/runtime/worker.py). The run is the one with accumulators bit for bit (every state
format, plan and worker mode; clipping by value; chunks spilled before all their gradients came);
the host holds 4 bytes per trainable parameter less, as the planner counts; the Trainer chooses
it where its settings allow; and what needs an accumulator is refused with the fix."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import protrain_core as pt
from conftest import assert_same_runs, batches, standard_plans, tiny_gpt2, train_engine
from protrain_core.runtime.host_pool import HostPool
from protrain_core.runtime.storage import ChunkStorage

LR, WD = 1e-2, 0.1


def engine_for(model, accumulator, plan, fmt="fp32", precision="bf16-mixed", thread=False, **config):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    runtime = {"check_invariants": True, "cpu_adam_thread": thread}
    engine = pt.wrap(model, opt, plan=plan, precision=precision, device="cpu",
                     config=pt.ProTrainConfig(optimizer_state_format=fmt, grad_accumulator=accumulator,
                                              runtime=runtime, **config))
    if accumulator is not False:
        engine.clipping.expect_late(False)  # the same schedule: no step held for a late clipping request
    return engine


def run(engine, data):
    losses = train_engine(engine, data)
    return losses, engine.state_dict(), engine.states.optimizer()


def streamed_host_bytes(engine):
    """What the streamed chunks' pools hold, from their formats."""
    meta = torch.device("meta")
    return sum(HostPool(c.storage.fmt.host_tensors(), pin=False, device=meta).nbytes for c in engine.chunks
               if not c.persistent)


@pytest.mark.parametrize("fmt, plan_name, thread, clipping, frozen", [
    ("fp32", "streamed-buf1", False, None, None),
    ("fp32", "mixed-buf2", True, ("value", 0.01), None),
    ("bf16", "swap-checkpoint", False, None, None),
    ("8bit", "streamed-buf1", True, None, None),
    ("8bit", "mixed-buf2", False, ("value", 0.01), None),
    ("fp32", "streamed-buf1", True, None, "int8"),  # the MLPs frozen, kept in 8 bits
])
def test_without_accumulators_the_run_is_the_same_bit_for_bit(fmt, plan_name, thread, clipping, frozen):
    if fmt == "8bit":
        pytest.importorskip("bitsandbytes")
    base, data = tiny_gpt2(), batches(6)
    if frozen:
        for name, p in base.named_parameters():
            p.requires_grad_("mlp" not in name)
    plan = standard_plans(base)[plan_name]
    kw = dict(thread=thread, clipping=clipping, frozen_dtype=frozen)
    kept = engine_for(copy.deepcopy(base), True, plan, fmt, **kw)
    lean = engine_for(copy.deepcopy(base), False, plan, fmt, **kw)
    assert_same_runs(run(kept, data), run(lean, data))
    trainable = [c for c in lean.chunks if not c.persistent and c.storage.fmt.trains]
    assert trainable and all(c.storage.grad_acc is None for c in trainable)  # nothing kept between steps
    # 4 bytes per element of each streamed chunk's trainable shard less, and what the pools hold.
    saved = sum(c.storage.fmt.state_numel * 4 for c in trainable)
    assert lean.memory.host_bytes() == streamed_host_bytes(lean) <= kept.memory.host_bytes() - saved + 64 * len(trainable)
    assert lean.memory.host_bytes() < kept.memory.host_bytes()
    assert "no gradient accumulators on the host" in lean.summary()


class GatedBlock(nn.Module):
    """A block whose gate is used in some steps only: without it the block's chunk holds a
    partial set of gradients until the end of backward, and is spilled when another chunk needs
    the one buffer; a chunk of the input layer and a block is spilled with the block's gradients
    and landed again, added to them, when the input layer's come."""

    def __init__(self):
        super().__init__()
        self.lin, self.gate = nn.Linear(32, 32), nn.Linear(32, 32)
        self.use_gate = True

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return (y * torch.sigmoid(self.gate(x)) if self.use_gate else y) + x


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 1)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def gated_run(accumulator, thread, after_step=lambda engine: None):
    torch.manual_seed(0)
    model = GatedNet()
    engine = engine_for(model, accumulator, pt.Plan(n_persist=0, n_buffer=1), thread=thread,
                        planning={"blocks": "blocks", "chunk_size": 3168})
    g, losses = torch.Generator().manual_seed(1), []
    for step in range(6):
        for block in model.blocks:
            block.use_gate = step % 2 == 0
        with engine.autocast():
            loss = model(torch.randn(4, 8, generator=g)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        after_step(engine)
        engine.zero_grad()
        losses.append(loss.item())
    return losses, engine.state_dict(), engine.states.optimizer()


@pytest.mark.parametrize("thread", [False, True])
def test_a_chunk_spilled_before_all_its_gradients_came_keeps_them_in_an_accumulator_of_its_own(thread, monkeypatch):
    from protrain_core.runtime.worker import CpuWorker

    own, added = [], []
    borrow, land = ChunkStorage.borrow_accumulator, CpuWorker.land_and_update

    def counted_borrow(self, scratch):
        if scratch is None and self.grad_acc is None:
            own.append(self)
        borrow(self, scratch)

    def counted_land(self, chunk, event, landing, replace, finish, update):
        if not replace and update is not None:
            added.append(chunk.index)  # the last landing, added to the spilled gradients, then the update
        land(self, chunk, event, landing, replace, finish, update)

    def freed_by_their_updates(engine):
        engine.wait_for_updates()
        assert all(s.grad_acc is None for s in own)  # before zero_grad

    monkeypatch.setattr(ChunkStorage, "borrow_accumulator", counted_borrow)
    monkeypatch.setattr(CpuWorker, "land_and_update", counted_land)
    lean = gated_run(False, thread, freed_by_their_updates)
    assert len(own) >= 6 and added  # spills every step; some landed again and added to
    assert_same_runs(gated_run(True, thread), lean)


def test_without_accumulators_the_first_step_is_not_held_and_what_needs_them_is_refused():
    base, data = tiny_gpt2(), batches(2)
    engine = engine_for(copy.deepcopy(base), False, standard_plans(base)["streamed-buf1"])
    assert engine.overlap == "cpu-adam-during-backward"
    with pytest.raises(ValueError, match="grad_accumulator=None"):
        engine.clipping.configure("norm", 1.0)
    with pytest.raises(ValueError, match="grad_accumulator=None"):
        engine.clipping.expect_late(True)
    x = data[0]
    with engine.no_sync():
        with engine.autocast():
            loss = engine.module(input_ids=x, labels=x).loss
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.backward(loss)
    with engine.autocast():
        loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss)
    assert engine.stats["cpu_updates"] > 0  # updated during the first backward
    with pytest.raises(RuntimeError, match="grad_accumulator=False"):
        engine.clipping.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="consumed"):
        engine.clipping.grad_norm()
    engine.step()
    # Without zero_grad the gradients torch would keep are gone: a second step or backward is refused.
    with pytest.raises(RuntimeError, match="zero_grad"):
        engine.step()
    with engine.autocast():
        loss = engine.module(input_ids=x, labels=x).loss
    with pytest.raises(RuntimeError, match="zero_grad"):
        engine.backward(loss)
    engine.zero_grad()
    # The refusals changed nothing: the run goes on as one without them.
    reference = engine_for(copy.deepcopy(base), False, standard_plans(base)["streamed-buf1"])
    train_engine(reference, data[:1])
    assert_same_runs(run(reference, data[1:]), run(engine, data[1:]))


def test_all_persistent_a_late_request_is_refused_too_and_gradients_kept_across_steps_survive_parking():
    """Persistent chunks keep their accumulators on the device; a late clipping request is still
    refused (a re-plan would stream chunks that keep none). Without zero_grad, gradients add up
    across steps as in torch, also through offload_states/onload_states, which keeps them in a
    tensor of their own on the host."""
    base, data = tiny_gpt2(), batches(4)
    plan = standard_plans(base)["all-persistent"]

    def run_without_zero_grad(engine):
        losses = []
        for k, x in enumerate(data):
            with engine.autocast():
                loss = engine.module(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            if k == 1:
                engine.offload_states()
                assert any(c.storage.grad_acc is not None for c in engine.chunks)  # kept on the host
                engine.onload_states()
            losses.append(loss.item())
        return losses, engine.state_dict(), engine.states.optimizer()

    lean = engine_for(copy.deepcopy(base), False, plan)
    kept = engine_for(copy.deepcopy(base), True, plan)
    assert_same_runs(run_without_zero_grad(kept), run_without_zero_grad(lean))
    x = data[0]
    with lean.autocast():
        loss = lean.module(input_ids=x, labels=x).loss
    lean.backward(loss)
    with pytest.raises(RuntimeError, match="grad_accumulator=False"):
        lean.clipping.clip_grad_norm_(1.0)


@pytest.mark.parametrize("precision, clipping, match", [
    ("16-mixed", None, "'16-mixed'"),
    ("32-true", None, "'32-true'"),
    ("bf16-true", None, "'bf16-true'"),
    ("bf16-mixed", ("norm", 1.0), "clipping by norm"),
])
def test_wrap_refuses_what_needs_accumulators_before_allocating(precision, clipping, match, monkeypatch):
    from protrain_core.runtime import engine as runtime_engine

    monkeypatch.setattr(runtime_engine, "_allocate", lambda *a: pytest.fail("allocated"))
    with pytest.raises(ValueError, match=match):
        engine_for(tiny_gpt2(), False, pt.Plan(n_persist=0, n_buffer=2), precision=precision, clipping=clipping)


def test_the_planner_counts_no_accumulator_and_the_scratch_lent_instead():
    from protrain_core.planner.cost import CostModel

    model = tiny_gpt2()
    x = batches(1)[0]
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu", precision="bf16-mixed",
                     example_inputs={"input_ids": x, "labels": x}, report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(grad_accumulator=False,
                                              planning=pt.PlanningConfig(memory_budget="3MiB", profile_cache=False)))
    profile = engine.choice.profile
    assert profile.chunks == tuple(c.storage.fmt for c in engine.chunks)
    assert [c.accumulator for c in profile.chunks if c.updated_numel] == [False] * len(engine.chunks)
    plan = pt.Plan(n_persist=1, n_buffer=2)
    m = CostModel(profile).memory(plan)
    streamed = [c for c in engine.chunks if c.index not in plan.persistent()]
    assert m.host_bytes == sum(c.storage.fmt.streamed_host_bytes for c in streamed)
    assert all(not c.storage.fmt.host_accumulator for c in streamed)
    assert m.staging_host_bytes == max(c.storage.fmt.state_numel for c in streamed) * 4  # one fp32 scratch
    kept = CostModel(dataclasses.replace(profile, chunks=tuple(dataclasses.replace(c, accumulator=True)
                                                               for c in profile.chunks))).memory(plan)
    assert kept.staging_host_bytes == 0  # bf16-mixed lands in the host copy: no staging
    assert kept.host_bytes == m.host_bytes + sum(4 * c.storage.fmt.state_numel for c in streamed)  # fp32 accumulators
    assert "no gradient accumulator" in engine.explain()
    engine.close()


def test_the_profile_key_tells_the_formats_apart():
    from protrain_core.profiler.profiler import profile_key
    from protrain_core.runtime.storage import chunk_formats

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    layout = pt.build_layout(model, "transformer.h", 4)
    keys = {profile_key(model, opt, [], pt.Precision.BF16_MIXED, torch.device("cpu"), layout,
                        chunk_formats(model, opt, layout, pt.Precision.BF16_MIXED, pt.ProTrainConfig(grad_accumulator=a)))
            for a in (None, False)}
    assert len(keys) == 2


@pytest.mark.parametrize("settings, expected", [
    (dict(), False),
    (dict(accumulate_grad_batches=2), True),
    (dict(callbacks=["scheduler"]), True),
    (dict(manual=True), True),
    (dict(late=True), True),
    (dict(clipping=("norm", 1.0)), True),
    (dict(clipping=("value", 1.0)), False),
    (dict(precision="16-mixed"), True),
    (dict(precision="32-true"), True),
    (dict(zero_grad_overridden=True), True),
])
def test_the_trainer_strategy_leaves_the_accumulators_out_where_its_settings_allow(settings, expected):
    import lightning.pytorch as pl

    class ZeroGradKept(pl.LightningModule):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            pass  # gradients kept across steps

    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning_protrain.strategy import grad_accumulator

    callbacks = [GradientAccumulationScheduler({0: 1, 2: 4})] if settings.get("callbacks") else []
    module = ZeroGradKept() if settings.get("zero_grad_overridden") else pl.LightningModule()
    trainer = SimpleNamespace(accumulate_grad_batches=settings.get("accumulate_grad_batches", 1), callbacks=callbacks,
                              lightning_module=module)
    config = pt.ProTrainConfig(clipping=settings.get("clipping"))
    kw = dict(manual=settings.get("manual", False), late=settings.get("late", False))
    precision = settings.get("precision", "bf16-mixed")
    assert grad_accumulator(config, trainer, precision, **kw) is expected
    assert grad_accumulator(config.replace(grad_accumulator=True), trainer, precision, **kw) is True
    if expected:  # False asked for where the fit needs accumulators: refused with the reason
        with pytest.raises(ValueError, match="grad_accumulator=None"):
            grad_accumulator(config.replace(grad_accumulator=False), trainer, precision, **kw)
    else:
        assert grad_accumulator(config.replace(grad_accumulator=False), trainer, precision, **kw) is False


def test_a_bf16_mixed_fit_keeps_no_accumulators_and_trains_as_with_them():
    import lightning.pytorch as pl
    from lightning_protrain import ProTrainStrategy
    from test_lightning import assert_same, fit

    class Formats(pl.Callback):
        def __init__(self):
            self.seen = set()

        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            self.seen.add(tuple(c.storage.fmt.accumulator for c in engine.chunks if c.storage.fmt.trains))

    plan = pt.Plan(n_persist=1, n_buffer=2)
    lean_formats, kept_formats = Formats(), Formats()
    lean = fit(ProTrainStrategy(config=pt.ProTrainConfig(planning={"plan": plan})), precision="bf16-mixed",
               callbacks=[lean_formats])
    kept = fit(ProTrainStrategy(config=pt.ProTrainConfig(planning={"plan": plan}, grad_accumulator=True)),
               precision="bf16-mixed", callbacks=[kept_formats])
    assert_same(lean, kept)
    (lean_seen,), (kept_seen,) = lean_formats.seen, kept_formats.seen
    assert not any(lean_seen) and all(kept_seen) and kept_seen


def _sharded_runs(rank, world):
    """Both settings on chunks sharded over ``world`` processes (each rank its own batches)."""
    base, data = tiny_gpt2(), batches(4, seed=30 + rank)
    out = []
    for accumulator in (True, False):
        engine = engine_for(copy.deepcopy(base), accumulator, standard_plans(base)["mixed-buf2"])
        losses, sd, _ = run(engine, data)
        out.append((losses, sd, engine.memory.host_bytes()))
        engine.close()
    return out


def test_sharded_over_two_processes_the_run_is_the_same(tmp_path):
    from _distributed import spawn

    for kept, lean in spawn(_sharded_runs, 2, tmp_path):
        assert kept[0] == lean[0]
        assert kept[1].keys() == lean[1].keys() and all(torch.equal(kept[1][k], lean[1][k]) for k in kept[1])
        assert lean[2] < kept[2]


def _step(engine, x, *, zero=True):
    with engine.autocast():
        loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    if zero:
        engine.zero_grad()
    return loss.item()


def test_re_plans_neither_bring_consumed_gradients_back_as_zeros_nor_lose_kept_ones():
    base, data = tiny_gpt2(), batches(4)
    plans = standard_plans(base)
    # Streamed chunks consumed their gradients; a re-plan that keeps them on the device still
    # refuses to step or add to them (before: zero accumulators, a silent step on zeros).
    lean = engine_for(copy.deepcopy(base), False, plans["streamed-buf1"])
    _step(lean, data[0], zero=False)
    lean.replan(plans["all-persistent"])
    with pytest.raises(RuntimeError, match="zero_grad"):
        lean.step()
    with lean.autocast():
        loss = lean.module(input_ids=data[1], labels=data[1]).loss
    with pytest.raises(RuntimeError, match="zero_grad"):
        lean.backward(loss)
    lean.zero_grad()
    _step(lean, data[1])  # cleared: training goes on

    # Persistent chunks' gradients kept across a step (no zero_grad), then streamed by a re-plan:
    # the next backward adds to them as torch (and the engine with accumulators) does.
    def run(engine):
        losses = [_step(engine, data[0], zero=False)]
        engine.replan(plans["streamed-buf1"])
        losses += [_step(engine, x) for x in data[1:]]
        return losses, engine.state_dict(), engine.states.optimizer()

    kept_run = run(engine_for(copy.deepcopy(base), True, plans["all-persistent"]))
    assert_same_runs(kept_run, run(engine_for(copy.deepcopy(base), False, plans["all-persistent"])))
