"""torch.compile under the engine ([Note: compiled units] in runtime/compiled.py): each block and
the stem and head units compiled per module, the runtime's hooks outside, every plan training
exactly as plain PyTorch with the same modules compiled the same way, and no recompilation in
steady state.

Most cases compile with a counting backend (dynamo's graphs run as they are: what dynamo
captures and guards is the same as with inductor, in a fraction of CI's time); the inductor case,
which generates and builds C++ here (10-20 s from an empty cache), runs for LLaMA in CI and for
GPT-2 with ``-m slow``."""

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import protrain_core as pt
from torch._dynamo.utils import counters
from benchmarks.bench_compile import compiled_like_protrain, protrain_units
from conftest import MODELS, batches, standard_plans, train_engine, train_reference

COUNTED = pytest.mark.filterwarnings("ignore::UserWarning")


class Counting:
    """A dynamo backend that counts the graphs it is given (compilations) and their calls, and
    runs each graph as captured."""

    def __init__(self):
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # (dynamo's caches live on the code objects every test's blocks share)
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def loop(model, backward, step, zero_grad, data) -> list[float]:
    """A training loop calling ``model`` itself, with the given backward, step and zero_grad."""
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        backward(loss)
        step()
        zero_grad()
        losses.append(loss.item())
    return losses


_REFERENCES: dict = {}


def compiled_reference(arch):
    """Plain PyTorch with ProTrain's units compiled, trained on ``batches(6)``: (losses, final
    state), once per model (the plans' cases share it)."""
    if arch not in _REFERENCES:
        ref = compiled_like_protrain(MODELS[arch](), {"backend": Counting()})
        losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
                                 batches(6))
        _REFERENCES[arch] = losses, {k: v.clone() for k, v in ref.state_dict().items()}
    return _REFERENCES[arch]


def wrap_compiled(model, plan, backend, **kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return pt.wrap(model, opt, plan, device="cpu", report=lambda *a, **k: None,
                   config=pt.ProTrainConfig(compile={"backend": backend}, **kwargs))


@COUNTED
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
def test_every_plan_trains_compiled_exactly_like_plain_pytorch_compiled_the_same_way(arch, plan_name):
    model = MODELS[arch]()
    data = batches(6)
    ref_losses, ref_state = compiled_reference(arch)
    backend = Counting()
    engine = wrap_compiled(model, standard_plans(model)[plan_name], backend)
    losses = train_engine(engine, data)
    assert losses == ref_losses and ref_losses[-1] < ref_losses[0]
    sd = engine.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref_state.items())
    # Every unit ran compiled, whole (the runtime's hooks and parameter class are outside the
    # graphs): at least one graph per distinct unit, each unit's graph ran each step, no graph break.
    assert backend.graphs >= 2 and backend.calls >= len(data) * len(protrain_units(model))
    assert not counters["graph_break"], dict(counters["graph_break"])
    engine.close()


@COUNTED
@pytest.mark.parametrize("arch", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])  # (C++ builds: 20 s cold)
def test_inductor_compiled_blocks_train_exactly_like_plain_pytorch_with_inductor(arch):
    """The real compiler (C++ kernels generated and built here), a plan with streamed chunks and
    swapped and checkpointed blocks: bitwise equal to plain PyTorch compiled with inductor, which
    on this CPU differs from eager PyTorch (so the blocks did run inductor's code). Under
    deterministic algorithms: inductor's CPU embedding backward otherwise adds rows with atomics
    across threads once an embedding is large enough to split, and plain PyTorch compiled then
    differs from itself run to run (docs/benchmarks.md, "torch.compile against eager")."""
    model = MODELS[arch]()
    data = batches(4)
    plain = copy.deepcopy(model)
    eager = train_reference(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), data)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref = compiled_like_protrain(copy.deepcopy(model), {})
        ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), data)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = pt.wrap(model, opt, standard_plans(model)["swap-checkpoint"], device="cpu",
                         report=lambda *a, **k: None, config=pt.ProTrainConfig(compile=True))
        assert train_engine(engine, data) == ref_losses != eager
        sd = engine.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
        engine.close()
    finally:
        torch.use_deterministic_algorithms(was)


@COUNTED
def test_steady_state_compiles_nothing_and_a_replan_compiles_each_unit_at_most_once_per_new_mode():
    """A streamed chunk's parameters point at another buffer each step: no recompilation. A
    re-plan that checkpoints and swaps blocks, and a new batch length, compile each unit at most
    once more."""
    model = MODELS["llama"]()
    units = len(protrain_units(model))
    backend = Counting()
    engine = wrap_compiled(model, pt.Plan(n_persist=0, n_buffer=1), backend)
    assert f"compiled: {units} modules (each block, the stem and head)" in engine.summary()
    train_engine(engine, batches(2))
    first = backend.graphs
    assert 2 <= first <= units  # (blocks of one class share a graph when nothing tells them apart)
    train_engine(engine, batches(4))
    assert backend.graphs == first and engine.scheduler.stats["fetches"] > 0
    engine.replan(pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2))
    train_engine(engine, batches(3))
    after_replan = backend.graphs
    assert first < after_replan <= first + units
    train_engine(engine, batches(3))
    assert backend.graphs == after_replan
    longer = [torch.cat([x, x], dim=1) for x in batches(2)]
    train_engine(engine, longer)
    assert backend.graphs <= after_replan + units
    grown = backend.graphs
    train_engine(engine, [torch.cat([x, x, x], dim=1) for x in batches(2)])  # dynamo made the length dynamic
    assert backend.graphs == grown
    engine.close()


@COUNTED
def test_a_checkpointed_block_recomputes_with_its_compiled_forward():
    model = MODELS["llama"]()
    n_blocks = len(pt.find_blocks(model)[1])
    calls = {}
    kept = standard_plans(model)["all-persistent"]
    for mode, plan in (("keep", kept), ("checkpoint", pt.Plan(n_persist=kept.n_persist, n_buffer=0, n_checkpoint=n_blocks))):
        backend = Counting()
        engine = wrap_compiled(copy.deepcopy(model), plan, backend)
        train_engine(engine, batches(3))
        calls[mode] = backend.calls
        if mode == "checkpoint":
            assert engine.activations.stats["recomputed_blocks"] == 3 * n_blocks
        engine.close()
        torch._dynamo.reset()
    assert calls["checkpoint"] == calls["keep"] + 3 * n_blocks  # each block's graph ran again in backward


@COUNTED
def test_live_profiling_compiles_in_an_untimed_step_and_times_the_compiled_blocks(tmp_path, monkeypatch):
    """The memory pass (step 1) runs the units eagerly (dynamo does not trace under its dispatch
    mode), step 2 compiles them untimed, and the timed steps after it compile nothing: on a CPU
    the profile takes 7 steps (memory, warm-up, 2 timed, swap warm-up, 2 swapped) where an eager
    run takes 6."""
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    model = MODELS["llama"]()
    backend = Counting()
    metrics = {}
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu",
                     report=lambda text, **m: metrics.update(m), config=pt.ProTrainConfig(compile={"backend": backend}))
    graphs = []
    train_engine(engine, batches(8), after_step=lambda e: graphs.append(backend.graphs))
    assert metrics["profiling_steps"] == 7 and engine.choice is not None
    assert graphs[0] == 0 < graphs[1] == graphs[2] == graphs[3]


@COUNTED
def test_close_gives_every_unit_its_forward_back_and_a_deep_copy_runs_plain():
    model = MODELS["gpt2"]()
    units = protrain_units(model)
    forwards = [m.forward for m in units]
    backend = Counting()
    engine = wrap_compiled(model, pt.Plan(n_persist=0, n_buffer=1, n_checkpoint=1), backend)
    assert all("forward" in m.__dict__ for m in units)
    train_engine(engine, batches(2))
    calls = backend.calls
    copied = copy.deepcopy(model)  # (an EMA's copy: the blocks' plain forwards)
    with torch.no_grad():
        copied(input_ids=batches(1)[0])
    assert backend.calls == calls
    engine.close()
    assert [m.forward for m in units] == forwards and not any("forward" in m.__dict__ for m in units)


def test_the_compile_setting_is_checked_where_it_is_written():
    assert pt.ProTrainConfig(compile={"mode": "max-autotune-no-cudagraphs"}).compile["mode"].startswith("max")
    with pytest.raises(ValueError, match="does not take per module here"):
        pt.ProTrainConfig(compile={"modee": "default"})
    with pytest.raises(ValueError, match="must be True, False or a dict"):
        pt.ProTrainConfig(compile="yes")
    with pytest.raises(ValueError, match="torch.compile refuses it: Unrecognized mode"):  # (before any engine exists)
        pt.ProTrainConfig(compile={"mode": "no-such-mode"})


def test_a_compiled_profile_has_a_key_of_its_own():
    from protrain_core.profiler.profiler import profile_key
    from protrain_core.runtime.storage import chunk_formats

    model = MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters())
    block_path, blocks = pt.find_blocks(model)
    layout = pt.build_layout(model, block_path, len(blocks))
    formats = chunk_formats(model, opt, layout, pt.Precision.FP32, pt.ProTrainConfig())
    key = lambda compile: profile_key(model, opt, [((2, 16), "int64")], pt.Precision.FP32,  # noqa: E731
                                      torch.device("cpu"), layout, formats, compile)
    with warnings.catch_warnings():
        assert key(False) == key(None) != key(True) != key({"mode": "reduce-overhead"})
        assert key({"backend": Counting()}) == key({"backend": Counting()})  # (a backend by its name: cached)


@COUNTED
def test_a_model_compiled_before_wrap_is_compiled_per_unit_and_given_back_compiled():
    """``wrap(torch.compile(model))`` and a block the user compiled: the wrappers run their
    modules eagerly while the engine is open, the units are compiled on their own (with the
    wrapper's options as Lightning records them), training equals plain PyTorch, names keep
    torch.compile's ``_orig_mod.``, and closing gives the wrappers their compiled call back."""
    importlib.import_module("lightning.fabric")  # (records torch.compile's arguments on the module it returns)

    model = MODELS["gpt2"]()
    data = batches(4)
    plain = copy.deepcopy(model)
    ref_losses = train_reference(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), data)
    backend = Counting()
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    compiled_forward = compiled.forward
    engine = pt.wrap(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu", report=lambda *a, **k: None)
    # (Lightning records a deep copy of the arguments: the engine compiles with a copy of the backend)
    assert type(engine.config.compile["backend"]) is Counting and engine.layout.block_path == "_orig_mod.transformer.h"
    losses = loop(compiled, engine.backward, engine.step, engine.zero_grad, data)  # (what torch.compile gave the user)
    assert losses == ref_losses and counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    assert all(k.startswith("_orig_mod.") for k in engine.state_dict())
    engine.close()
    assert compiled.forward is compiled_forward

    torch._dynamo.reset()
    counters.clear()
    block = copy.deepcopy(model)
    wrapper = block.transformer.h[1] = torch.compile(block.transformer.h[1], backend=backend)
    wrapper_forward = wrapper.forward
    engine = pt.wrap(block, torch.optim.AdamW(block.parameters(), lr=1e-2), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu", report=lambda *a, **k: None)
    assert train_engine(engine, data) == ref_losses
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]  # (every unit compiled, whole)
    engine.close()
    assert wrapper.forward is wrapper_forward


@COUNTED
def test_a_block_the_user_compiled_runs_checkpointed_without_its_cache():
    """A GPT-2 block the user compiled (inductor, torch's default), checkpointed: its key/value
    cache (which GPT-2 passes by position) is left out as an uncompiled block's is, so the
    recomputation does not write it a second time, and it trains as the same block compiled by
    ``ProTrainConfig(compile=True)``. Before, the compile wrapper's ``*args, **kwargs`` hid the
    argument, and the compiled backward of the recomputed block failed on the cache's strides."""
    importlib.import_module("lightning.fabric")  # (records torch.compile's arguments on the module it returns)
    data = batches(2)
    runs = []
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # (inductor's CPU kernels: see the inductor test)
    try:
        for user in (False, True):
            torch._dynamo.reset()
            model = MODELS["gpt2"]()
            if user:
                model.transformer.h[1] = torch.compile(model.transformer.h[1])
            plan = standard_plans(model)["swap-checkpoint"]  # block 1 checkpointed
            engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu",
                             report=lambda *a, **k: None, config=pt.ProTrainConfig(compile=not user))
            assert engine.block_modes[1] is pt.BlockMode.CHECKPOINT
            runs.append(train_engine(engine, data))
    finally:
        torch.use_deterministic_algorithms(was)
    assert runs[1] == runs[0]


@COUNTED
def test_the_trainer_compiles_a_lightning_modules_compiled_model_per_unit():
    """A LightningModule whose model is ``torch.compile``d: under the ProTrain strategy each
    unit is compiled with its options, and fit equals the default strategy's (the graphs here
    run as captured, as plain PyTorch does eagerly)."""
    import lightning.pytorch as pl
    from test_lightning import LitLM, fit

    backend = Counting()

    class CompiledLit(LitLM):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.model = torch.compile(self.model, backend=backend)

    ref = fit("auto")
    got = fit("protrain", module=CompiledLit)
    assert got[0].losses == ref[0].losses and counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    wa, wb = got[0].model._orig_mod.state_dict(), ref[0].model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wb)
    assert isinstance(got[1], pl.Trainer)


@COUNTED
def test_fabric_compiles_per_unit_by_the_config_and_refuses_its_own_recompilation_with_the_fix():
    """Fabric with ``compile`` in the strategy's config trains like plain PyTorch; a compiled
    model given to ``fabric.setup`` is compiled again whole by Fabric after the strategy's setup:
    its first call is refused, saying to pass the model uncompiled with ``compile=True``."""
    from lightning.fabric import Fabric

    from lightning_protrain import ProTrainFabricStrategy

    model = MODELS["gpt2"]()
    data = batches(3)
    plain = copy.deepcopy(model)
    ref_losses = train_reference(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), data)
    config = pt.ProTrainConfig(compile={"backend": Counting()}, planning={"plan": pt.Plan(n_persist=0, n_buffer=1)})
    fabric = Fabric(strategy=ProTrainFabricStrategy(config=config), accelerator="cpu", devices=1)
    mine = copy.deepcopy(model)
    module, opt = fabric.setup(mine, torch.optim.AdamW(mine.parameters(), lr=1e-2))
    losses = loop(module, fabric.backward, opt.step, opt.zero_grad, data)
    assert losses == ref_losses and counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]

    fabric = Fabric(strategy="protrain", accelerator="cpu", devices=1)
    compiled = torch.compile(copy.deepcopy(model), backend=Counting())
    module, opt = fabric.setup(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-2))
    with pytest.raises(RuntimeError, match="after wrap is not supported.*set the strategy's config compile=True"):
        module(input_ids=data[0], labels=data[0])


@COUNTED
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_compiled_trains_as_eager_where_the_graphs_run_as_captured(precision):
    """The engine's autocast around the model is what dynamo captures in each unit: with graphs
    that run as captured, a compiled run equals the eager one bit for bit (and eager equals plain
    PyTorch: tests/test_parity.py)."""
    model = MODELS["llama"]()
    data = batches(4)
    runs = []
    for compile in (False, {"backend": Counting()}):
        copied = copy.deepcopy(model)
        engine = pt.wrap(copied, torch.optim.AdamW(copied.parameters(), lr=1e-2), pt.Plan(n_persist=1, n_buffer=1, n_checkpoint=1),
                         precision=precision, device="cpu", report=lambda *a, **k: None,
                         config=pt.ProTrainConfig(compile=compile))
        runs.append((train_engine(engine, data), engine.state_dict()))
        engine.close()
    (eager, sd_eager), (compiled, sd_compiled) = runs
    assert compiled == eager and all(torch.equal(sd_compiled[k], v) for k, v in sd_eager.items())
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x, table=None, shared=None):
        x = x + torch.tanh(self.lin(x))
        x = x if table is None else x + 0.1 * torch.tanh(x @ table.t()) @ table
        return x if shared is None else shared(x)


class _Model(nn.Module):
    """Blocks given the embedding table (another unit's parameter) as an argument, or a norm
    registered outside the blocks and called inside each."""

    def __init__(self, shared_norm=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(96, 32)
        self.h = nn.ModuleList(_Block() for _ in range(4))
        self.norm = nn.LayerNorm(32) if shared_norm else None
        self.head = nn.Linear(32, 96)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for block in self.h:
            x = block(x, shared=self.norm) if self.norm is not None else block(x, self.emb.weight)
        loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


def test_a_parameter_of_another_chunk_passed_to_a_compiled_block_is_fetched_and_a_shared_module_is_refused():
    """Every chunk streamed: a block given the embedding table runs that call uncompiled, so the
    table's chunk is fetched (compiled with the hooks' parameter class turned off it read the
    placeholder: NaN losses); a module with hooks called inside a compiled block is refused with
    the fix."""
    data = batches(4)
    plan, planning = pt.Plan(n_persist=0, n_buffer=2), {"blocks": "h", "chunk_size": 3200}
    for shared in (False, True):
        model = _Model(shared)
        plain = copy.deepcopy(model)
        ref_losses = train_reference(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), data)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu",
                         report=lambda *a, **k: None,
                         config=pt.ProTrainConfig(compile={"backend": Counting()}, planning=planning))
        assert engine.layout.n_chunks > 2
        if shared:
            with pytest.raises(RuntimeError, match="called inside one cannot be compiled.*set compile=False"):
                train_engine(engine, data)
        else:
            with pytest.warns(UserWarning, match="_Block is given a parameter of another module"):
                assert train_engine(engine, data) == ref_losses
        engine.close()
        torch._dynamo.reset()


def _sharded(rank, world):
    """One rank: ProTrain compiled (AOTAutograd's graphs, run as captured) over the ranks'
    sharded chunks, against DDP on the same batches."""
    from _distributed import ddp_reference, protrain_run

    from conftest import tiny_llama

    out = []
    for plan_name in ("all-persistent", "swap-checkpoint"):
        model = tiny_llama(seed=0)
        data = batches(3, seed=10 + rank)
        ref_losses, ref_weights = ddp_reference(model, data)
        losses, engine = protrain_run(tiny_llama(seed=0), data, standard_plans(model)[plan_name],
                                      compile={"backend": "aot_eager"})
        weights = engine.state_dict()
        graphs = counters["stats"]["unique_graphs"]
        engine.close()
        same = all(torch.equal(weights[k], ref_weights[k]) for k in weights) if rank == 0 else None
        out.append((ref_losses, losses, same, graphs, len(counters["graph_break"])))
        torch._dynamo.reset()
    return out


def test_compiled_units_sharded_over_two_processes_train_like_ddp(tmp_path):
    """Sharded chunks are gathered around each unit's call: the compiled units see whole
    parameters, and two gloo processes train exactly as DDP does (two ranks' gradients sum in
    one order)."""
    from _distributed import spawn

    for rank, cases in enumerate(spawn(_sharded, 2, tmp_path)):
        for ref_losses, losses, same, graphs, breaks in cases:
            assert losses == ref_losses and graphs >= 2 and breaks == 0
            assert same is (True if rank == 0 else None)
