"""Planning on the first real training steps (no extra calls of the user's code), the switch to
the searched plan inside the run, and batches of varying length.

The profiled steps are training steps: from step 1 the losses and weights equal plain PyTorch
bit for bit in fp32, the user's forward / ``training_step`` runs once per micro-batch, and
buffers, metrics and the random state advance exactly as without ProTrain. On this CPU the
profiler needs 6 steps (memory, 2 timed, a swap warm-up, 2 timed with every block swapped);
the runs below are longer, so the searched plan trains too."""

import copy
import json
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import protrain_core as pt
from protrain_core.autoplan import SWITCH_GAIN, refitter
from protrain_core.utils import format_bytes, format_seconds, parse_bytes
from conftest import MODELS, VOCAB, assert_same_weights, batches, fabric_steps, train_engine, train_reference
from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy

CACHE_WARNING = "ignore:ProTrain. a key/value cache"
PROFILED_STEPS = 6  # on a CPU device
pytestmark = pytest.mark.filterwarnings(CACHE_WARNING)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path / "cache"))


class Reports(list):
    def __call__(self, text, **metrics):
        self.append((text, metrics))

    def texts(self, start=""):
        return [t for t, _ in self if t.startswith(start)]


def budget_forcing_streaming(model, x):
    """Half of what the model needs with every chunk on the device (from a profile of a copy)."""
    probe = copy.deepcopy(model)
    prof = pt.profile(probe, torch.optim.AdamW(probe.parameters()), {"input_ids": x, "labels": x}, cache=False)
    return int(0.5 * pt.CostModel(prof).memory(pt.Plan(n_persist=prof.n_chunks, n_buffer=0)).peak_bytes)


def count_calls(module):
    calls = []
    module.register_forward_pre_hook(lambda _m, _a: calls.append(torch.is_grad_enabled()))
    return calls


# ----- the core API -------------------------------------------------------------------------
@pytest.mark.parametrize("arch,accumulate", [("gpt2", 1), ("llama", 1), ("llama", 2)])
def test_planning_on_the_first_steps_equals_plain_pytorch(arch, accumulate):
    """wrap(plan=None, memory_budget=...) without example_inputs: the engine starts on the safe
    plan, switches to the searched one after the profiled steps, and the whole run is bitwise
    plain AdamW; the forward ran once per micro-batch."""
    model = MODELS[arch]()
    ref = copy.deepcopy(model)
    data = batches(12 * accumulate)
    budget = budget_forcing_streaming(model, data[0])
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data,
                                 accumulate=accumulate)
    reports = Reports()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", report=reports,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget), runtime=pt.RuntimeConfig(check_invariants=True)))
    calls = count_calls(model)  # after wrap: its meta-device trace is not a training call
    safe = engine.plan
    assert safe.n_checkpoint == 4 and engine.choice is None
    losses = train_engine(engine, data, accumulate=accumulate)
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    assert calls == [True] * len(data)
    (profiled,) = reports.texts("ProTrain profiling:")
    assert f"ProTrain profiling: {PROFILED_STEPS} steps, " in profiled and "ProTrain plan: " + str(engine.plan) in profiled
    assert engine.choice is not None and engine.plan == engine.choice.plan != safe
    assert engine.plan.n_persist < engine.choice.profile.n_chunks  # the budget forced streaming
    assert engine.choice.memory.peak_bytes <= budget


def test_mixed_precision_planning_changes_no_bit():
    """bf16-mixed: a run that plans on its first steps equals, bit for bit, a run on its final
    plan from the start (the plan never changes the numerics)."""
    runs = []
    data = batches(10)
    for given in (None, "final"):
        model = MODELS["llama"]()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        planning = dict(plan=runs[0][2]) if given else dict(memory_budget=budget_forcing_streaming(model, data[0]))
        engine = pt.wrap(model, opt, config=pt.ProTrainConfig(planning=planning), precision="bf16-mixed",
                         device="cpu", report=Reports())
        losses = train_engine(engine, data)
        runs.append((losses, engine.state_dict(), engine.plan))
    assert runs[0][2] == runs[1][2] and runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][k], v, rtol=0, atol=0, msg=k)


def test_dropout_random_state_and_buffers_advance_as_without_protrain():
    """Dropout draws the same masks (the safe plan's recomputation replays the random state);
    afterwards the global random state and a buffer the model updates are where plain PyTorch
    leaves them."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            from transformers import GPT2Config, GPT2LMHeadModel

            self.lm = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                                 resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

        def forward(self, input_ids, labels):
            self.seen += input_ids.shape[0]
            return self.lm(input_ids=input_ids, labels=labels)

    data = batches(10)
    runs = []
    for wrapped in (False, True):
        model = Counting()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=not wrapped)
        torch.manual_seed(7)
        if wrapped:
            engine = pt.wrap(model, opt, device="cpu", report=Reports(),
                             config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB", blocks="lm.transformer.h")))
            losses = train_engine(engine, data)
            assert engine.choice is not None
            state = engine.state_dict()
        else:
            losses = train_reference(model, opt, data)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        runs.append((losses, state, torch.get_rng_state()))
    (ref_losses, ref_state, ref_rng), (losses, state, rng) = runs
    assert losses == ref_losses and torch.equal(rng, ref_rng)
    assert int(state["seen"]) == int(ref_state["seen"]) == 2 * len(data)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)


def test_a_cached_profile_ends_profiling_after_one_step():
    data = batches(8)
    for run in range(2):
        model = MODELS["gpt2"]()
        ref = copy.deepcopy(model)
        ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data)
        reports = Reports()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", report=reports,
                         config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB")))
        steps = []
        engine.observe(type("Steps", (pt.StepObserver,), {"step_ends": lambda self: steps.append(engine.choice is not None)})())
        assert train_engine(engine, data) == ref_losses
        (profiled,) = reports.texts("ProTrain profiling:")
        if run == 0:
            assert f"{PROFILED_STEPS} steps" in profiled and steps.index(True) == PROFILED_STEPS - 1
        else:
            assert "from the profile cache, 1 step" in profiled and steps.index(True) == 0


def test_a_short_run_says_it_ended_while_profiling():
    reports = Reports()
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", report=reports,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB")))
    train_engine(engine, batches(3))
    engine.close()
    assert reports.texts() == [f"ProTrain: the run ended after 3 steps, before profiling was over; it ran the safe "
                               f"plan {engine.plan} throughout."]


# ----- batches of varying length --------------------------------------------------------------
def varying(lengths, batch=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, n), generator=g) for n in lengths]


def tight_budget():
    """A budget under which tiny llama keeps every block's activations for 2 x 16 tokens, but
    for 2 x 64 must checkpoint (no plan that keeps them fits, not even one streaming every
    chunk), and no plan fits 8 x 64 tokens."""
    model = MODELS["llama"]()
    x = torch.randint(0, VOCAB, (2, 16))
    prof = pt.profile(model, torch.optim.AdamW(model.parameters()), {"input_ids": x, "labels": x}, cache=False)
    N, L = prof.n_chunks, prof.n_blocks

    def peak(tokens, **plan):
        return pt.CostModel(prof.at_tokens(tokens)).memory(pt.Plan(**plan)).peak_bytes

    budget = (peak(32, n_persist=N, n_buffer=0) + peak(128, n_persist=0, n_buffer=1)) // 2
    assert peak(32, n_persist=N, n_buffer=0) < budget < peak(128, n_persist=0, n_buffer=1)
    assert peak(128, n_persist=N, n_buffer=0, n_checkpoint=L) < budget  # 2 x 64 fits by checkpointing
    with pytest.raises(pt.InfeasibleBudget):
        pt.search(prof.at_tokens(512), budget)
    return budget


def test_batches_of_16_to_64_tokens_equal_plain_pytorch_and_longer_ones_checkpoint_more():
    """Profiled on 2 x 16 tokens, then sequences of 16-64: every micro-batch runs a plan whose
    predicted peak for its own length fits the budget; long ones checkpoint, short ones keep
    their activations again where that is predicted faster; each switch is said once per
    length and plan; the run is bitwise plain PyTorch."""
    budget = tight_budget()
    lengths = [16] * PROFILED_STEPS + [64, 16, 40, 64, 24, 64, 16, 40]
    data = varying(lengths)
    model = MODELS["llama"]()
    ref = copy.deepcopy(model)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data)
    reports = Reports()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", report=reports,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget), runtime=pt.RuntimeConfig(check_invariants=True)))
    plans = []
    engine.observe(type("Plans", (pt.StepObserver,), {"backward_begins": lambda self: plans.append(engine.plan)})())
    assert train_engine(engine, data) == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    searched = list(zip(lengths, plans))[PROFILED_STEPS:]
    for n, plan in searched:
        assert pt.CostModel(engine.profile.at_tokens(2 * n)).memory(plan).peak_bytes <= budget, (n, plan)
    checkpointed = {n: plan.n_checkpoint + plan.n_swap for n, plan in searched}
    assert checkpointed[64] > 0  # no plan keeping every activation fits 2 x 64 tokens
    # Each batch runs the fastest plan for its length with the chunks on the device unchanged, or
    # keeps the current one when that fits and the fastest is not SWITCH_GAIN faster (so whether
    # a short batch after a long one keeps its activations again depends on the block times).
    for n, plan in searched:
        profile = engine.profile.at_tokens(2 * n)
        best = pt.search(profile, budget, n_persist=plan.n_persist)
        assert plan == best.plan or best.runtime.total_s >= pt.CostModel(profile).runtime(plan).total_s * (1 - SWITCH_GAIN)
    switched, previous = set(), engine.choice.plan
    for n, plan in searched:
        if plan != previous:
            switched.add((n, plan))
        previous = plan
    switches = reports.texts("ProTrain: batches of")
    assert len(switches) == len(switched) >= 1
    assert any("128 tokens (the plan was made for 32)" in s and "would need" in s for s in switches)


def test_a_batch_no_plan_fits_is_refused_before_its_forward():
    budget = tight_budget()
    model = MODELS["llama"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", report=Reports(),
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget)))
    train_engine(engine, varying([16] * PROFILED_STEPS))
    calls = count_calls(model.model.layers[0])
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    (too_long,) = varying([64], batch=8)
    with pytest.raises(pt.BatchTooLarge, match="a batch of 512 tokens .* fits no plan .* The largest batch that fits "
                                               "has [0-9,]+ tokens; use shorter sequences") as error:
        engine.module(input_ids=too_long, labels=too_long)
    assert calls == []  # nothing of it ran
    assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
    # An out-of-memory error, named as the device's: Lightning's batch-size tuner backs off from it on a GPU.
    from lightning.pytorch.utilities.memory import is_oom_error

    assert isinstance(error.value, torch.OutOfMemoryError) and str(error.value).startswith("CPU out of memory")
    assert is_oom_error(pt.BatchTooLarge(str(error.value).replace("CPU", "CUDA", 1), tokens=512, largest=0))
    largest = error.value.largest
    assert 128 < largest < 512
    pt.search(engine.profile.at_tokens(largest), budget)  # fits, and one more token does not
    with pytest.raises(pt.InfeasibleBudget):
        pt.search(engine.profile.at_tokens(largest + 1), budget)
    fits = torch.randint(0, VOCAB, (largest // 64, 64))
    engine.backward(engine.module(input_ids=fits, labels=fits).loss)  # the engine is usable after the refusal
    engine.step()


def test_a_budget_no_plan_fits_is_refused_with_what_would_fit(tmp_path):
    """Issue 57, item 2: planning on the first steps, a budget that holds the chunk buffers but
    no plan's activations beside them is refused with each change that would fit and its
    predicted step: the largest batch that fits (whose plan the search gives for it); 8-bit
    moments do not shrink buffers or activations, and say so."""
    model = MODELS["llama"]()
    data = batches(PROFILED_STEPS + 2)
    with pytest.raises(pt.InfeasibleBudget) as need:
        pt.search(pt.profile(model, torch.optim.AdamW(model.parameters()), {"input_ids": data[0], "labels": data[0]},
                             cache=False), 1)
    budget = int(need.value.needed_bytes * 0.6)  # above the buffers alone (the check before the first step)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", report=Reports(),
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget)))
    with pytest.raises(pt.InfeasibleBudget, match="No ProTrain plan fits") as refused:
        train_engine(engine, data)
    text = str(refused.value)
    row = text.split("What would fit, each change alone")[1].splitlines()
    batch = next(r for r in row if r.startswith("  batches of at most"))
    largest = int(batch.split("at most ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < largest < data[0].numel()
    assert "predicted" in batch and "a step, device peak" in batch
    peak = batch.split("device peak ")[1].split(",")[0]
    assert parse_bytes(peak) <= budget
    assert "  optimizer_state_format='8bit': does not fit either" in row
    assert not any("frozen_dtype" in r for r in row)  # nothing is frozen


def test_a_host_too_small_is_refused_with_the_formats_that_would_fit():
    """Issue 57, item 2, on a simulated H100 whose host holds the streamed states with 8-bit
    moments and not with fp32 ones: ``wrap`` refuses, and its refusal gives the plan, step,
    device peak and host bytes that a run with 8-bit moments gets (the update timed in them):
    those of that run's own profile and search."""
    import dataclasses

    from protrain_core import models
    from protrain_core.simulator.device import SimulatedDevice
    from protrain_core.simulator.hardware import load_spec
    from protrain_core.simulator.run import simulate

    config = models.load_config("tiny-llama")

    def build():
        model, opt = models.build(config, "meta")
        return model, opt, models.token_batch(config, 2, 64, "meta")

    h100, streamed = load_spec("h100"), pt.Plan(n_persist=0, n_buffer=1)
    need = {fmt: simulate(*build(), device=SimulatedDevice(h100), plan=streamed,
                          config=pt.ProTrainConfig(optimizer_state_format=fmt)).memory
            for fmt in ("fp32", "8bit")}
    assert need["8bit"].planned_host_bytes < need["fp32"].planned_host_bytes
    host = (need["fp32"].planned_host_bytes + need["8bit"].planned_host_bytes) // 2
    small = dataclasses.replace(h100, host_memory_bytes=int(host / 0.9))  # the host budget: 90 % of it
    budget = need["fp32"].peak_bytes
    sim = SimulatedDevice(small)
    model, opt, batch = build()
    with sim, pytest.raises(pt.InfeasibleBudget, match="host budget") as refused:
        pt.wrap(model, opt, example_inputs=batch, device=sim, precision="bf16-mixed", report=lambda *a, **k: None,
                config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget, profile_cache=False)))
    eight = simulate(*build(), device=SimulatedDevice(small), budget=budget,
                     config=pt.ProTrainConfig(optimizer_state_format="8bit"))
    c = eight.choice
    assert (f"  optimizer_state_format='8bit': {c.plan}, predicted {format_seconds(c.runtime.total_s)} a step, device "
            f"peak {format_bytes(c.memory.peak_bytes)}, host {format_bytes(c.memory.host_bytes)}") in str(refused.value)
    # What it predicted from: the fp32 profile refitted, its records and its update's rate those of the 8-bit run.
    fp32 = simulate(*build(), device=SimulatedDevice(h100), plan=streamed).profile
    model, opt, _ = build()
    layout = pt.build_layout(model, *(lambda path, blocks: (path, len(blocks)))(*pt.find_blocks(model)))
    with SimulatedDevice(h100) as sim:
        refitted = refitter(model, opt, layout, pt.Precision.BF16_MIXED, pt.ProTrainConfig(), sim)(
            fp32, {"optimizer_state_format": "8bit"})
    assert refitted.chunks == eight.profile.chunks != fp32.chunks
    rate = eight.profile.hardware.cpu_adam_params_per_s
    assert refitted.hardware.cpu_adam_params_per_s == pytest.approx(rate, rel=1e-9)
    assert rate != pytest.approx(fp32.hardware.cpu_adam_params_per_s, rel=1e-3)
    # More processes, each with this device and host: the fewest whose shards fit (one does not),
    # with the plan a search of the profile sharded over them finds.
    two = dataclasses.replace(fp32, chunks=tuple(f.sharded(2) for f in fp32.chunks))
    from protrain_core.api import default_host_budget
    c = pt.search(two, budget, host_budget=default_host_budget(SimulatedDevice(small))).plan
    assert "  2 processes, each with a device and a host like this one's" in str(refused.value)
    assert f"the step leaves out the collectives, which one process cannot time): {c}," in str(refused.value)


def test_max_tokens_plans_once_for_the_longest_batch():
    budget = tight_budget()
    data = varying([16] * PROFILED_STEPS + [64, 16, 40, 64, 24])
    model = MODELS["llama"]()
    ref = copy.deepcopy(model)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data)
    reports = Reports()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", report=reports,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget, max_tokens=128)))
    assert train_engine(engine, data) == ref_losses
    assert reports.texts("ProTrain: batches of") == []  # no switch: one plan for every length
    assert engine.plan == engine.choice.plan and engine.choice.profile.tokens == 128  # planned for 2 x 64
    assert engine.plan.n_checkpoint + engine.plan.n_swap > 0  # no plan keeping every activation fits
    assert engine.choice.memory.peak_bytes <= budget
    # A max_tokens no plan fits is refused once the profile exists (at the end of the profiled steps).
    model = MODELS["llama"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", report=Reports(),
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=budget, max_tokens=512)))
    with pytest.raises(pt.BatchTooLarge, match="a max_tokens of 512 tokens .* The largest batch that fits has"):
        train_engine(engine, data[:PROFILED_STEPS])


# ----- the profile cache ----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["chunk index", "zero bandwidth", "negative time", "few segments", "not a list",
                                    "chunk outside its span", "unknown dtype"])
def test_a_semantically_wrong_cached_profile_is_discarded_and_measured_again(tmp_path, damage):
    data = batches(8)
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", report=Reports(),
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB")))
    train_engine(engine, data)
    (path,) = (tmp_path / "cache" / "profiles").glob("*.json")
    good = json.loads(path.read_text())
    bad = copy.deepcopy(good)
    if damage == "chunk index":
        bad["segments"][1]["chunks"] = [999]
    elif damage == "zero bandwidth":
        bad["hardware"]["h2d_bytes_per_s"] = 0
    elif damage == "negative time":
        bad["segments"][2]["bwd_s"] = -1.0
    elif damage == "few segments":
        bad["segments"] = bad["segments"][:1]
    elif damage == "chunk outside its span":
        bad["chunks"][0]["trainable_start"] = bad["chunks"][0]["numel"] + 1
    elif damage == "unknown dtype":
        bad["chunks"][-1]["compute_dtype"] = "float99"
    else:
        bad["chunks"] = 7
    path.write_text(json.dumps(bad))
    reports = Reports()
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", report=reports,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB")))
    with pytest.warns(UserWarning, match="is unusable .* it is discarded and the model is profiled again"):
        losses = train_engine(engine, data)
    assert losses == train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data)
    (profiled,) = reports.texts("ProTrain profiling:")
    assert f"{PROFILED_STEPS} steps" in profiled
    assert json.loads(path.read_text())["hardware"]["h2d_bytes_per_s"] > 0  # measured and stored again


def test_an_unwritable_cache_directory_warns_once(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(blocked))
    import protrain_core.planner.profiles as profiles

    monkeypatch.setattr(profiles, "_UNWRITABLE_WARNED", set())
    with pytest.warns(UserWarning, match="cannot write its profile cache") as record:
        for _ in range(2):
            model = MODELS["gpt2"]()
            engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", report=Reports(),
                             config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB")))
            train_engine(engine, batches(PROFILED_STEPS))
            assert engine.choice is not None
    assert sum("cannot write its profile cache" in str(w.message) for w in record) == 1


# ----- Lightning ------------------------------------------------------------------------------
@pytest.fixture
def collect_info():
    """``collect_info(*names)``: the lines ``rank_zero_info`` sends to Lightning's loggers
    ``names`` (their stream handlers were bound before pytest captured the output)."""
    added = []

    def collect(*names):
        lines = []

        class Collect(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        for name in names:
            log = logging.getLogger(name)
            handler = Collect(logging.INFO)
            added.append((log, handler, log.level))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        return lines

    yield collect
    for log, handler, level in added:
        log.removeHandler(handler)
        log.setLevel(level)


class Counted(pl.LightningModule):
    """Everything a training_step can advance: a metric, an integer buffer, a list, the random
    state (dropout)."""

    def __init__(self):
        super().__init__()
        import torchmetrics
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                                resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
        self.mean_loss = torchmetrics.MeanMetric()
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))
        self.calls, self.losses = [], []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.calls.append(batch_idx)
        self.steps_seen += 1
        self.mean_loss.update(loss)
        self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)


def fit_counted(strategy, **kw):
    torch.manual_seed(1234)
    lit = Counted()
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (48, 16), generator=g)), batch_size=4, shuffle=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=10, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, **kw)
    trainer.fit(lit, data)
    return lit, trainer, torch.get_rng_state()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_runs_training_step_once_per_batch_and_equals_default(accumulate):
    ref, ref_trainer, ref_rng = fit_counted("auto", accumulate_grad_batches=accumulate)
    got, trainer, rng = fit_counted("protrain", accumulate_grad_batches=accumulate)
    engine_plan = trainer.strategy._last_plan
    assert got.calls == ref.calls and len(got.calls) == 10 * accumulate
    assert got.losses == ref.losses  # bitwise from the first step
    assert int(got.steps_seen) == int(ref.steps_seen) == 10 * accumulate
    assert float(trainer.callback_metrics["mean_loss"]) == float(ref_trainer.callback_metrics["mean_loss"])
    assert torch.equal(rng, ref_rng)
    for (k, v), (k2, v2) in zip(got.model.state_dict().items(), ref.model.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v.float(), v2.float(), rtol=0, atol=0, msg=k)
    assert engine_plan.n_checkpoint < 4  # the searched plan replaced the safe one (all checkpointed)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_reports_profiling_and_prediction_once(tmp_path, collect_info, accumulate):
    """With gradient accumulation the prediction of a step is that of its micro-batches, and
    the report says so (the plan's "predicted step" is one micro-batch's: the two differed
    without a word)."""
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(1234)
    lit = Counted()
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (64 * accumulate, 16))), batch_size=4)
    lines = collect_info("lightning.pytorch")
    trainer = pl.Trainer(strategy="protrain", accelerator="cpu", devices=1, max_steps=16, logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, accumulate_grad_batches=accumulate)
    trainer.fit(lit, data)
    assert sum(line.startswith(f"ProTrain profiling: {PROFILED_STEPS} steps") for line in lines) == 1
    assert sum("ProTrain plan: Plan(" in line for line in lines) == 1
    (measured,) = [line for line in lines if line.startswith("ProTrain: measured step")]
    assert ("; 2 micro-batches of " in measured) == (accumulate == 2), measured
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    for name in ("protrain/predicted_step_s", "protrain/measured_step_s", "protrain/profiling_s"):
        assert name in metrics


def test_fabric_plans_on_its_first_steps_and_prints_the_prediction(collect_info):
    data = batches(16, batch=4)
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data)
    fabric = Fabric(strategy=ProTrainFabricStrategy(config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="1GiB"))), accelerator="cpu", devices=1)
    fabric.launch()
    # rank_zero_info goes to the logger of whichever Lightning package set it up last.
    lines = collect_info("lightning.fabric", "lightning.pytorch")
    inner = model
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    calls = count_calls(inner)  # after setup: its meta-device trace is not a training call
    losses = fabric_steps(fabric, model, opt, data)
    assert losses == ref_losses and len(calls) == len(data)
    assert_same_weights(fabric.strategy.engine.state_dict(), ref)
    out = "\n".join(lines)
    assert f"ProTrain profiling: {PROFILED_STEPS} steps" in out and "ProTrain plan: Plan(" in out
    assert "ProTrain: measured step" in out and "predicted" in out


def test_strategies_refuse_max_tokens_with_a_plan():
    for cls in (ProTrainStrategy, ProTrainFabricStrategy):
        with pytest.raises(ValueError, match="max_tokens is used to search a plan"):
            cls({"planning": {"plan": pt.Plan(n_persist=1, n_buffer=1), "max_tokens": 128}})
        with pytest.raises(ValueError, match="max_tokens=-1"):
            cls({"planning": {"max_tokens": -1}})
