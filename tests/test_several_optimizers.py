"""Several optimizers over disjoint parameters ([Note: several optimizers] in
protrain_core/runtime/engine.py): each optimizer's step updates only its own parameters, with the
gradients accumulated for them since its zero_grad -- bitwise plain PyTorch's fused AdamW in fp32
on every plan, through the core API, Lightning's manual optimization and Fabric."""
import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric

import protrain_core as pt
from conftest import MODELS, batches
from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy

FIRST = ("transformer.wte", "transformer.wpe", "transformer.h.0.", "transformer.h.1.")  # the rest: the second's


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def two_optimizers(model, prefix=""):
    """AdamW over the embeddings and the first two blocks, another (other settings) over the rest."""
    first = [p for n, p in model.named_parameters() if n.removeprefix(prefix).startswith(FIRST)]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return (torch.optim.AdamW(first, lr=1e-2, weight_decay=0.1, fused=True),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0, fused=True))


def n_chunks(model) -> int:
    """Chunks of the layout ``wrap`` builds for ``two_optimizers(model)``."""
    block_path, blocks = pt.find_blocks(model)
    owners = {id(p): k for k, o in enumerate(two_optimizers(model)) for g in o.param_groups for p in g["params"]}
    return pt.build_layout(model, block_path, len(blocks), owners=owners).n_chunks


def plans(n: int) -> dict[str, pt.Plan]:
    return {"persistent": pt.Plan(n_persist=n, n_buffer=0), "streamed": pt.Plan(n_persist=0, n_buffer=1),
            "mixed": pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2)}


def alternate(data, opts, loss_of, backward, step, zero, *, zero_first):
    """For every batch, each optimizer in turn: a loss (the second of the batch reversed), its
    backward -- which reaches both optimizers' parameters -- and that optimizer's step, with its
    zero_grad before the backward (the other's gradients of the last backward are then added to
    its next step, as torch does) or after the step."""
    losses = []
    for x in data:
        for k, opt in enumerate(opts):
            if zero_first:
                zero(opt)
            loss = loss_of(x if k == 0 else x.flip(1))
            backward(loss)
            losses.append(loss.item())
            step(opt)
            if not zero_first:
                zero(opt)
    return losses


def reference(data, *, zero_first):
    model = MODELS["gpt2"]()
    opts = two_optimizers(model)
    losses = alternate(data, opts, lambda x: model(input_ids=x, labels=x).loss, lambda loss: loss.backward(),
                       lambda o: o.step(), lambda o: o.zero_grad(), zero_first=zero_first)
    return losses, model, opts


def assert_same_states(got: dict, ref: dict) -> None:
    assert got["state"].keys() == ref["state"].keys() and got["param_groups"] == ref["param_groups"]
    for i, entry in ref["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in entry.items()), i


@pytest.mark.parametrize("zero_first", [False, True], ids=["zero-after-step", "zero-before-backward"])
@pytest.mark.parametrize("plan", ["persistent", "streamed", "mixed"])
def test_each_optimizer_steps_its_own_parameters_as_torch_does(plan, zero_first):
    """``engine.step(opt)`` / ``opt.zero_grad()``: the losses, weights and each optimizer's state
    as plain PyTorch's. Zeroing before the backward, each optimizer's step also applies what the
    other's backward gave its parameters; it zeroes through ``torch.optim.Optimizer.zero_grad``
    itself (``p.grad = None``, what a Fabric-wrapped optimizer runs), not the engine's route."""
    data = batches(3)
    ref_losses, ref, ref_opts = reference(data, zero_first=zero_first)
    model = MODELS["gpt2"]()
    opts = two_optimizers(model)
    engine = pt.wrap(model, list(opts), plans(n_chunks(model))[plan], device="cpu")
    zero = torch.optim.Optimizer.zero_grad if zero_first else (lambda o: o.zero_grad())
    losses = alternate(data, opts, lambda x: engine.module(input_ids=x, labels=x).loss, engine.backward, engine.step,
                       zero, zero_first=zero_first)
    assert losses == ref_losses
    sd = engine.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    for opt, ref_opt in zip(opts, ref_opts):
        assert_same_states(engine.states.optimizer(of=opt), ref_opt.state_dict())


def test_no_chunk_holds_two_optimizers_parameters():
    """With chunks large enough for several blocks, the layout still starts a chunk where the
    second optimizer's parameters begin (and packs them together without it)."""
    model = MODELS["gpt2"]()
    opts = two_optimizers(model)
    config = pt.ProTrainConfig(planning=pt.PlanningConfig(chunk_size=40_000))
    engine = pt.wrap(model, list(opts), pt.Plan(n_persist=0, n_buffer=1), device="cpu", config=config)
    owner = {id(p): k for k, o in enumerate(opts) for p in o.param_groups[0]["params"]}
    owners = [{owner[id(p)] for p in c.params} for c in engine.chunks]
    assert owners == [{0}, {1}]
    block_path, blocks = pt.find_blocks(model)
    assert pt.build_layout(model, block_path, len(blocks), chunk_size=40_000).n_chunks == 2  # not at the boundary
    assert [p.name for p in engine.layout.chunks[1].members][0].startswith("transformer.h.2.")


def test_what_several_optimizers_cannot_do_is_refused_with_the_reason():
    model = MODELS["gpt2"]()
    a, b = two_optimizers(model)
    plan = pt.Plan(n_persist=0, n_buffer=1)
    shared = torch.optim.AdamW([model.transformer.h[0].mlp.c_fc.weight, model.transformer.h[3].mlp.c_fc.weight])
    with pytest.raises(ValueError, match=r"'transformer.h.0.mlp.c_fc.weight' is in optimizers 0 and 1"):
        pt.wrap(model, [a, shared], plan, device="cpu")
    split = [torch.optim.AdamW([model.transformer.h[0].attn.c_attn.weight]),
             torch.optim.AdamW([p for n, p in model.named_parameters() if n != "transformer.h.0.attn.c_attn.weight"])]
    with pytest.raises(ValueError, match=r"unit 'transformer.h.0'.*optimizers \[0, 1\]"):
        pt.wrap(model, split, plan, device="cpu")
    with pytest.raises(ValueError, match="several optimizers of one class, got AdamW and SGD"):
        pt.wrap(model, [a, torch.optim.SGD(b.param_groups[0]["params"], lr=0.1)], plan, device="cpu")
    clipped = pt.ProTrainConfig(clipping=pt.ClippingConfig(algorithm="norm", value=1.0))
    with pytest.raises(ValueError, match="does not support gradient clipping"):
        pt.wrap(model, [a, b], plan, device="cpu", config=clipped)
    with pytest.raises(ValueError, match="does not support precision='16-mixed'"):
        pt.wrap(model, [a, b], plan, device="cpu", precision="16-mixed")
    engine = pt.wrap(model, [a, b], plan, device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="clipping per optimizer is not supported"):
        engine.clipping.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="not an optimizer of this ProTrain engine"):
        engine.step(torch.optim.AdamW(model.parameters()))
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) was called on the optimizer of a ProTrain engine"):
        b.step()


def test_each_optimizers_state_loads_back_and_training_goes_on_exactly():
    """Each optimizer's state dict, loaded into a new engine (after a round trip through the
    user's optimizers, as a checkpoint's would), continues the run bit for bit (zeroing before
    each backward: no gradient crosses the resume, as none is in a checkpoint)."""
    data = batches(4)
    step = lambda engine: (lambda o: engine.step(o))  # noqa: E731
    runs = {}
    for name in ("whole", "resumed"):
        model = MODELS["gpt2"]()
        opts = two_optimizers(model)
        engine = pt.wrap(model, list(opts), pt.Plan(n_persist=1, n_buffer=2), device="cpu")
        loss_of = lambda x, e=engine: e.module(input_ids=x, labels=x).loss  # noqa: E731
        zero = lambda o: o.zero_grad()  # noqa: E731
        losses = alternate(data[:2], opts, loss_of, engine.backward, step(engine), zero, zero_first=True)
        if name == "resumed":
            states, weights = [engine.states.optimizer(of=o) for o in opts], engine.state_dict()
            engine.close()
            model = MODELS["gpt2"](seed=7)
            model.load_state_dict(weights)
            opts = two_optimizers(model)
            for o, s in zip(opts, states):
                o.load_state_dict(s)
            engine = pt.wrap(model, list(opts), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
            loss_of = lambda x, e=engine: e.module(input_ids=x, labels=x).loss  # noqa: E731
        losses += alternate(data[2:], opts, loss_of, engine.backward, step(engine), zero, zero_first=True)
        runs[name] = losses, engine.state_dict(), [engine.states.optimizer(of=o) for o in opts]
    (l0, sd0, osd0), (l1, sd1, osd1) = runs["whole"], runs["resumed"]
    assert l0 == l1 and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    for a, b in zip(osd0, osd1):
        assert_same_states(a, b)


# ----- Lightning ---------------------------------------------------------------------------------
class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers (and a scheduler on the second), each step with
    its optimizer toggled (Lightning's GAN recipe) or not."""

    def __init__(self, toggle=True):
        super().__init__()
        self.model = MODELS["gpt2"]()
        self.automatic_optimization = False
        self.toggle, self.losses = toggle, []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for k, opt in enumerate(self.optimizers()):
            if self.toggle:
                self.toggle_optimizer(opt)
            inputs = x if k == 0 else x.flip(1)
            loss = self.model(input_ids=inputs, labels=inputs).loss
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            if self.toggle:
                self.untoggle_optimizer(opt)
            self.losses.append(loss.item())
        self.lr_schedulers().step()

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", self.model(input_ids=x, labels=x).loss)

    def configure_optimizers(self):
        a, b = two_optimizers(self, prefix="model.")
        return [a, b], [torch.optim.lr_scheduler.StepLR(b, step_size=1, gamma=0.5)]


def _fit(strategy, tmp_path, toggle, max_steps=6, **kw):
    """Fitted from seed 1234 for ``max_steps`` (Lightning counts each optimizer's step)."""
    torch.manual_seed(1234)
    lit = TwoOptimizers(toggle)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=max_steps,
                         default_root_dir=tmp_path)
    trainer.fit(lit, _loader(), **kw)
    return lit, trainer


def _loader():
    data = torch.utils.data.TensorDataset(torch.cat(batches(8, batch=2, distinct=4)))
    return torch.utils.data.DataLoader(data, batch_size=4, generator=torch.Generator().manual_seed(1), shuffle=True)


@pytest.mark.parametrize("toggle", [True, False], ids=["toggled", "untoggled"])
@pytest.mark.parametrize("plan", ["persistent", "mixed"])
def test_lightning_manual_optimization_with_two_optimizers_trains_as_the_default_strategy(tmp_path, plan, toggle):
    """Losses, weights and both optimizers' states (the checkpoint holds one per optimizer) as
    under Lightning's default strategy, also after a validation run after fit; resuming from
    that checkpoint goes on the same."""
    ref, ref_trainer = _fit("auto", tmp_path / "auto", toggle)
    strategy = ProTrainStrategy(plans(n_chunks(MODELS["gpt2"]()))[plan])
    got, trainer = _fit(strategy, tmp_path / "protrain", toggle)
    assert len(got.losses) == 6 and got.losses == ref.losses
    ref_sd = ref.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in got.state_dict().items())
    trainer.validate(got, _loader())
    trainer.save_checkpoint(tmp_path / "protrain.ckpt")
    ref_trainer.save_checkpoint(tmp_path / "auto.ckpt")
    states = torch.load(tmp_path / "protrain.ckpt", weights_only=False)["optimizer_states"]
    ref_states = torch.load(tmp_path / "auto.ckpt", weights_only=False)["optimizer_states"]
    assert len(states) == 2
    for s, r in zip(states, ref_states):
        assert_same_states(s, r)
    if plan == "mixed" and toggle:  # resumed from the checkpoints: four more steps (two batches) each
        strategies = {"auto": "auto", "protrain": ProTrainStrategy(plans(n_chunks(MODELS["gpt2"]()))[plan])}
        resumed = [_fit(s, tmp_path / f"resumed-{name}", toggle, max_steps=10, ckpt_path=tmp_path / f"{name}.ckpt")[0]
                   for name, s in strategies.items()]
        assert len(resumed[0].losses) == 4 and resumed[0].losses == resumed[1].losses
        resumed_sd = resumed[1].state_dict()
        assert all(torch.equal(v, resumed_sd[k]) for k, v in resumed[0].state_dict().items())


def test_lightning_automatic_optimization_with_two_optimizers_gets_lightnings_own_message():
    class Automatic(TwoOptimizers):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

    trainer = pl.Trainer(strategy="protrain", accelerator="cpu", devices=1, logger=False, max_steps=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches(2))), batch_size=2)
    with pytest.raises(RuntimeError, match="multiple optimizers is only supported with manual optimization"):
        trainer.fit(Automatic(), data)


# ----- Fabric ------------------------------------------------------------------------------------
def _fabric_run(strategy, data, two_step, tmp_path=None):
    """A GAN-shaped Fabric loop: zero_grad before each backward through Fabric's optimizer
    wrappers (their zero_grad is torch's own: it reaches the chunks through ``p.grad = None``),
    one step each; the checkpoint saved with both optimizers."""
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = MODELS["gpt2"]()
    if two_step:
        model = fabric.setup_module(model)
        opts = fabric.setup_optimizers(*two_optimizers(model, prefix="_forward_module."))
    else:
        model, *opts = fabric.setup(model, *two_optimizers(model))
    losses = []
    for x in data:
        for k, opt in enumerate(opts):
            opt.zero_grad()
            inputs = x if k == 0 else x.flip(1)
            loss = model(input_ids=inputs, labels=inputs).loss
            fabric.backward(loss)
            opt.step()
            losses.append(loss.item())
    weights = {k.removeprefix("_forward_module."): v.detach().clone()
               for k, v in (getattr(fabric.strategy, "engine", None) or model).state_dict().items()}
    states = [opt.state_dict() for opt in opts]
    if tmp_path is not None:
        fabric.save(tmp_path / "ckpt", {"model": model, "a": opts[0], "b": opts[1]})
        loaded = fabric.load(tmp_path / "ckpt", {"model": model, "a": opts[0], "b": opts[1]})
        assert loaded == {}
        states += [opt.state_dict() for opt in opts]
    return losses, weights, states


@pytest.mark.parametrize("two_step", [False, True], ids=["setup", "setup_module-then-setup_optimizers"])
def test_fabric_with_two_optimizers_trains_as_the_default_strategy(tmp_path, two_step):
    data = batches(3)
    ref = _fabric_run("auto", data, two_step=False)
    for plan in plans(n_chunks(MODELS["gpt2"]())).values():
        losses, weights, states = _fabric_run(ProTrainFabricStrategy(plan), data, two_step, tmp_path)
        assert losses == ref[0]
        assert weights.keys() == ref[1].keys() and all(torch.equal(weights[k], v) for k, v in ref[1].items())
        for s, r in zip(states, ref[2] * 2):  # (after the checkpoint's round trip too)
            assert_same_states(s, r)


def test_the_second_optimizers_gradients_wait_for_its_own_zero_grad():
    """p.grad of the other optimizer's parameters reads what the backwards gave them after a
    step and a zero_grad of the first one, as torch's; cleared member by member, a chunk keeps
    the rest."""
    data = batches(2)
    ref = MODELS["gpt2"]()
    model = copy.deepcopy(ref)
    engine = pt.wrap(model, list(two_optimizers(model)), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    a, _ = engine.optimizers
    ref_a, _ = two_optimizers(ref)
    for x in data:
        ref(input_ids=x, labels=x).loss.backward()
        engine.backward(engine.module(input_ids=x, labels=x).loss)
    ref_a.step(), ref_a.zero_grad()
    engine.step(a), a.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or torch.equal(p.grad, q.grad), name
    model.transformer.h[3].mlp.zero_grad()  # part of a chunk
    assert model.transformer.h[3].mlp.c_fc.weight.grad is None
    assert torch.equal(model.transformer.h[3].attn.c_attn.weight.grad, ref.transformer.h[3].attn.c_attn.weight.grad)


# ----- several processes -------------------------------------------------------------------------
def _ranks_alternate(rank, world):
    """On each rank: DDP with the two optimizers (each backward all-reduced), then ProTrain's
    sharded engine on every plan, the same loop, zeroing before or after; per case the losses of
    both and rank 0's largest weight difference."""
    data = batches(3, seed=10 + rank)
    out = []
    for zero_first in (True, False):
        ref = torch.nn.parallel.DistributedDataParallel(MODELS["gpt2"]())
        opts = two_optimizers(ref.module)
        ref_losses = alternate(data, opts, lambda x: ref(input_ids=x, labels=x).loss, lambda loss: loss.backward(),
                               lambda o: o.step(), lambda o: o.zero_grad(), zero_first=zero_first)
        for plan in plans(n_chunks(MODELS["gpt2"]())).values():
            model = MODELS["gpt2"]()
            opts = two_optimizers(model)
            engine = pt.wrap(model, list(opts), plan, device="cpu")
            losses = alternate(data, opts, lambda x: engine.module(input_ids=x, labels=x).loss, engine.backward,
                               engine.step, lambda o: o.zero_grad(), zero_first=zero_first)
            weights = engine.state_dict()
            engine.close()
            diff = max((weights[k] - v).abs().max().item() for k, v in ref.module.state_dict().items()) if rank == 0 else 0
            out.append((zero_first, ref_losses, losses, diff))
    return out


def test_two_processes_train_with_two_optimizers_as_ddp(tmp_path):
    """Sharded over two gloo processes (each chunk's states split between them), DDP's run:
    bitwise when no gradient is kept across backwards (two ranks: every reduction adds the same
    two values). Zeroing after the step, a parameter's gradient of the other optimizer's backward
    waits for its own, and DDP reduces the sum kept in ``.grad`` with the new one, ProTrain each
    backward's alone and adds: the last bits differ (within the suite's fp32 tolerance,
    test_distributed.py)."""
    from _distributed import spawn

    for rank, results in enumerate(spawn(_ranks_alternate, 2, tmp_path)):
        for zero_first, ref_losses, losses, diff in results:
            if zero_first:
                assert losses == ref_losses and diff == 0.0, rank
            else:
                assert losses == pytest.approx(ref_losses, abs=1e-5) and diff < 1e-4, (rank, diff)


# ----- the GAN recipe: a generated batch kept across the discriminator's step ----------------------
class TinyGAN(torch.nn.Module):
    """Blocks 0-1 generate, 2-3 discriminate (the blocks ProTrain manages), a head each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g_in = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(4))
        self.d_out = torch.nn.Linear(16, 1)

    def forward(self, z=None, x=None):
        if z is not None:
            x = self.g_in(z)
            for b in self.blocks[:2]:
                x = x + b(x)
            return x
        for b in self.blocks[2:]:
            x = x + b(x)
        return self.d_out(x)

    def optimizers(self):
        g = [*self.g_in.parameters(), *self.blocks[:2].parameters()]
        d = [*self.blocks[2:].parameters(), *self.d_out.parameters()]
        return torch.optim.AdamW(g, lr=1e-2, fused=True), torch.optim.AdamW(d, lr=1e-2, fused=True)


def gan_steps(gan, opt_g, opt_d, backward, step, n=3, between=None):
    """The DCGAN recipe: the generated batch's graph lives across the discriminator's backward
    and step, then the generator's backward goes through the discriminator; ``between()`` runs
    right after the discriminator's step."""
    g, losses = torch.Generator().manual_seed(3), []
    for _ in range(n):
        fake = gan(z=torch.randn(4, 6, 8, generator=g))
        opt_d.zero_grad()
        loss_d = gan(x=fake.detach()).pow(2).mean()
        backward(loss_d)
        step(opt_d)
        if between is not None:
            between()
        opt_g.zero_grad()
        loss_g = (gan(x=fake) - 1).pow(2).mean()
        backward(loss_g)
        step(opt_g)
        losses += [loss_d.item(), loss_g.item()]
    return losses


def test_a_generated_batch_kept_across_a_step_holds_its_chunks_in_place():
    """While the generator's graph waits for its backward, engine.replan and offload_states are
    refused with the reason (a streamed chunk made persistent under it broke that backward), and
    the planner's switch waits for the next micro-batch; the run stays plain PyTorch's."""
    ref = TinyGAN()
    ref_losses = gan_steps(ref, *ref.optimizers(), lambda loss: loss.backward(), lambda o: o.step())
    gan = TinyGAN()
    opt_g, opt_d = gan.optimizers()
    config = pt.ProTrainConfig(planning=pt.PlanningConfig(blocks="blocks"))
    engine = pt.wrap(gan, [opt_g, opt_d], pt.Plan(n_persist=0, n_buffer=1), device="cpu", config=config)
    streamed, persistent = engine.plan, pt.Plan(n_persist=engine.layout.n_chunks, n_buffer=0)
    refused = []

    def replan():
        assert engine.hooks.backward_awaited()
        for what in (lambda: engine.replan(persistent), engine.offload_states):
            with pytest.raises(RuntimeError, match="waits for its backward"):
                what()
        refused.append(engine.plan)

    losses = gan_steps(gan, opt_g, opt_d, engine.backward, engine.step, between=replan)
    assert losses == ref_losses and refused == [streamed] * 3 and not engine.hooks.backward_awaited()
    ref_sd = ref.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in engine.state_dict().items())


def test_the_planners_switch_waits_for_the_generated_batchs_backward():
    gan = TinyGAN()
    opt_g, opt_d = gan.optimizers()
    config = pt.ProTrainConfig(planning=pt.PlanningConfig(blocks="blocks"))
    engine = pt.wrap(gan, [opt_g, opt_d], pt.Plan(n_persist=0, n_buffer=1), device="cpu", config=config)
    profiled = TinyGAN()
    profile = pt.profile(profiled, profiled.optimizers()[0], example_inputs={"z": torch.randn(4, 6, 8)},
                         step_fn=lambda m, inputs: m(x=m(**inputs)).pow(2).mean(), device="cpu", blocks="blocks")
    from protrain_core.autoplan import AutoPlanner
    planner = AutoPlanner(engine, profile, budget=2**30, host_budget=None, overlap=engine.clipping.overlap(),
                          report=lambda *a, **k: None)
    planner.follow()
    persistent = pt.Plan(n_persist=engine.layout.n_chunks, n_buffer=0)
    seen = []

    def switch():
        planner.switch(persistent)
        seen.append((engine.plan == persistent, planner.pending == persistent))

    gan_steps(gan, opt_g, opt_d, engine.backward, engine.step, n=2, between=switch)
    assert seen == [(False, True), (True, False)]  # deferred, then made at the next batch's first forward



@pytest.mark.parametrize("plan", ["persistent", "streamed"])
def test_each_optimizers_own_weight_decay_mode_is_kept(plan):
    """Two Adams, one with decoupled weight decay: each group is stepped in its own mode (the
    engine read the first optimizer's for all); the CPU update overlaps the next forward."""
    data = batches(2)
    runs = []
    for engine_run in (False, True):
        model = MODELS["gpt2"]()
        first = [p for n, p in model.named_parameters() if n.startswith(FIRST)]
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        opts = [torch.optim.Adam(first, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, fused=True),
                torch.optim.Adam(rest, lr=1e-2, weight_decay=0.1, fused=True)]
        run = model, lambda loss: loss.backward(), lambda o: o.step()
        if engine_run:
            engine = pt.wrap(model, opts, plans(n_chunks(MODELS["gpt2"]()))[plan], device="cpu")
            run = engine.module, engine.backward, engine.step
            assert engine.overlap.startswith("cpu-adam-during-next-forward (several optimizers")
        losses = alternate(data, opts, lambda x: run[0](input_ids=x, labels=x).loss, *run[1:],
                           lambda o: o.zero_grad(), zero_first=True)
        runs.append((losses, (engine if engine_run else model).state_dict()))
    (l0, sd0), (l1, sd1) = runs
    assert l0 == l1 and all(torch.equal(v, sd1[k]) for k, v in sd0.items())


def test_a_gradient_cleared_after_its_chunk_was_updated_in_backward_is_refused():
    """One optimizer, every chunk streamed: from the second step on a chunk is updated during
    backward; ``p.grad = None`` of its parameters then cannot be honoured (torch would skip them)."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    for step, x in enumerate(batches(2)):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        if step == 1:
            with pytest.raises(RuntimeError, match=r"cleared \(zero_grad\(\), p.grad = None\) between backward and step, "
                                                   r"but ProTrain had already updated"):
                for p in engine.chunks[2].params:  # the whole chunk: its last member used to pass silently
                    p.grad = None
            return
        engine.step()
        engine.zero_grad()


def test_an_optimizer_wrapped_by_the_user_still_steps_under_the_trainer():
    """configure_optimizers may return an optimizable that wraps the torch optimizer
    (``.optimizer``): the engine takes the one inside, and Lightning's step of the wrapper steps it."""
    class Wrapped:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def __getattr__(self, name):
            return getattr(self.optimizer, name)

        def step(self, closure=None):
            return self.optimizer.step(closure)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = MODELS["gpt2"]()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):
            return Wrapped(torch.optim.AdamW(self.parameters(), lr=1e-2))

    lit = Lit()
    before = lit.model.lm_head.weight.detach().clone()
    trainer = pl.Trainer(strategy=ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=1)), accelerator="cpu", devices=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=2)
    trainer.fit(lit, _loader())
    assert trainer.global_step == 2 and not torch.equal(before, lit.model.lm_head.weight.detach())
