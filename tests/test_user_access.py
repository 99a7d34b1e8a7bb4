"""Parameters and gradients read and written where users read and write them, on every plan,
against Lightning's default strategy and plain PyTorch: a LightningModule's own parameter, a
penalty over the model's parameters, weights read in every hook, ``p.grad`` between backward and
step (read, clipped in place, Lightning's ``grad_norm``), ``optimizer.zero_grad()`` of the core
API ([Note: parameters used outside their units] in runtime/hooks.py, [Note: gradients read
through p.grad] in runtime/gradients.py). In fp32 everything is bitwise the default's."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

import protrain_core as pt
from conftest import MODELS, SEQ, VOCAB, assert_same_weights, batches, n_chunks, standard_plans
from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy

STEPS = 5


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def plans(n: int) -> dict[str, pt.Plan]:
    """All chunks streamed through one buffer, some persistent with swapped and checkpointed
    blocks, all persistent."""
    return {"streamed": pt.Plan(n_persist=0, n_buffer=1),
            "mixed": pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2),
            "persistent": pt.Plan(n_persist=n, n_buffer=0)}


def _norm(t) -> float:
    return float(t.detach().float().norm())


class Reader(pl.LightningModule):
    """Reads and writes parameters and gradients in the hooks where Lightning users do, and
    records what it saw; the loss uses a learnable scale of its own (outside ``self.model``)
    and an L2 penalty over ``self.model``'s parameters taken before the forward."""

    def __init__(self):
        super().__init__()
        self.model = MODELS["gpt2"]()
        self.logit_scale = torch.nn.Parameter(torch.tensor(0.25))
        self.seen: list = []

    def _block_weight(self):
        return self.model.transformer.h[1].mlp.c_fc.weight

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(("batch_start", _norm(self._block_weight())))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        penalty = 1e-3 * sum(p.pow(2).sum() for p in self.model.parameters())
        loss = self.model(input_ids=x, labels=x).loss * self.logit_scale.exp() + penalty
        weight = self._block_weight().norm()
        self.log("weight_norm", weight)
        self.seen.append(("training_step", float(weight), float(self.logit_scale)))
        return loss

    def on_after_backward(self):
        self.seen.append(("after_backward", _norm(self.model.lm_head.weight.grad), _norm(self.logit_scale.grad)))

    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self.model, norm_type=2)
        total = torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        self.seen.append(("before_step", round(float(norms["grad_2.0_norm_total"]), 6), float(total)))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(("batch_end", float(outputs["loss"]), _norm(self._block_weight())))

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append(("validation", float(self.model(input_ids=x, labels=x).loss), _norm(self._block_weight())))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)


class WeightWatcher(pl.Callback):
    """A callback reading weights and gradients (a monitoring callback's habit)."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.seen.append(sum(_norm(p.grad) for p in module.parameters() if p.grad is not None))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append(sum(_norm(p) for p in module.parameters()))


def _loader(seed: int):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (8, SEQ), generator=g)), batch_size=2)


def _fit(strategy):
    torch.manual_seed(1234)
    module, watcher = Reader(), WeightWatcher()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, val_check_interval=2, limit_val_batches=1, callbacks=[watcher])
    trainer.fit(module, _loader(1), _loader(2))
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return module.seen, watcher.seen, weights


@pytest.fixture(scope="module")
def default_fit():
    return _fit("auto")


@pytest.mark.parametrize("plan", ["streamed", "mixed", "persistent"])
def test_every_hook_reads_and_writes_parameters_and_gradients_as_under_the_default_strategy(plan, default_fit):
    """Before: the scale and the penalty made every weight NaN after the first step, the weight
    norm logged NaN, clip_grad_norm_ in on_before_optimizer_step clipped nothing and grad_norm
    saw no gradient (streamed plans). The module owns ``logit_scale`` around ``self.model``: a
    forward of the module would keep its chunk on the device around every block's, so all chunks
    streamed take two buffers."""
    n = n_chunks(Reader())
    given = plans(n)[plan] if plan != "streamed" else pt.Plan(n_persist=0, n_buffer=2)
    seen, watched, weights = _fit(ProTrainStrategy(given))
    ref_seen, ref_watched, ref_weights = default_fit
    assert [s[0] for s in seen] == [s[0] for s in ref_seen]
    assert seen == ref_seen
    assert watched == ref_watched
    assert weights.keys() == ref_weights.keys()
    for k, v in ref_weights.items():
        assert torch.equal(weights[k], v), k


def _core_loop(model, opt, step, backward, zero_grad, *, read_grads=True):
    """Plain PyTorch's habits on ``model``: a penalty and a weight read outside the forward,
    gradients read and clipped in place between backward and step, ``optimizer.zero_grad()``."""
    seen = []
    for k, x in enumerate(batches(STEPS)):
        penalty = 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        loss = model(input_ids=x, labels=x).loss + penalty
        seen.append(float(model.transformer.h[0].attn.c_attn.weight.norm()))
        backward(loss)
        if read_grads and k != 1:  # not every step: a step without it changes nothing
            seen.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        step()
        zero_grad()
        seen.append(float(loss))
    return seen


def _wrapped(model, plan, precision):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = pt.wrap(model, opt, plans(n_chunks(model))[plan], device="cpu", precision=precision,
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    return engine, _core_loop(engine.module, opt, engine.step, engine.backward, opt.zero_grad)


@pytest.mark.parametrize("plan,precision", [("streamed", "32-true"), ("mixed", "32-true"), ("persistent", "32-true"),
                                            ("streamed", "bf16-mixed"), ("mixed", "bf16-mixed")])
def test_the_core_api_reads_parameters_and_gradients_as_pytorch_does(plan, precision):
    """``optimizer.zero_grad()`` instead of ``engine.zero_grad()`` (it did nothing: gradients
    added up across steps), a penalty over the parameters (NaN), a weight read between forward
    and backward, ``clip_grad_norm_`` on ``p.grad`` (clipped nothing). fp32: bitwise plain
    PyTorch; bf16-mixed: bitwise the all-persistent plan, where every chunk stays on the device."""
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    engine, got = _wrapped(model, plan, precision)
    if precision == "32-true":
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
        expected = _core_loop(ref, ref_opt, ref_opt.step, lambda loss: loss.backward(), ref_opt.zero_grad)
        ref_sd = ref.state_dict()
    else:
        ref_engine, expected = _wrapped(ref, "persistent", precision)
        ref_sd = ref_engine.state_dict()
    assert got == expected
    sd = engine.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_a_gradient_changed_after_an_update_during_backward_is_refused_with_the_fix():
    """The first step is held for a change of p.grad; a later step whose chunks were updated
    during backward (nothing changed p.grad before it) cannot apply a change: refused at step(),
    naming the way to say so ahead. Said ahead (expect_late), every step is exact."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=0, n_buffer=2),
                     device="cpu")
    for k, x in enumerate(batches(3)):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        if k == 2:
            assert engine.overlap == "cpu-adam-during-backward"
            assert model.transformer.h[0].attn.c_attn.weight.grad is not None  # reading is right
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            with pytest.raises(RuntimeError, match=r"changed through p.grad .* engine.clipping.expect_late\(\)"):
                engine.step()
            break
        engine.step()
        engine.zero_grad()


def test_gradients_read_through_p_grad_only_between_a_backward_and_its_step():
    """Before a backward and after ``step()`` or ``zero_grad`` parameters hold no gradient, as
    torch's after ``zero_grad``; the optimizer's own step never sees one (it would update)."""
    model = MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=1, n_buffer=2), device="cpu")
    params = list(model.parameters())
    assert all(p.grad is None for p in params)
    seen_by_optimizer = []
    opt.register_step_pre_hook(lambda o, a, k: seen_by_optimizer.append(any(p.grad is not None for p in params)))
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    engine.step()
    assert seen_by_optimizer == [False]
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("read_first", [False, True], ids=["clip-then-read", "read-then-clip"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("plan", ["streamed", "persistent"])
def test_a_clipping_requested_after_backward_shows_in_p_grad_at_once_as_in_pytorch(plan, algorithm, read_first):
    """``engine.clipping.clip_grad_*_`` (Lightning's ``clip_gradients``) between backward and
    step: ``p.grad`` shows the clipped gradients at once, also through views read before the
    request, as torch's in-place clipping does; the step applies it once. Bitwise plain PyTorch."""
    def run(model, backward, clip, step):
        seen = []
        for x in batches(3):
            backward(model(input_ids=x, labels=x).loss)
            held = [p.grad for p in model.parameters()] if read_first else None
            clip(list(model.parameters()))
            seen.append([g.clone() for g in (held or [p.grad for p in model.parameters()])])
            step()
        return seen

    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    torch_clip = {"norm": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
                  "value": lambda ps: torch.nn.utils.clip_grad_value_(ps, 1e-3)}[algorithm]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    expected = run(ref, lambda loss: loss.backward(), torch_clip, lambda: (ref_opt.step(), ref_opt.zero_grad()))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plans(n_chunks(model))[plan], device="cpu")
    clip = {"norm": lambda ps: engine.clipping.clip_grad_norm_(0.05),
            "value": lambda ps: engine.clipping.clip_grad_value_(1e-3)}[algorithm]
    got = run(engine.module, engine.backward, clip, lambda: (engine.step(), engine.zero_grad()))
    assert all(torch.equal(a, b) for step_a, step_b in zip(got, expected) for a, b in zip(step_a, step_b))
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.parametrize("plan", ["streamed", "persistent"])
def test_a_clipping_followed_by_another_backward_clips_what_it_saw_as_in_pytorch(plan):
    """Manual optimization (Lightning's manual_backward / clip_gradients): backward, clip,
    backward, step. torch clips the first gradients and adds the second unclipped; so does the
    engine, without a read of ``p.grad`` (the clip applies when the next backward begins)."""
    data = batches(6)

    def run(model, backward, clip, step):
        losses = []
        for i in range(0, len(data), 2):
            for k, x in enumerate(data[i:i + 2]):
                loss = model(input_ids=x, labels=x).loss
                backward(loss)
                if k == 0:
                    clip()
                losses.append(loss.item())
            step()
        return losses

    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    expected = run(ref, lambda loss: loss.backward(), lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05),
                   lambda: (ref_opt.step(), ref_opt.zero_grad()))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plans(n_chunks(model))[plan], device="cpu")
    engine.step_state.set_manual()  # (what the Trainer does under manual optimization)
    got = run(engine.module, engine.backward, lambda: engine.clipping.clip_grad_norm_(0.05),
              lambda: (engine.step(), engine.zero_grad()))
    assert got == expected
    assert_same_weights(engine.state_dict(), ref)


def test_fabric_reads_and_clips_gradients_between_backward_and_step_as_pytorch():
    def run(strategy):
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model = MODELS["gpt2"]()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        model, opt = fabric.setup(model, opt)
        return _core_loop(model, opt, opt.step, fabric.backward, opt.zero_grad), _weights(fabric, model)

    _same_as_fabrics_default(run)


def _weights(fabric, model) -> dict:
    """The weights after a Fabric run: the engine's masters, or the default strategy's module."""
    engine = getattr(fabric.strategy, "engine", None)
    return {k.removeprefix("_forward_module."): v.detach().clone() for k, v in (engine or model).state_dict().items()}


def _same_as_fabrics_default(run) -> None:
    """``run(strategy) -> (records, weights)`` gives the same, bit for bit, on every plan as with
    Fabric's default strategy."""
    expected, ref = run("auto")
    for plan in plans(n_chunks(MODELS["gpt2"]())).values():
        records, weights = run(ProTrainFabricStrategy(plan))
        assert records == expected
        assert weights.keys() == ref.keys() and all(torch.equal(weights[k], v) for k, v in ref.items())


def test_a_managed_parameter_is_a_plain_parameter_again_after_close_and_in_a_deep_copy():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    p = model.transformer.h[0].attn.c_attn.weight
    assert isinstance(p, pt.ManagedParameter) and isinstance(p, torch.nn.Parameter)
    assert repr(p).startswith("Parameter containing:\ntensor(")
    copied = copy.deepcopy(model)
    assert {type(q) for q in copied.parameters()} == {torch.nn.Parameter}
    assert all(torch.equal(a, b) for a, b in zip(copied.parameters(), model.parameters()))
    engine.close()
    assert {type(q) for q in model.parameters()} == {torch.nn.Parameter}


class UnfreezeBlocks(pl.callbacks.BaseFinetuning):
    """Lightning's fine-tuning recipe: the transformer blocks frozen in epoch 0, unfrozen with a
    param group of their own (lr / 10) at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.model.transformer.h)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.transformer.h, optimizer, train_bn=True)


class Finetuned(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = MODELS["gpt2"]()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=3e-3, fused=True)


@pytest.mark.parametrize("plan", ["streamed", "mixed", "persistent"])
def test_blocks_unfrozen_by_base_finetuning_train_as_under_the_default_strategy(plan):
    """Unfreezing between epochs with a new param group (it was 3e-2 off after epoch 1: the
    chunks kept no states for the unfrozen weights): the strategy builds the engine again for
    the parameters that train now, with the weights and the optimizer state it had."""

    def run(strategy):
        torch.manual_seed(1234)
        module = Finetuned()
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[UnfreezeBlocks()]).fit(module, _loader(1))
        return module.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}

    losses, weights = run(ProTrainStrategy(plans(n_chunks(Finetuned()))[plan]))
    ref_losses, ref_weights = run("auto")
    assert len(losses) == 8 and losses == ref_losses
    for k, v in ref_weights.items():
        assert torch.equal(weights[k], v), k
    block = "model.transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(weights[block], Finetuned().state_dict()[block])  # the blocks trained in epoch 1


def test_the_core_api_refuses_a_step_after_the_parameters_that_train_changed():
    model = MODELS["gpt2"]()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if ".h." not in n], lr=3e-3)
    for p in model.transformer.h.parameters():
        p.requires_grad_(False)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    engine.zero_grad()
    for p in model.transformer.h.parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(model.transformer.h.parameters())})
    with pytest.raises(RuntimeError, match=r"requires_grad of transformer.h.0.* changed.*engine.states.optimizer\(\)"):
        engine.module(input_ids=x, labels=x)
    osd = engine.states.optimizer()
    engine.close()
    opt.load_state_dict(osd)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    assert engine.states.optimizer()["state"].keys() == set(range(len(list(model.parameters()))))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_what_a_use_outside_the_modules_returns_is_safe_to_keep(precision):
    """Through one buffer, in a pass: views of every parameter (``torch.cat`` of ``p.view(-1)``)
    and detached parameters kept past their chunk's release hold their values (a view of a
    device copy read freed memory: a crash); an in-place write under ``no_grad`` is kept by the
    chunk (a release dropped it)."""
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu", precision=precision)
    dtype = pt.Precision(precision).compute_dtype
    x = batches(1)[0]
    loss = engine.module(input_ids=x, labels=x).loss
    assert torch.equal(torch.cat([p.view(-1) for p in model.parameters()]),
                       torch.cat([p.view(-1) for p in ref.parameters()]).to(dtype))
    kept = [p.detach() for p in model.parameters()]
    assert all(torch.equal(a, b.to(dtype)) for a, b in zip(kept, ref.parameters()))
    bias = model.transformer.h[0].mlp.c_fc.bias
    with torch.no_grad():
        bias.fill_(0.5)
    engine.backward(loss)
    assert bool((bias == 0.5).all()) and bool((engine.state_dict()["transformer.h.0.mlp.c_fc.bias"] == 0.5).all())


def test_fabric_builds_the_engine_again_when_blocks_are_unfrozen():
    """Blocks frozen for two steps, then unfrozen with a param group of their own: the Fabric
    strategy builds the engine again before the next training forward; bitwise Fabric's default."""

    def run(strategy):
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model = MODELS["gpt2"]()
        for p in model.transformer.h.parameters():
            p.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, fused=True)
        model, opt = fabric.setup(model, opt)
        losses = []
        for k, x in enumerate(batches(4)):
            if k == 2:
                for p in model.transformer.h.parameters():
                    p.requires_grad_(True)
                opt.add_param_group({"params": list(model.transformer.h.parameters()), "lr": 1e-3})
            loss = model(input_ids=x, labels=x).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses, _weights(fabric, model)

    _same_as_fabrics_default(run)


@pytest.mark.parametrize("plain_backward", [False, True], ids=["engine.backward", "loss.backward"])
@pytest.mark.parametrize("plan", ["streamed", "mixed"])
def test_the_core_api_habits_on_the_simulated_gpus_asynchronous_path(plan, plain_backward):
    """The same loop as ``test_the_core_api_reads_parameters_and_gradients_as_pytorch_does`` on
    the CUDA code path (streams, events, the CPU worker on its own thread: the simulated device
    with small real tensors): a penalty and a read outside the modules, p.grad clipped in place,
    optimizer.zero_grad, ``engine.backward(loss)`` or ``loss.backward()`` -- bitwise plain
    PyTorch in fp32."""
    from protrain_core.simulator.device import SimulatedDevice

    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    expected = _core_loop(ref, ref_opt, ref_opt.step, lambda loss: loss.backward(), ref_opt.zero_grad)
    sim = SimulatedDevice("h100", tensors="cpu")
    with sim:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        engine = pt.wrap(model, opt, plans(n_chunks(model))[plan], device=sim,
                         config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
        assert engine.scheduler.worker.threaded
        backward = (lambda loss: loss.backward()) if plain_backward else engine.backward
        got = _core_loop(engine.module, opt, engine.step, backward, opt.zero_grad)
    assert got == expected
    sd = engine.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("plan", ["streamed", "persistent"])
def test_the_models_own_zero_grad_clears_the_chunks_as_torchs_clears_grad(plan):
    """A loop that zeroes with ``model.zero_grad()`` (as Hugging Face's Trainer does, and
    Lightning before each stage and each validation run) before each backward, and never through
    the optimizer: the same losses and weights as PyTorch's (the chunks kept the last step's
    gradients, and the next backward added to them). A deep copy's ``zero_grad`` (an EMA's)
    clears its own gradients only, not the engine's."""
    data = batches(3)
    ref = MODELS["gpt2"]()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plans(n_chunks(model))[plan], device="cpu")
    ema = copy.deepcopy(model)
    losses, ref_losses = [], []
    for x in data:
        ref.zero_grad()
        ref_losses.append(ref(input_ids=x, labels=x).loss)
        ref_losses[-1].backward()
        ref_opt.step()
        model.zero_grad()
        losses.append(engine.module(input_ids=x, labels=x).loss)
        engine.backward(losses[-1])
        ema.zero_grad()
        engine.step()
    assert [loss.item() for loss in losses] == [loss.item() for loss in ref_losses]
    state = engine.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())


def _clear(block, how):
    if how == "zero_grad":
        block.zero_grad()
    else:
        for p in block.parameters():
            p.grad = None


def _loop(model, backward, step, data, *, how="zero_grad", clear_between=(), forward=None):
    """Each step: forward (``forward``: default ``model``), backward, the blocks ``clear_between``
    cleared, step, then the first two blocks only cleared (the others' gradients accumulate):
    by ``zero_grad()`` or ``p.grad = None``."""
    losses = []
    for x in data:
        losses.append((forward or model)(input_ids=x, labels=x).loss)
        backward(losses[-1])
        for k in clear_between:
            _clear(model.transformer.h[k], how)
        step()
        for block in model.transformer.h[:2]:
            _clear(block, how)
    return [loss.item() for loss in losses]


@pytest.mark.parametrize("how", ["zero_grad", "p.grad = None"])
@pytest.mark.parametrize("plan", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
def test_a_submodules_own_zero_grad_clears_its_parameters_gradients_as_torchs(plan, how):
    """A loop that clears only some parts' gradients after each step, by their own
    ``zero_grad()`` (PyTorch's DCGAN example: ``netD.zero_grad()``) or ``p.grad = None``: those
    parameters start afresh and the others accumulate, as in PyTorch, on every plan. Before,
    both cleared nothing after a step (``p.grad`` reads None there: the gradients live in the
    chunks), so the next update used the stale gradients."""
    data = batches(4)
    ref = MODELS["gpt2"]()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), standard_plans(model)[plan], device="cpu")
    ref_losses = _loop(ref, lambda loss: loss.backward(), ref_opt.step, data, how=how)
    assert _loop(engine.module, engine.backward, engine.step, data, how=how) == ref_losses
    state = engine.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())


def _sharded_clears(rank, world):
    """On each rank: DDP, then ProTrain sharded over the two processes (a streamed plan), the
    loop of partial clears after each step, by ``zero_grad()`` and by ``p.grad = None``."""
    data = batches(3, seed=10 + rank)
    out = []
    for how in ("zero_grad", "p.grad = None"):
        ref = torch.nn.parallel.DistributedDataParallel(MODELS["gpt2"]())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
        ref_losses = _loop(ref.module, lambda loss: loss.backward(), ref_opt.step, data, how=how, forward=ref)
        model = MODELS["gpt2"]()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=2),
                         device="cpu")
        losses = _loop(engine.module, engine.backward, engine.step, data, how=how)
        weights = engine.state_dict()
        diff = max((weights[k] - v).abs().max().item() for k, v in ref.module.state_dict().items()) if rank == 0 else 0
        out.append((how, ref_losses, losses, diff))
    return out


def test_partial_clears_on_two_processes_train_as_ddp(tmp_path):
    """The same partial clears with the chunks sharded over two gloo processes (each rank clears
    its pieces): DDP's losses and weights. The blocks not cleared keep gradients across steps,
    which DDP reduces summed with the next backward's and ProTrain reduces alone and adds: the
    last bits differ (the tolerance of tests/test_several_optimizers.py's two-process test)."""
    from _distributed import spawn

    for rank, results in enumerate(spawn(_sharded_clears, 2, tmp_path)):
        for how, ref_losses, losses, diff in results:
            assert losses == pytest.approx(ref_losses, abs=1e-5) and diff < 1e-4, (rank, how, diff)


def test_a_submodules_zero_grad_between_backward_and_step_clears_or_is_refused():
    """Between backward and step, a block's ``zero_grad()`` clears its gradients as torch's (all
    chunks persistent: the update waits for step); where backward already updated the block's
    offloaded chunk with them, it is refused with the fix, before anything is cleared."""
    data = batches(3)
    ref = MODELS["gpt2"]()
    model, streamed = copy.deepcopy(ref), copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    ref_losses = _loop(ref, lambda loss: loss.backward(), ref_opt.step, data, clear_between=(1,))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), standard_plans(model)["all-persistent"],
                     device="cpu")
    assert _loop(engine.module, engine.backward, engine.step, data, clear_between=(1,)) == ref_losses
    state = engine.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    engine = pt.wrap(streamed, torch.optim.AdamW(streamed.parameters(), lr=3e-3), pt.Plan(n_persist=0, n_buffer=1),
                     device="cpu")
    x = data[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()  # (from the second step on, backward updates each offloaded chunk)
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match=r"cleared \(zero_grad\(\), p.grad = None\) between backward and step, "
                                           r"but ProTrain had already updated its \(offloaded\) chunk"):
        streamed.transformer.h[1].zero_grad()
    assert all(c.has_gradients for c in engine.chunks)  # nothing was cleared


def _skipping(model, backward, step, zero_grad, data, skip=2):
    """A loop that skips batch ``skip``'s step (a loss it does not trust): zero_grad, no step."""
    losses = []
    for k, x in enumerate(data):
        zero_grad()
        losses.append(model(input_ids=x, labels=x).loss)
        backward(losses[-1])
        if k != skip:
            step()
    return [loss.item() for loss in losses]


@pytest.mark.parametrize("plan", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
def test_a_step_skipped_by_zero_grad_after_backward_is_exact_when_held_and_refused_otherwise(plan):
    """``zero_grad()`` after backward and no step (skipping a batch): with the updates held until
    step (``engine.clipping.expect_late()``), the batch is skipped as in PyTorch, on every plan.
    Without, the offloaded chunks were updated during backward (from the second step on) and
    the skip is refused with that fix; all persistent, nothing was updated and it is exact.
    Before, the skip was taken for the persistent chunks only, silently."""
    data = batches(5, distinct=5)
    ref = MODELS["gpt2"]()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    ref_losses = _skipping(ref, lambda loss: loss.backward(), ref_opt.step, ref_opt.zero_grad, data)
    for held in (True, False):
        model = MODELS["gpt2"]()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        engine = pt.wrap(model, opt, standard_plans(model)[plan], device="cpu")
        if held:
            engine.clipping.expect_late()
        elif plan != "all-persistent":
            with pytest.raises(RuntimeError, match=r"cleared \(zero_grad\(\), p.grad = None\) between backward and "
                                                   r"step.*engine.clipping.expect_late\(\)"):
                _skipping(engine.module, engine.backward, engine.step, opt.zero_grad, data)
            continue
        assert _skipping(engine.module, engine.backward, engine.step, opt.zero_grad, data) == ref_losses, held
        state = engine.state_dict()
        assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())


def test_a_clipped_step_after_a_submodules_zero_grad_takes_the_norm_without_its_gradients():
    """Clipping by norm configured ahead (every update waits for the norm, streamed chunks too),
    a block's ``zero_grad()`` between backward and step: the norm is taken again, without that
    block's gradients, as ``clip_grad_norm_`` after torch's ``zero_grad`` takes it."""
    data = batches(3)
    ref = MODELS["gpt2"]()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)

    def clipped_step():
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()

    ref_losses = _loop(ref, lambda loss: loss.backward(), clipped_step, data, clear_between=(1,))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=2),
                     device="cpu", config=pt.ProTrainConfig(clipping=("norm", 0.5)))
    assert _loop(engine.module, engine.backward, engine.step, data, clear_between=(1,)) == ref_losses
    state = engine.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())


def test_a_zero_grad_set_on_the_model_itself_is_called_and_put_back():
    """A ``zero_grad`` the model holds on itself (Lightning's hook tests record calls so) runs
    inside the engine's route, and is the model's again once the engine closes."""
    model = MODELS["gpt2"]()
    calls = []
    model.zero_grad = lambda set_to_none=True: calls.append(set_to_none)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    model.zero_grad()
    assert calls == [True] and not any(c.has_gradients for c in engine.chunks)
    engine.close()
    model.zero_grad(False)
    assert calls == [True, False]


class _SelfClamped(torch.nn.Module):
    """A stem that renormalises its rows in forward (``nn.Embedding(max_norm=...)``) and blocks
    that clamp their own weight in forward before using it: writes in place through the
    parameters, inside the modules that own them."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            with torch.no_grad():
                self.a.weight.clamp_(-0.1, 0.1)
            return x + self.b(torch.tanh(self.a(x)))

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16, max_norm=1.0)
        self.blocks = torch.nn.ModuleList(self.Block() for _ in range(4))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).square().mean()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_parameter_written_in_place_by_its_own_module_keeps_the_write(precision):
    """Writes into a parameter inside the forward of the module that owns it reach the weights
    the optimizer updates, on every plan: streamed chunks take them before their device copy goes,
    and in bf16-mixed (where the module writes the compute copy) before each update, the
    unwritten elements keeping the fp32 master's bits (else updates below bf16's resolution would
    be rounded away each step). fp32: bitwise plain PyTorch. Before, the writes were lost."""
    data = [torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(k)) for k in range(STEPS)]
    lr = 3e-2 if precision == "32-true" else 1e-4
    ref = _SelfClamped()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, fused=True)
    ref_losses = []
    for x in data:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = ref(x)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    start = _SelfClamped().blocks[0].a.weight.detach()
    for name, plan in plans(6).items():
        model = _SelfClamped()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=lr), plan, device="cpu",
                         precision=precision, example_inputs=(data[0],),
                         config=pt.ProTrainConfig(planning=pt.PlanningConfig(chunk_size=16 * 16 * 2 + 32)))
        losses = []
        for x in data:
            loss = engine.module(x)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        state = engine.state_dict()
        if precision == "32-true":
            assert losses == ref_losses, name
            assert_same_weights(state, ref, atol=0.0)
            continue
        assert losses == pytest.approx(ref_losses, rel=1e-2), name
        for k in range(4):  # clamped in the last forward, then one update away, as plain's
            assert state[f"blocks.{k}.a.weight"].abs().max() <= ref.blocks[k].a.weight.abs().max() + 1e-3, (name, k)
        inside = start.abs() < 0.05  # never clamped: they follow plain's fp32 weights
        moved = (ref.blocks[0].a.weight.detach() - start)[inside].abs().max()
        assert (state["blocks.0.a.weight"] - ref.blocks[0].a.weight.detach())[inside].abs().max() < 0.1 * moved, name
        assert state["emb.weight"][data[-1].unique()].norm(dim=1).max() <= 1.0 + 1e-2, name


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("how", ["data", "detach"])
def test_a_write_through_what_p_data_returned_reaches_the_chunk(precision, how):
    """Lightning's weight averaging swaps the averages in and out with ``p.data.copy_(x)``; users
    write through ``p.detach()`` too. What such a read returned (a copy, for a resident streamed
    chunk's parameter, as after a validation forward; the compute copy in bf16-mixed) is watched
    until the next forward or state read, which take a write into it into the chunk, on every plan: in fp32 plain PyTorch's
    training bit for bit; in bf16-mixed the written values as the compute copy holds them. Before,
    such writes were lost (a copy), or never reached the fp32 masters."""
    data = batches(4)
    read = (lambda p: p.data) if how == "data" else (lambda p: p.detach())
    for name, plan in standard_plans(MODELS["gpt2"]()).items():
        model = MODELS["gpt2"]()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu", precision=precision)
        losses, ref_losses = [], []
        for k, x in enumerate(data):
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
                ref_loss = ref(input_ids=x, labels=x).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = engine.module(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
            if k == 1:  # after a validation forward (resident chunks), halve every weight: read, read again, write
                with torch.no_grad():
                    engine.module(input_ids=x)
                before = engine.state_dict()
                for p, r in zip(model.parameters(), ref.parameters()):
                    half = read(p).float() * 0.5
                    read(p).copy_(half)
                    r.data.copy_(r.data * 0.5)
                state = engine.state_dict()
                for n, r in ref.named_parameters():  # (bf16-mixed: the compute copy's bits of the halves)
                    expected = r.detach() if precision == "32-true" else (before[n] * 0.5).to(torch.bfloat16).float()
                    torch.testing.assert_close(state[n], expected, atol=0, rtol=0, msg=f"{name}: {n}")
        if precision == "32-true":
            assert losses == ref_losses, name
            assert_same_weights(engine.state_dict(), ref)
        else:
            assert losses == pytest.approx(ref_losses, rel=2e-2), name
        engine.close()


@pytest.mark.parametrize("plan", ["streamed", "persistent"])
@pytest.mark.parametrize("change", ["resize_token_embeddings", "to bfloat16"])
def test_a_parameter_given_another_shape_or_dtype_after_wrap_is_refused_with_the_fix(plan, change):
    """``resize_token_embeddings()`` or ``model.to(torch.bfloat16)`` after wrap rebind parameters to
    tensors of another shape or dtype, which plain PyTorch's AdamW refuses at its step. Before, a
    streamed chunk silently took the bf16 values back as fp32 (and a resized embedding went back
    to its old size, its export unloadable); a persistent one failed deep inside. Now it is
    refused at once or at the next forward, naming the parameter and the fix."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plans(n_chunks(model))[plan],
                     device="cpu")
    x = batches(1)[0]
    engine.backward(model(input_ids=x, labels=x).loss)
    engine.step()
    engine.zero_grad()
    with pytest.raises(RuntimeError, match=r"'transformer\.wte\.weight' now holds a tensor of shape .* after wrap.*"
                                           r"before wrap"):  # (at the change, or at the next forward)
        if change == "resize_token_embeddings":
            model.resize_token_embeddings(VOCAB + 8)
        else:
            model.to(torch.bfloat16)
        model(input_ids=x, labels=x)
    engine.close(after_failure=True)
