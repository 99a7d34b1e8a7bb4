"""Trainer(strategy="protrain"): parity with Lightning's default strategy, precision flags,
optimizers and schedulers, accumulation, clipping, checkpoints and errors."""

import functools
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_protrain
import protrain_core as pt
from conftest import MODELS, SEQ, VOCAB, n_chunks
from lightning_protrain import ProTrainStrategy

STEPS = 6


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def info_lines():
    """What the strategy reports through ``rank_zero_info`` (Lightning's own logger, whose stream
    handler was bound before pytest captured the output)."""
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("lightning.pytorch")
    handler, level = Collect(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield lines
    log.removeHandler(handler)
    log.setLevel(level)


class LitLM(pl.LightningModule):
    def __init__(self, arch="gpt2", lr=3e-3, schedule=False, groups=False, optimizer="adamw", n_layer=4):
        super().__init__()
        self.model = MODELS[arch](n_layer=n_layer)
        self.lr, self.schedule, self.groups, self.optimizer_name = lr, schedule, groups, optimizer
        self.losses = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())  # not called for the profiler's steps

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", self.model(input_ids=x, labels=x).loss)

    def test_step(self, batch, batch_idx):
        (x,) = batch
        self.log("test_loss", self.model(input_ids=x, labels=x).loss)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.groups:
            decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
            rest = [p for n, p in self.named_parameters() if p.dim() < 2]
            params = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": self.lr / 2}]
        else:
            params = self.parameters()
        opt = torch.optim.AdamW(params, lr=self.lr, fused=True)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n=24, batch=4, seed=1, shuffle=True):
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g))
    return DataLoader(data, batch_size=batch, shuffle=shuffle)


def trainer(strategy="auto", **kw):
    kw = {"max_steps": STEPS, "limit_val_batches": 0, "enable_checkpointing": False, **kw}
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def fit(strategy="auto", module_kw=None, module=LitLM, **trainer_kw):
    """``module(**module_kw)`` trained from seed 1234 on ``loader()``: (module, trainer)."""
    torch.manual_seed(1234)
    lit = module(**(module_kw or {}))
    t = trainer(strategy, **trainer_kw)
    t.fit(lit, loader())
    return lit, t


def weights(lit):
    return {k: v.detach().float().clone() for k, v in lit.model.state_dict().items()}


def assert_same(a, b, rtol=0.0, atol=0.0):
    assert a[0].losses == pytest.approx(b[0].losses, rel=rtol, abs=atol) if rtol or atol else a[0].losses == b[0].losses
    wa, wb = weights(a[0]), weights(b[0])
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=atol, msg=k)


PLANS = {"persistent": dict(n_persist=100, n_buffer=0), "streamed": dict(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2)}


def _plan(name, lit_chunks=6):
    d = dict(PLANS[name])
    d["n_persist"] = min(d["n_persist"], lit_chunks)
    return pt.Plan(**d)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fit_by_name_equals_default_strategy(arch):
    """Searched plan, strategy by name: the same losses and weights as Lightning's default."""
    ref = fit("auto", {"arch": arch})
    got = fit("protrain", {"arch": arch})
    assert_same(got, ref)
    assert got[0].model.transformer.h[0].attn.c_attn.weight.device.type == "cpu" if arch == "gpt2" else True


def test_weight_averaging_averages_the_same_weights_as_under_the_default_strategy():
    """Lightning's EMA callback (its deep copy of the module is made at setup, before the engine
    wraps it; a copy of the wrapped model: test_parity) averages the parameters after every step
    and, when training ends, copies the averages into the module: under ProTrain (a streaming
    plan) the module ends with the default strategy's averages bit for bit."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    runs = [fit(strategy, callbacks=[EMAWeightAveraging(decay=0.5)])
            for strategy in ("auto", ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2)))]
    assert_same(runs[1], runs[0])
    trained = fit("auto")  # the averages are not the trained weights: the callback ran
    assert not torch.equal(weights(trained[0])["lm_head.weight"], weights(runs[0][0])["lm_head.weight"])


@pytest.mark.parametrize("plan", [pt.Plan(n_persist=1, n_buffer=2), pt.Plan(n_persist=0, n_buffer=1)],
                         ids=["mixed", "streamed"])
def test_weight_averaging_swapped_in_for_validation_trains_as_under_the_default_strategy(plan):
    """The EMA callback swaps the averages into the module for each validation and back after it
    (``p.data.copy_``; a resident streamed chunk's ``p.data`` is a copy): training goes on from the
    trained weights, the validation sees the averages, and the module ends with them, bit for bit
    as under the default strategy. Before, half of each swap was lost on streaming plans."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    runs = []
    for strategy in ("auto", ProTrainStrategy(plan)):
        torch.manual_seed(1234)
        lit = LitLM()
        t = trainer(strategy, callbacks=[EMAWeightAveraging(decay=0.5)], limit_val_batches=2, val_check_interval=2)
        t.fit(lit, loader(), loader(n=8, shuffle=False))
        runs.append((lit, t))
    assert_same(runs[1], runs[0])
    assert runs[1][1].callback_metrics["val_loss"] == runs[0][1].callback_metrics["val_loss"]


class _RaisingInBackward(LitLM):
    """Raises from a block's backward hook at the third step (an error, or Ctrl-C, mid-backward)."""

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 2:
            def raising(*_):
                raise ValueError("the user's error in backward")
            self.model.transformer.h[1].register_full_backward_hook(raising)


def test_a_checkpoint_on_an_exception_inside_backward_is_refused_not_written_half_stepped(tmp_path):
    """Lightning's OnExceptionCheckpoint saves after the error; in backward, a streaming plan has
    already updated some chunks with that step's gradients, and Lightning resumes from the file
    by default, which would take their update twice. The save is refused (the user's error is its
    context) and no file is written; with every chunk persistent the file is the default strategy's."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    for strategy, written in (("auto", True), (ProTrainStrategy(_plan("persistent")), True),
                              (ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=1)), False)):
        torch.manual_seed(1234)
        folder = tmp_path / str(written) / type(strategy).__name__
        t = trainer(strategy, callbacks=[OnExceptionCheckpoint(folder)], enable_checkpointing=True)
        with pytest.raises((ValueError, RuntimeError)) as raised:
            t.fit(_RaisingInBackward(), loader())
        if written:
            assert raised.type is ValueError and (folder / "on_exception.ckpt").is_file()
            continue
        assert "whose step has not run" in str(raised.value), raised.value
        assert "the user's error in backward" in str(raised.value.__context__)
        assert not (folder / "on_exception.ckpt").exists()


def test_fit_by_instance_with_a_streaming_plan_equals_default():
    plan = pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2)
    ref = fit("auto")
    got = fit(ProTrainStrategy(plan))
    assert_same(got, ref)
    got2 = fit(ProTrainStrategy({"n_persist": 0, "n_buffer": 1}))
    assert_same(got2, ref)


def test_deterministic_algorithms_train_as_under_the_default_strategy():
    """``Trainer(deterministic=True)`` (``torch.use_deterministic_algorithms``, what makes compiled
    runs bitwise: docs/guide/lightning.md) runs every op ProTrain adds, on a streaming plan with
    swapped and checkpointed blocks, and trains as the default strategy does under it."""
    try:
        ref = fit("auto", deterministic=True)
        got = fit(ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2)), deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert_same(got, ref)


def test_an_async_checkpoint_io_writes_what_the_default_strategy_writes(tmp_path):
    """``plugins=[AsyncCheckpointIO()]`` with no IO inside: the wrapper writes through ProTrain's
    own IO (as Lightning's strategies put theirs inside), and the file holds the weights the
    default strategy's holds."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    saved = {}
    for name, strategy in (("default", "auto"), ("protrain", ProTrainStrategy(_plan("streamed")))):
        _, t = fit(strategy, plugins=[AsyncCheckpointIO()])
        t.save_checkpoint(tmp_path / f"{name}.ckpt")
        t.strategy.checkpoint_io.teardown()  # waits for the write, and raises its error
        saved[name] = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)["state_dict"]
    assert saved["protrain"].keys() == saved["default"].keys()
    assert all(torch.equal(saved["protrain"][k], saved["default"][k]) for k in saved["default"])


def test_accumulation_scheduler_and_param_groups_equal_default():
    kw = {"schedule": True, "groups": True}
    ref = fit("auto", kw, accumulate_grad_batches=2)
    got = fit(ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2, n_checkpoint=2)), kw, accumulate_grad_batches=2)
    assert_same(got, ref)


@pytest.mark.parametrize("algorithm,value", [("norm", 0.05), ("value", 0.002)])
def test_gradient_clipping_equals_default(algorithm, value):
    plan = pt.Plan(n_persist=1, n_buffer=2, n_swap=1)
    ref = fit("auto", gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    got = fit(ProTrainStrategy(plan), gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    assert_same(got, ref)
    unclipped = fit("auto")
    assert unclipped[0].losses != ref[0].losses  # the clipping really acted


class NormRecorder(pl.Callback):
    """Per step: the logged ``grad_norm`` (ProTrain's strategy logs it when clipping by norm),
    and the total norm of the ``.grad`` the default strategy's optimizer is about to use."""

    def __init__(self):
        self.logged, self.computed, self.overlap = [], [], None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self.computed.append(torch.nn.utils.get_total_norm(grads))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "grad_norm" in trainer.callback_metrics:
            self.logged.append(trainer.callback_metrics["grad_norm"].clone())
        engine = getattr(trainer.strategy, "engine", None)
        self.overlap = engine.overlap if engine is not None else None


def test_gradient_clip_val_logs_the_total_norm():
    """``grad_norm`` logged by the strategy equals the total norm before clipping that plain
    PyTorch computes from the same gradients, at every step."""
    plan = pt.Plan(n_persist=0, n_buffer=1)
    ref_norms, got_norms = NormRecorder(), NormRecorder()
    ref = fit("auto", gradient_clip_val=0.05, callbacks=[ref_norms])
    got = fit(ProTrainStrategy(plan), gradient_clip_val=0.05, callbacks=[got_norms])
    assert_same(got, ref)
    assert torch.equal(torch.stack(got_norms.computed), torch.stack(ref_norms.computed))  # p.grad as the default's
    assert len(got_norms.logged) == STEPS and torch.equal(torch.stack(got_norms.logged), torch.stack(ref_norms.computed))
    assert got_norms.overlap == "cpu-adam-during-next-forward (gradient norm clipping)"


class ClipOddSteps(LitLM):
    """Clips by norm at odd steps only, with a value of its own."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.trainer.global_step % 2 == 1:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("plan", [dict(n_persist=0, n_buffer=1), dict(n_persist=1, n_buffer=2, n_checkpoint=1)], ids=str)
def test_overridden_configure_gradient_clipping_equals_default(plan):
    recorder = NormRecorder()

    def run(strategy):
        return fit(strategy, module=ClipOddSteps, callbacks=[recorder])

    ref = run("auto")
    got = run(ProTrainStrategy(pt.Plan(**plan)))
    assert_same(got, ref)
    assert recorder.overlap == "cpu-adam-during-next-forward (gradient clipping or gradient changes expected after backward)"
    unclipped = fit("auto")
    assert unclipped[0].losses != ref[0].losses  # the clipping acts


class WeightSums(pl.Callback):
    """Reads every weight after each optimizer step, before the next forward (as an EMA does)."""

    def __init__(self):
        self.sums = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.sums.append([p.detach().double().sum().item() for p in pl_module.parameters()])


class ResetWeights(pl.Callback):
    """At step 3, rebinds every weight matrix's ``.data`` to a scaled copy and shrinks the biases
    in place: the lottery-ticket reset of Lightning's ModelPruning rebinds ``p.data``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 3:
            return
        with torch.no_grad():
            for p in pl_module.parameters():
                if p.dim() >= 2:
                    p.data = p.detach().clone() * 0.5
                else:
                    p.mul_(0.5)


@pytest.mark.parametrize("plan", ["persistent", "streamed"])
def test_parameter_writes_between_steps_survive_like_under_the_default_strategy(plan):
    """Both kinds of writes by a callback between steps train on and end in the weights after
    fit: in-place writes, and ``p.data = tensor`` rebinding (before: rebinding was lost, the
    chunks kept the old values)."""
    def run(strategy):
        return fit(strategy, callbacks=[ResetWeights()])

    assert_same(run(ProTrainStrategy(_plan(plan, n_chunks(LitLM())))), run("auto"))


class OffloadBetweenSteps(pl.Callback):
    """Lends the device away between steps, as an RL trainer's generation phase would."""

    def __init__(self):
        self.offloaded = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.onload_states()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        handle = trainer.strategy.offload_states()
        self.offloaded.append(handle is not None and trainer.strategy.engine.memory.device_bytes() == 0)


@pytest.mark.parametrize("plan", ["persistent", "streamed"])
def test_states_offloaded_by_a_callback_between_steps_train_on_like_the_default_strategy(plan):
    """``trainer.strategy.offload_states()`` / ``onload_states()`` from a callback, with
    gradient accumulation (an offload between micro-batches keeps the gradients): the losses and
    weights of Lightning's default strategy; the last offload is still in place at teardown."""
    cb = OffloadBetweenSteps()
    got = fit(ProTrainStrategy(_plan(plan, n_chunks(LitLM()))), callbacks=[cb], accumulate_grad_batches=2)
    assert cb.offloaded and all(cb.offloaded)
    assert_same(got, fit("auto", accumulate_grad_batches=2))
    assert got[1].strategy.offload_states() is None  # after fit: nothing to move


class OffloadOnly(pl.Callback):
    """Offloads at the end of a batch and onloads only where ``onload_at`` says."""

    def __init__(self, onload_at):
        self.onload_at, self.ran = onload_at, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if "train" in self.onload_at:
            trainer.strategy.onload_states()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.offload_states()

    def on_validation_batch_start(self, *args):
        self.ran.append("validation")

    def on_before_backward(self, *args):
        self.ran.append("backward")


@pytest.mark.parametrize("onload_at,validate", [((), 0), (("train",), 1)])
def test_a_forward_on_offloaded_states_is_refused_before_anything_of_it_runs(onload_at, validate):
    """An onload forgotten before a training step (refused only at step() before, after its forward
    and backward) or before validation (which ran on the offloaded states without a word, then
    ``onload_states()`` failed with an internal IllegalTransition): refused at the model's first
    module, with the fix."""
    cb = OffloadOnly(onload_at)
    t = pl.Trainer(strategy=ProTrainStrategy(_plan("streamed")), accelerator="cpu", devices=1, max_steps=3,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, val_check_interval=1, limit_val_batches=validate, callbacks=[cb])
    with pytest.raises(RuntimeError, match=r"moved them to the host; call engine.onload_states\(\) first .*"
                                           r"on_validation_start"):
        t.fit(LitLM(), loader(), loader(n=4))
    # The first step's backward only; refused at the next step's forward, or at validation's
    assert cb.ran == ["backward", "validation"][:1 + validate]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_callbacks_read_the_updated_weights(clip, monkeypatch):
    """A callback reading the weights between a step and the next forward sees this step's
    weights, also when the offloaded chunks' updates overlap the next forward (clipping, with
    the worker thread a GPU uses)."""
    monkeypatch.setenv("PROTRAIN_CPU_ADAM_THREAD", "1")
    ref_sums, got_sums = WeightSums(), WeightSums()
    ref = fit("auto", gradient_clip_val=clip, callbacks=[ref_sums])
    got = fit(ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=1)), gradient_clip_val=clip, callbacks=[got_sums])
    assert_same(got, ref)
    assert got_sums.sums == ref_sums.sums


class SkipOddBatches(LitLM):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if outputs:  # Lightning hands {} for a skipped batch
            super().on_train_batch_end(outputs, batch, batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_step_returning_none_with_clipping_equals_default(accumulate):
    """Skipped batches (training_step returns None); with accumulation, the last micro-batch of
    each step: Lightning's plugin (no loss scaler) still steps with the gradients accumulated."""
    def run(strategy):
        return fit(strategy, module=SkipOddBatches, gradient_clip_val=0.05, accumulate_grad_batches=accumulate)

    assert_same(run(ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=1))), run("auto"))


class Manual(LitLM):
    """Manual optimization: manual_backward (or the plain loss.backward()) every batch,
    clip_gradients and a step every second batch (accumulation), toggle_optimizer around it."""

    def __init__(self, plain_backward=False):
        super().__init__()
        self.automatic_optimization = False
        self.plain_backward = plain_backward

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.toggle_optimizer(opt)
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        (loss / 2).backward() if self.plain_backward else self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        self.untoggle_optimizer(opt)
        self.losses.append(loss.item())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


@pytest.mark.parametrize("plain_backward", [False, True], ids=["manual_backward", "loss.backward"])
@pytest.mark.parametrize("plan", ["persistent", "streamed"])
def test_manual_optimization_trains_as_under_the_default_strategy(plan, plain_backward):
    """manual_backward (or loss.backward()), clip_gradients, opt.step() every second batch,
    zero_grad and toggle_optimizer train bitwise like the default strategy."""
    def run(strategy):
        return fit(strategy, module=Manual, module_kw={"plain_backward": plain_backward}, max_steps=4)

    ours, default = run(ProTrainStrategy(_plan(plan, n_chunks(LitLM())))), run("auto")
    assert len(ours[0].losses) == len(default[0].losses) == 8
    assert_same(ours, default)


class NoOptimizer(LitLM):
    """configure_optimizers returns None: forward and backward only; the gradients each
    backward leaves (accumulated, as nothing clears them) are recorded."""

    def configure_optimizers(self):
        return None

    def on_after_backward(self):
        self.grads = getattr(self, "grads", [])
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def on_before_optimizer_step(self, optimizer):  # (Lightning calls it for its stand-in too)
        self.before_step = getattr(self, "before_step", 0) + 1


class SaveEachStep(pl.Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_end(self, trainer, *args):
        trainer.save_checkpoint(self.folder / f"step{trainer.global_step}.ckpt")


@pytest.mark.parametrize("plan", ["persistent", "streamed"])
def test_a_fit_without_an_optimizer_runs_as_under_the_default_strategy(plan, tmp_path):
    """Lightning warns and runs training_step and backward with no step: the same losses and
    gradients as the default strategy, bit for bit, and the weights untouched; its checkpoints
    (saved during the fit) resume."""
    runs = {}
    for name, strategy in (("auto", "auto"), ("protrain", ProTrainStrategy(_plan(plan, n_chunks(LitLM()))))):
        with pytest.warns(UserWarning, match="will run with no optimizer"):
            runs[name] = fit(strategy, module=NoOptimizer, max_steps=3, callbacks=[SaveEachStep(tmp_path / name)])
    (ours, _), (default, _) = runs["protrain"], runs["auto"]
    assert len(ours.grads) == 3 and ours.losses == default.losses and ours.before_step == default.before_step == 3
    assert all(torch.equal(g[n], r[n]) for g, r in zip(ours.grads, default.grads) for n in r)
    torch.manual_seed(1234)
    assert all(torch.equal(a, b) for a, b in zip(weights(ours).values(), weights(NoOptimizer()).values()))
    resumed = NoOptimizer()
    with pytest.warns(UserWarning, match="will run with no optimizer"):
        trainer(ProTrainStrategy(_plan(plan, n_chunks(LitLM()))), max_steps=4).fit(
            resumed, loader(), ckpt_path=tmp_path / "protrain" / "step2.ckpt")
    assert len(resumed.grads) == 2


class ManualClosure(LitLM):
    """Manual optimization with the backwards inside a closure given to opt.step (two backwards
    of the same loss, as Lightning's own test of closures does)."""

    def __init__(self, arch="gpt2"):
        super().__init__(arch)
        self.automatic_optimization = False
        self.optimizers_calls = 0

    def optimizers(self, *args, **kwargs):
        self.optimizers_calls += 1
        return super().optimizers(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        (x,) = batch

        def closure():
            loss = self.model(input_ids=x, labels=x).loss
            self.manual_backward(loss / 2, retain_graph=True)
            self.manual_backward(loss / 2)
            self.losses.append(loss.item())

        opt.step(closure=closure)
        opt.zero_grad()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


class RawOptimizerStep(LitLM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.manual_backward(self.model(input_ids=x, labels=x).loss)
        self.optimizers(use_pl_optimizer=False).step()


def test_a_raw_optimizer_step_in_manual_optimization_is_refused_with_the_lightning_fix():
    """The torch optimizer itself (``self.optimizers(use_pl_optimizer=False)``) holds no gradients
    under ProTrain: its step is refused before it changes anything, naming what to step instead."""
    with pytest.raises(RuntimeError, match=r"step what self.optimizers\(\) returns, not use_pl_optimizer=False"):
        fit(ProTrainStrategy(_plan("streamed")), module=RawOptimizerStep)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("plan", ["persistent", "streamed"])
def test_manual_backwards_inside_a_step_closure_train_as_under_the_default_strategy(plan, arch):
    """opt.step(closure=...) runs the closure inside the strategy's optimizer_step: its backwards
    were taken for the step's final one, and the second was refused ("engine.backward() was
    called twice without engine.step()"). The strategy itself never calls the user's
    ``optimizers()`` (it did once at setup): only the user's code does, as often as under the
    default strategy. The second backward through the retained graph fetches the chunks of the
    units outside the blocks again (LLaMA's untied head, streamed: it crashed on a freed buffer)."""
    def run(strategy):
        return fit(strategy, {"arch": arch}, module=ManualClosure, max_steps=4)

    ours, default = run(ProTrainStrategy(_plan(plan, n_chunks(LitLM(arch))))), run("auto")
    assert len(ours[0].losses) == len(default[0].losses) == 4
    assert ours[0].optimizers_calls == default[0].optimizers_calls == 4
    assert_same(ours, default)


def test_lightning_module_backward_replaced_on_the_instance_runs_every_backward():
    """The default strategy calls ``LightningModule.backward`` for every backward, whatever it
    is; ProTrain called it only when it looked overridden, so a wrapper set on the instance
    around the inherited method (Lightning's hook-order test records calls so) never ran."""
    def run(strategy):
        torch.manual_seed(1234)
        lit = LitLM()
        calls = []

        @functools.wraps(lit.backward)  # a recording wrapper, as decorators make them
        def backward(loss, *a, **kw):
            calls.append(1)
            return original(loss, *a, **kw)

        original, lit.backward = lit.backward, backward
        trainer(strategy, accumulate_grad_batches=2).fit(lit, loader())
        return lit, calls

    (ours, ours_calls), (default, default_calls) = run(ProTrainStrategy(_plan("streamed"))), run("auto")
    assert len(ours_calls) == len(default_calls) == 2 * STEPS
    assert_same((ours, None), (default, None))


def test_a_step_driven_through_the_strategy_after_fit_runs_as_under_the_default_strategy():
    """After fit the engine is gone and the module and its optimizer are plain PyTorch again: a
    step driven through the strategy (``strategy.optimizer_step`` with a closure calling
    ``strategy.backward``, as Lightning's own loop tests do after fit) runs as under the default
    strategy. Before: AttributeError on the closed engine."""
    def run(strategy):
        torch.manual_seed(1234)
        lit = LitLM()
        t = trainer(strategy)
        t.fit(lit, loader())
        (x,) = next(iter(loader()))
        optimizer = t.optimizers[0]
        optimizer.zero_grad()  # (the default strategy leaves the last step's .grad behind)

        def closure():
            loss = lit.model(input_ids=x, labels=x).loss
            t.strategy.backward(loss, optimizer)
            return loss

        t.strategy.optimizer_step(optimizer, closure)
        return lit, None

    assert_same(run(ProTrainStrategy(_plan("streamed"))), run("auto"))


class DoubledBackward(LitLM):
    """Overrides LightningModule.backward: counts its calls and doubles the gradients."""

    def __init__(self):
        super().__init__()
        self.backward_calls = 0

    def backward(self, loss, *args, **kwargs):
        self.backward_calls += 1
        (loss * 2).backward(*args, **kwargs)


def test_an_overridden_backward_runs_every_step_as_under_the_default_strategy():
    """The default strategy calls LightningModule.backward for every backward; ProTrain used to
    call loss.backward() itself and never the override, silently."""
    def run(strategy):
        return fit(strategy, module=DoubledBackward, accumulate_grad_batches=2)

    ours, default = run(ProTrainStrategy(_plan("streamed"))), run("auto")
    assert ours[0].backward_calls == default[0].backward_calls == 2 * STEPS
    assert_same(ours, default)


def test_hugging_face_gradient_checkpointing_inside_a_lightning_module_is_refused_as_in_the_core():
    """Issue 18, case 5: the LightningModule holds the Hugging Face model: refused before any
    training step, with the fix, as wrap() refuses it on the model itself."""
    lit = LitLM()
    enable = getattr(lit.model, "activation_checkpointing_enable", None) or lit.model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="submodule 'model'.*gradient_checkpointing_disable"):
        trainer("protrain").fit(lit, loader())
    assert lit.losses == []  # training_step never ran


def test_a_bad_ckpt_path_is_refused_before_the_engine_is_built(tmp_path):
    """Issue 18, case 10: a truncated file, or one of another model, is reported before anything
    is built or profiled (the module takes the weights first; the engine takes them from it)."""
    t = trainer("protrain", max_steps=2)
    t.fit(LitLM(), loader())
    good = tmp_path / "good.ckpt"
    t.save_checkpoint(good)
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for path, lit, message in ((torn, LitLM(), "cannot be read.*truncated"),
                               (good, LitLM(n_layer=2), "Unexpected key"),
                               (good, LitLM(arch="llama"), "Missing key")):
        t = trainer("protrain", max_steps=4)
        with pytest.raises((ValueError, RuntimeError), match=message):
            t.fit(lit, loader(), ckpt_path=path)
        assert t.strategy.engine is None and lit.losses == []


def test_init_module_empty_init_builds_on_the_meta_device_and_the_engine_fills_the_chunks(tmp_path):
    """``trainer.init_module(empty_init=True)`` builds the LightningModule's parameters on the meta
    device (FSDP's builds it all there); the engine fills its chunks from ``ProTrainConfig.weights`` (a Hugging Face
    directory): the same losses and weights as the saved model under the default strategy. A
    ``ckpt_path`` fills them too (loaded into meta tensors its values would be lost): the run
    resumes as from a module on the host."""
    torch.manual_seed(1234)
    LitLM().model.save_pretrained(tmp_path / "hf")
    rng = torch.get_rng_state()  # (the data's order: as fit's after building its module)
    strategy = ProTrainStrategy(config=pt.ProTrainConfig(weights=str(tmp_path / "hf"),
                                                         planning={"plan": _plan("streamed")}))
    t = trainer(strategy)
    with t.init_module(empty_init=True):
        lit = LitLM()
    assert all(p.is_meta for p in lit.parameters())
    torch.set_rng_state(rng)
    t.fit(lit, loader())
    assert_same((lit, t), fit("auto"))
    t.validate(lit, loader())  # (an engine built again over the filled module: not filled again)
    assert_same((lit, t), fit("auto"))

    t.save_checkpoint(tmp_path / "six.ckpt")
    resumed = []
    for empty_init in (False, True):
        t = trainer(ProTrainStrategy(_plan("streamed")), max_steps=STEPS + 3)
        with t.init_module(empty_init=empty_init):
            lit = LitLM()
        torch.manual_seed(0)
        t.fit(lit, loader(), ckpt_path=tmp_path / "six.ckpt")
        resumed.append((lit, t))
    assert_same(*resumed)


class WithMetric(LitLM):
    def __init__(self):
        super().__init__()
        import torchmetrics

        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        return loss


def test_init_module_empty_init_puts_only_parameters_on_the_meta_device():
    """A torchmetrics metric built in the module (as examples/finetune.py's): its states are no
    parameters or buffers, which nothing could fill later, so they (and the buffers) are made on
    the host with their values; the parameters are meta until the engine fills the chunks. Before,
    fit ended in "Cannot copy out of meta tensor"."""
    t = trainer(ProTrainStrategy(_plan("streamed")))
    with t.init_module(empty_init=True):
        lit = WithMetric()
    assert all(p.is_meta for p in lit.parameters()) and not any(b.is_meta for b in lit.buffers())
    t.fit(lit, loader())
    assert lit.mean_loss.compute().item() == pytest.approx(sum(lit.losses) / len(lit.losses), rel=1e-6)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_init_module_builds_on_the_host_in_the_precision_dtype(precision):
    """``trainer.init_module()`` and ``fabric.init_module()`` without ``empty_init`` build on the
    host (as FSDP's do), not on the strategy's device (here "meta", which a test can tell from the
    host): a model larger than the device would not fit there. Under bf16-true the parameters are
    bf16, as the default strategy's HalfPrecision creates them (half the memory)."""
    from lightning.fabric import Fabric

    from lightning_protrain import ProTrainFabricStrategy

    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[precision]
    with trainer("auto", precision=precision).init_module():
        reference = LitLM()
    contexts = [lambda: trainer(ProTrainStrategy(device=torch.device("meta")), precision=precision).init_module(),
                lambda: Fabric(strategy=ProTrainFabricStrategy(device=torch.device("meta")), accelerator="cpu",
                               devices=1, precision=precision).init_module()]  # (Fabric's enters as it is made)
    for context in contexts:
        with context():
            lit = LitLM()
        assert {(p.device.type, p.dtype) for p in lit.parameters()} == \
            {(p.device.type, p.dtype) for p in reference.parameters()} == {("cpu", dtype)}
        assert torch.get_default_dtype() == torch.float32


def test_a_model_on_the_meta_device_that_cannot_be_filled_gets_the_clear_error_alone(tmp_path):
    """Issue 18, case 7: the refusal (here: weights= names no file) is the error the user sees,
    not a teardown failure after it (Lightning's teardown would move the meta module to the CPU)."""
    lit = LitLM()
    lit.model.to("meta")
    strategy = ProTrainStrategy(config=pt.ProTrainConfig(weights=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        trainer(strategy).fit(lit, loader())
    assert not isinstance(info.value.__context__, NotImplementedError)


def test_weights_for_a_model_built_on_the_host_are_refused_as_wrap_refuses_them(tmp_path):
    """``ProTrainConfig.weights`` fills a model built on the meta device; given a model built on the
    host, the Trainer and Fabric refuse it at setup, as ``wrap`` does (before, both trained from
    the random initialisation and said nothing)."""
    from lightning.fabric import Fabric

    from lightning_protrain import ProTrainFabricStrategy

    LitLM().model.save_pretrained(tmp_path / "hf")
    config = pt.ProTrainConfig(weights=str(tmp_path / "hf"), planning={"plan": _plan("streamed")})
    lit = LitLM()
    with pytest.raises(ValueError, match="all hold values already"):
        trainer(ProTrainStrategy(config=config)).fit(lit, loader())
    assert lit.losses == []
    fabric = Fabric(strategy=ProTrainFabricStrategy(config=config), accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="all hold values already"):
        fabric.setup(LitLM().model, torch.optim.AdamW(lit.parameters()))


def test_low_precision_parameters_under_32_true_are_refused_before_training():
    """Issue 18, case 6: the default strategy fails on the dtype mismatch in forward; ProTrain
    says what to do before any step."""
    lit = LitLM()
    lit.model.transformer.h[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="'32-true'.*bfloat16.*bf16-true"):
        trainer("protrain").fit(lit, loader())
    assert lit.losses == []


@pytest.mark.parametrize("strategy", ["protrain", "planned"])
def test_an_empty_train_dataloader_finishes_like_the_default_strategy(strategy, recwarn):
    """No training batch: Lightning warns and ``fit`` returns, as with the default strategy;
    the weights are the initial ones (issue 18, case 1)."""
    if strategy == "planned":
        strategy = ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=2))
    torch.manual_seed(1234)
    lit = LitLM()
    before = weights(lit)
    t = trainer(strategy, max_epochs=1, max_steps=-1)
    t.fit(lit, DataLoader(TensorDataset(torch.zeros(0, SEQ, dtype=torch.long)), batch_size=4))
    assert t.state.finished and t.global_step == 0 and lit.losses == []
    assert all(torch.equal(a, b) for a, b in zip(before.values(), weights(lit).values()))
    assert any("length of `DataLoader` across ranks is zero" in str(w.message) for w in recwarn)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_precision_flags_close_to_default(precision):
    """Close to Lightning's default strategy: the losses, and what training did to the weights.
    bf16-mixed: Lightning's autocast runs the embeddings (and other non-autocast ops) in fp32 on
    fp32 weights, the engine on its bf16 compute copy, so the weights are not close element by
    element; the update of every weight (final minus initial, over all parameters) is: within
    25 % in norm of the default's, in the same direction. Without Adam it would be 100 % off."""
    plan = pt.Plan(n_persist=1, n_buffer=2, n_checkpoint=1)
    torch.manual_seed(1234)
    initial = weights(LitLM())  # what fit() starts from
    ref = fit("auto", precision=precision)
    got = fit(ProTrainStrategy(plan), precision=precision)
    assert got[0].losses == pytest.approx(ref[0].losses, rel=2e-2)
    wa, wb = weights(got[0]), weights(ref[0])
    if precision == "bf16-true":  # the same arithmetic as plain bf16 PyTorch
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=2e-2, atol=2e-3, msg=k)
    delta_got = torch.cat([(wa[k] - initial[k]).flatten() for k in initial])
    delta_ref = torch.cat([(wb[k] - initial[k]).flatten() for k in initial])
    assert delta_ref.norm() > 0
    assert (delta_got - delta_ref).norm() < 0.25 * delta_ref.norm()
    assert got[1].strategy.precision_plugin.precision == precision


def fp16_plugin(**scaler_kw):
    """16-mixed on the CPU: Lightning's connector refuses the flag there (it is for GPUs), but
    takes the plugin -- the engine's fp16 mode and loss scaler run on any device."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", **scaler_kw) if scaler_kw else None
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def test_fp16_mixed_close_to_default_and_uses_the_users_scaler_settings(tmp_path):
    plan = pt.Plan(n_persist=1, n_buffer=2, n_checkpoint=1)
    ref = fit("auto", plugins=[fp16_plugin()])
    got = fit(ProTrainStrategy(plan), plugins=[fp16_plugin()])
    assert got[1].strategy.precision_plugin.precision == "16-mixed"
    assert got[0].losses == pytest.approx(ref[0].losses, rel=2e-2)
    # GradScaler(init_scale=2**8, growth_interval=2): six clean steps double the scale 3 times.
    lit, t = fit(ProTrainStrategy(plan), plugins=[fp16_plugin(init_scale=2.0**8, growth_interval=2)])
    t.save_checkpoint(tmp_path / "after_fit.ckpt")  # after teardown: the state kept from the engine
    (state,) = [v for k, v in torch.load(tmp_path / "after_fit.ckpt", weights_only=True).items() if k.endswith("Precision")]
    assert state == {"scale": 2.0**11, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
                     "_growth_tracker": 0}


@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_unsupported_precision_is_refused(precision):
    with pytest.raises(ValueError, match="does not support precision"):
        fit("protrain", precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_module_knows_its_dtype_and_moves_its_metrics_as_under_the_default_strategy(precision):
    """What ``module.to()`` does under Lightning's strategies, though ProTrain places the parameters
    itself: ``self.dtype`` is bf16 under bf16-true (code writes ``x.to(self.dtype)``), and a
    torchmetrics metric's state follows the module's dtype (and device: the same call, which only a
    GPU run can tell from the host's)."""
    import torchmetrics

    class Seen(LitLM):
        def __init__(self):
            super().__init__()
            self.mean = torchmetrics.MeanMetric()
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.mean.update(1.0)
            self.seen.append((self.device, self.dtype, self.mean.mean_value.device, self.mean.mean_value.dtype))
            return super().training_step(batch, batch_idx)

    runs = []
    for strategy in ("auto", ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2))):
        torch.manual_seed(1234)
        lit = Seen()
        trainer(strategy, precision=precision, max_steps=2).fit(lit, loader())
        runs.append(lit.seen)
    assert runs[1] == runs[0]
    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[precision]
    assert runs[0][0] == (torch.device("cpu"), dtype, torch.device("cpu"), dtype)


def test_bf16_true_converts_a_batch_as_the_default_strategy_does():
    """Both plugins turn a batch's floating-point tensors into bf16 as Lightning's HalfPrecision
    does: in dicts, lists, namedtuples and dataclasses; integer tensors and other leaves kept."""
    import collections
    import dataclasses

    from lightning.fabric.plugins.precision import HalfPrecision

    from lightning_protrain.fabric import ProTrainFabricPrecision
    from lightning_protrain.strategy import ProTrainPrecision

    Pair = collections.namedtuple("Pair", "x ids")

    @dataclasses.dataclass
    class Batch:
        pair: Pair
        weights: list

    batch = {"batch": Batch(Pair(torch.ones(2), torch.arange(2)), [torch.zeros(3, dtype=torch.float64), "s"]), "n": 3}
    expected = HalfPrecision("bf16-true").convert_input(batch)
    for plugin in (ProTrainPrecision("bf16-true"), ProTrainFabricPrecision("bf16-true", strategy=None)):
        got = plugin.convert_input(batch)
        assert type(got["batch"].pair) is Pair and got["n"] == 3 and got["batch"].weights[1] == "s"
        assert [t.dtype for t in (got["batch"].pair.x, got["batch"].pair.ids, got["batch"].weights[0])] == \
            [t.dtype for t in (expected["batch"].pair.x, expected["batch"].pair.ids, expected["batch"].weights[0])] == \
            [torch.bfloat16, torch.int64, torch.bfloat16]


@pytest.mark.parametrize("plan", [None, "streamed"])
def test_sgd_trains_like_the_default_strategy(plan):
    """Lightning's test models use SGD: it runs per chunk by torch's own class, bitwise."""
    strategy = "protrain" if plan is None else ProTrainStrategy(_plan(plan))
    assert_same(fit(strategy, {"optimizer": "sgd"}), fit("auto", {"optimizer": "sgd"}))


def test_an_optimizer_that_needs_whole_parameters_is_refused():
    class Factored(LitLM):
        def configure_optimizers(self):
            return torch.optim.Adafactor(self.parameters())

    with pytest.raises(ValueError, match="Adafactor per chunk: its second moment is factored"):
        trainer("protrain").fit(Factored(), loader())


class Plain(pl.LightningModule):
    """No repeated blocks: two Linear layers (Lightning's own test models are one Linear)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        return self.b(torch.tanh(self.a(batch[0]))).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


@pytest.mark.parametrize("plan", [None, pt.Plan(n_persist=0, n_buffer=1)], ids=["searched", "streamed"])
def test_a_model_without_blocks_trains_like_the_default_strategy(plan):
    """Any nn.Module trains: without repeated blocks its modules are the chunks' units and every
    activation is kept (a warning says so, and how to name blocks); before: refused."""
    def run(strategy):
        torch.manual_seed(0)
        lit = Plain()
        data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)
        trainer(strategy, max_steps=8).fit(lit, data)
        return {k: v.detach().clone() for k, v in lit.state_dict().items()}

    with pytest.warns(UserWarning, match=r"no repeated blocks in Plain.*ProTrainConfig\(planning=\{'blocks'"):
        ours = run(ProTrainStrategy(plan))
    reference = run("auto")
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


class Stemless(pl.LightningModule):
    """Named blocks and nothing before them: the first block takes the batch directly."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4))

    def training_step(self, batch, i):
        x = batch[0]
        for block in self.layers:
            x = block(x)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def test_named_blocks_taking_the_batch_directly_plan_automatically_like_the_default_strategy(info_lines):
    """The first block takes the batch (no stem before it): the live profiler started its forward
    at the first module with parameters, inside block 0, after block 0's own boundary, and the
    profile failed with KeyError (Boundary.FORWARD, 1) at the end of the profiled steps."""
    def run(strategy):
        torch.manual_seed(0)
        lit = Stemless()
        trainer(strategy, max_steps=8).fit(lit, DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))
        return {k: v.detach().clone() for k, v in lit.state_dict().items()}

    ours = run(ProTrainStrategy(config=pt.ProTrainConfig(planning=pt.PlanningConfig(blocks="layers"))))
    assert sum("ProTrain plan: Plan(" in line for line in info_lines) == 1  # planned from the profiled steps
    reference = run("auto")
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


class NoParameters(pl.LightningModule):
    """Evaluation of a module without parameters: a fixed projection held in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("projection", torch.linspace(-1, 1, 12).reshape(4, 3))

    def forward(self, x):
        return x @ self.projection

    def validation_step(self, batch, i):
        self.log("val_mean", self(batch[0]).float().mean())

    def test_step(self, batch, i):
        self.log("test_mean", self(batch[0]).float().mean())

    def predict_step(self, batch, i):
        return self(batch[0])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_evaluating_a_module_without_parameters_runs_like_the_default_strategy(precision):
    """``validate``/``test``/``predict`` of a module without parameters run without an engine,
    on the device and under the precision's autocast as under the default strategy (before:
    torch's "optimizer got an empty parameter list" from the engine's evaluation optimizer)."""
    def run(strategy):
        data = DataLoader(TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)
        t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision=precision, logger=False,
                       enable_progress_bar=False, enable_model_summary=False)
        return t.validate(NoParameters(), data), t.test(NoParameters(), data), t.predict(NoParameters(), data)

    (val, test, predicted), reference = run("protrain"), run("auto")
    assert val == reference[0] and test == reference[1]
    assert [p.dtype for p in predicted] == [p.dtype for p in reference[2]]
    assert all(torch.equal(a, b) for a, b in zip(predicted, reference[2], strict=True))


def test_blocks_naming_an_empty_list_is_refused_before_training():
    """blocks= naming an empty nn.ModuleList used to fail with a KeyError at the first backward."""
    model = MODELS["gpt2"]()
    model.extra = torch.nn.ModuleList()
    with pytest.raises(ValueError, match="blocks='extra' is an empty nn.ModuleList"):
        pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu",
                config=pt.ProTrainConfig(planning=pt.PlanningConfig(blocks="extra")))


def test_bad_strategy_arguments_fail_fast():
    with pytest.raises(ValueError, match="either plan"):
        ProTrainStrategy({"planning": {"plan": pt.Plan(n_persist=1, n_buffer=1), "memory_budget": "1GiB"}})
    with pytest.raises(ValueError):
        ProTrainStrategy({"planning": {"memory_budget": "lots"}})
    with pytest.raises(ValueError, match="takes a protrain_core.ProTrainConfig, a dict of its fields, or a Plan"):
        ProTrainStrategy(3)


def test_registration_is_idempotent():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_protrain.register()
    lightning_protrain.register()
    assert StrategyRegistry["protrain"]["strategy"] is ProTrainStrategy
    assert STRATEGY_REGISTRY["protrain"]["strategy"] is lightning_protrain.ProTrainFabricStrategy


def test_validation_test_and_summary_keep_working(capsys, info_lines):
    torch.manual_seed(0)
    lit = LitLM()
    # Validation runs between the profiled steps too (they plan from the first training steps).
    t = pl.Trainer(strategy="protrain", accelerator="cpu", devices=1, max_steps=8, logger=False,
                   enable_checkpointing=False, limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=1,
                   enable_model_summary=True)
    t.fit(lit, loader(), loader(shuffle=False))
    assert "val_loss" in t.callback_metrics
    out = capsys.readouterr().out
    n_params = sum(p.numel() for p in lit.parameters())
    assert f"{n_params / 1000:.1f} K" in out  # ModelSummary counts the true parameters
    # The explanation, once, above the progress bar (not through the logger: it would land on the bar's line)
    assert out.count("ProTrain plan: Plan(") == 1 and not any("ProTrain plan" in line for line in info_lines)
    t.test(lit, loader(shuffle=False))
    assert "test_loss" in t.callback_metrics


def test_evaluation_only_engine_holds_no_optimizer_states():
    """trainer.validate without fit streams the weights with no Adam states: the host pool is
    smaller than a training engine's, by at least the two fp32 moments of every parameter."""
    seen = {}

    class Probe(pl.Callback):
        def on_validation_start(self, trainer, module):
            seen["engine"] = (trainer.strategy.engine.optimizer_states, trainer.strategy.engine.memory.host_bytes())

    torch.manual_seed(0)
    lit = LitLM()
    n_params = sum(p.numel() for p in lit.parameters())
    strategy = ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=2))
    t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, callbacks=[Probe()],
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    t.validate(lit, loader(shuffle=False))
    states, eval_host = seen["engine"]
    assert states is False and "val_loss" in t.callback_metrics
    optimizer = torch.optim.AdamW(lit.parameters())
    engine = pt.wrap(lit, optimizer, plan=pt.Plan(n_persist=0, n_buffer=2), device="cpu")
    try:
        assert engine.memory.host_bytes() - eval_host >= 8 * n_params
        with pytest.raises(RuntimeError, match="evaluation-only"):
            other = LitLM()
            pt.wrap(other, torch.optim.AdamW(other.parameters()), plan=pt.Plan(n_persist=0, n_buffer=2), device="cpu",
                    config=pt.ProTrainConfig(optimizer_states=False)).step()
    finally:
        engine.close()


def test_stale_cached_profile_is_reported_and_dropped(tmp_path, info_lines):
    """A cached profile taken while the machine was busy (here: every segment 50x slower) is
    reported after the first steps and removed from the cache; the next run profiles afresh."""
    fit("protrain")
    (path,) = (tmp_path / "cache" / "profiles").glob("*.json")
    first = json.loads(path.read_text())
    busy = dict(first, segments=[dict(s, fwd_s=50 * s["fwd_s"], bwd_s=50 * s["bwd_s"]) for s in first["segments"]])
    path.write_text(json.dumps(busy))
    info_lines.clear()
    fit("protrain", max_steps=10)
    (report,) = [line for line in info_lines if line.startswith("ProTrain: measured step")]
    assert "removed from the profile cache" in report
    assert not path.exists()
    fit("protrain")  # profiled again (too few steps for a report)
    assert json.loads(path.read_text())["segments"][1]["fwd_s"] < busy["segments"][1]["fwd_s"] / 5


# ----- checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("fp16", [False, True], ids=["32-true", "16-mixed"])
def test_checkpoint_resume_equals_uninterrupted_run(tmp_path, fp16):
    """A two-epoch run saves a checkpoint (ModelCheckpoint) after its first epoch; resuming from it
    with another plan gives exactly the second epoch's losses and the final weights. In 16-mixed
    the checkpoint carries the loss scaler's state (backed off from its initial scale in the
    first epoch; a resume with a fresh scaler would skip steps again and differ)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = {"schedule": True}

    def run(strategy, lit, ckpt_path=None, callbacks=()):
        t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False,
                       callbacks=list(callbacks), enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                       enable_model_summary=False, plugins=[fp16_plugin(growth_interval=2)] if fp16 else [])
        t.fit(lit, loader(shuffle=False), ckpt_path=ckpt_path)  # resuming does not restore shuffling

    torch.manual_seed(0)
    full = LitLM(**kw)
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
    run(ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2, n_swap=1)), full, callbacks=[cb])
    resumed = LitLM(**kw)
    torch.manual_seed(1)
    run(ProTrainStrategy(pt.Plan(n_persist=0, n_buffer=1, n_checkpoint=2)), resumed,
        ckpt_path=tmp_path / "epoch=0.ckpt")
    assert len(full.losses) == 12 and resumed.losses == full.losses[6:]
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    scaler = [v for k, v in saved.items() if k.endswith("Precision")]
    if fp16:  # grown (or backed off) from 2**16 in the first epoch; where Lightning's MixedPrecision keeps it
        assert [k for k in saved if k.endswith("Precision")] == ["MixedPrecision"]
        assert scaler[0]["scale"] != 2.0**16
    else:
        assert scaler in ([], [{}])
    wa, wb = weights(resumed), weights(full)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0, msg=k)


def test_the_fp16_loss_scalers_state_resumes_across_strategies(tmp_path):
    """A 16-mixed checkpoint of either strategy resumes under the other with its loss scaler's
    state: the first resumed step runs at the saved scale and growth tracker. Before, ProTrain
    kept it under its own name and format and read only those: both ways began at 2**16 again."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Scale(pl.Callback):
        def __init__(self):
            self.seen = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if self.seen is None:
                plugin = trainer.precision_plugin
                state = plugin.scaler.state_dict() if isinstance(plugin.scaler, torch.amp.GradScaler) else \
                    plugin.state_dict()["scaler"]
                self.seen = (state["scale"], state["_growth_tracker"])

    def run(strategy, epochs, ckpt_path=None, callbacks=()):
        scale = Scale()
        t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                       callbacks=[*callbacks, scale], enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                       enable_model_summary=False, plugins=[fp16_plugin(growth_interval=4)])
        t.fit(LitLM(), loader(shuffle=False), ckpt_path=ckpt_path)
        return scale.seen

    for saving, resuming in (("protrain", "auto"), ("auto", "protrain")):
        folder = tmp_path / saving
        run(saving, 1, callbacks=[ModelCheckpoint(dirpath=folder, filename="last")])
        saved = torch.load(folder / "last.ckpt", weights_only=True)["MixedPrecision"]
        assert (saved["scale"], saved["_growth_tracker"]) != (2.0**16, 0)  # (the first epoch moved it)
        assert run(resuming, 2, ckpt_path=folder / "last.ckpt") == (saved["scale"], saved["_growth_tracker"]), saving


def test_checkpoint_is_plain_pytorch(tmp_path):
    lit, t = fit(ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2)))
    path = tmp_path / "model.ckpt"
    t.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    # Model: the LightningModule's own names, fp32; loads into a plain Hugging Face model.
    plain = MODELS["gpt2"]()
    inner = {k[len("model."):]: v for k, v in ckpt["state_dict"].items()}
    plain.load_state_dict(inner)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, lit.model.state_dict()[k], rtol=0, atol=0)
        assert v.dtype == torch.float32
    # Optimizer: torch.optim.AdamW format, loads into a plain AdamW over the same parameters.
    opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, fused=True)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    assert len(opt.state) == len(list(plain.parameters()))
    # from_pretrained after save_pretrained.
    from transformers import GPT2LMHeadModel

    lit.model.save_pretrained(tmp_path / "hf")
    again = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, plain.state_dict()[k], rtol=0, atol=0)


def test_checkpoint_files_are_like_lightnings(tmp_path):
    """Issue 18, case 3: the file's permissions are those Lightning's own writer gives (the
    umask's), tied weights are stored once (the size of the default strategy's file), and a save
    removes the temporary files a killed save left, not those of a save still running."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftovers = tmp_path / "pt"
    leftovers.mkdir()
    stale = leftovers / f".last.ckpt.protrain-tmp-{dead.pid}-abcd.tmp"
    running = leftovers / f".other.ckpt.protrain-tmp-{os.getpid()}-efgh.tmp"
    for f in (stale, running):
        f.write_bytes(b"x" * 1000)
    files = {}
    for name, strategy in (("auto", "auto"), ("pt", ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2)))):
        torch.manual_seed(0)
        cb = ModelCheckpoint(dirpath=tmp_path / name, filename="last", every_n_train_steps=2)
        t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, callbacks=[cb],
                       enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        t.fit(LitLM(), loader())  # GPT-2: the head's weight is the embedding's
        files[name] = tmp_path / name / "last.ckpt"
    mode = {name: stat.S_IMODE(f.stat().st_mode) for name, f in files.items()}
    assert mode["pt"] == mode["auto"] == 0o666 & ~_umask()
    sizes = {name: f.stat().st_size for name, f in files.items()}
    assert sizes["pt"] <= sizes["auto"] * 1.01, sizes
    saved = torch.load(files["pt"], weights_only=True)["state_dict"]
    assert saved["model.lm_head.weight"].data_ptr() == saved["model.transformer.wte.weight"].data_ptr()
    assert not stale.exists() and running.exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_model_checkpoint_callback_and_crash_mid_save(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    cb = ModelCheckpoint(dirpath=tmp_path, filename="last", every_n_train_steps=2, save_top_k=-1)
    t = pl.Trainer(strategy=ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2)), accelerator="cpu", devices=1,
                   max_steps=4, logger=False, callbacks=[cb], enable_progress_bar=False, limit_val_batches=0)
    lit = LitLM()
    t.fit(lit, loader())
    good = tmp_path / "last.ckpt"
    before = good.read_bytes()
    assert torch.load(good, weights_only=True)["global_step"] == 4

    real_save = torch.save

    def crashing_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError):
        lightning_protrain.AtomicCheckpointIO().save_checkpoint({"x": 1}, good)
    monkeypatch.setattr(torch, "save", real_save)
    assert good.read_bytes() == before  # the previous checkpoint is intact
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# ----- LightningCLI and the start-up hook ----------------------------------------------------
def test_lightning_cli_class_path(tmp_path):
    """LightningCLI trains with the strategy given by class_path, which needs no registration;
    the same fresh interpreter, with the start-up hook turned off, first finds the name
    "protrain" unknown to Trainer and Fabric (START; one interpreter start for both checks)."""
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("""
        trainer:
          accelerator: cpu
          devices: 1
          max_steps: 2
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          strategy:
            class_path: lightning_protrain.ProTrainStrategy
            init_args:
              config: {planning: {plan: {n_persist: 1, n_buffer: 2}}}
        model:
          arch: gpt2
          n_layer: 2
        data:
          batches: 4
    """))
    script = tmp_path / "cli.py"
    script.write_text(START + textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch, lightning.pytorch as pl
        from lightning.pytorch.cli import LightningCLI
        from test_lightning import LitLM, loader

        class Data(pl.LightningDataModule):
            def __init__(self, batches: int = 4):
                super().__init__()
                self.batches = batches
            def train_dataloader(self):
                return loader(n=4 * self.batches)

        cli = LightningCLI(LitLM, Data, run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
        print("STRATEGY", type(cli.trainer.strategy).__name__, "STEPS", cli.trainer.global_step)
    """))
    # class_path needs no registration; with the start-up hook turned off, the name is unknown (START).
    env = dict(os.environ, LIGHTNING_PROTRAIN_AUTOREGISTER="0")
    (tmp_path / "run").mkdir()
    r = subprocess.run([sys.executable, str(script), "--config", str(config)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path / "run")  # the CLI writes its config.yaml into the working directory
    assert r.returncode == 0, r.stderr[-3000:]
    assert "STRATEGY ProTrainStrategy STEPS 2" in r.stdout and "NOT REGISTERED" in r.stdout, r.stdout


START = textwrap.dedent("""
    import sys
    assert "torch" not in sys.modules and "lightning" not in sys.modules, "the hook imported too much"
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    try:
        t = pl.Trainer(strategy="protrain", accelerator="cpu", devices=1, logger=False)
        f = Fabric(strategy="protrain", accelerator="cpu", devices=1)
        print("REGISTERED", type(t.strategy).__name__, type(f.strategy).__name__)
    except ValueError as e:
        print("NOT REGISTERED", e)
""")


def test_pth_hook_registers_in_a_fresh_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_PROTRAIN_AUTOREGISTER"}
    r = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REGISTERED ProTrainStrategy ProTrainFabricStrategy" in r.stdout, r.stdout + r.stderr[-2000:]


def test_pth_hook_imports_nothing_at_start_up():
    """The start-up hook's cost is what it imports: nothing (os and sys are loaded already). It
    only puts its finder on sys.meta_path. Checked in ``-X importtime``'s import tree: no module
    is imported beneath it (a line nested under it would be one)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import sys; print(sorted(type(f).__module__ for f in sys.meta_path))"],
                       capture_output=True, text=True, timeout=60)
    lines = [line for line in r.stderr.splitlines() if line.startswith("import time:")]
    (at,) = [i for i, line in enumerate(lines) if line.rstrip().endswith(" _lightning_protrain_pth")]
    depth = lambda line: len(line.split("|")[2]) - len(line.split("|")[2].lstrip())  # noqa: E731
    nested = []
    for line in reversed(lines[:at]):  # children are printed before their parent, indented deeper
        if depth(line) <= depth(lines[at]):
            break
        nested.append(line.split("|")[2].strip())
    assert nested == [], f"the start-up hook imported {nested}"
    assert "_lightning_protrain_pth" in r.stdout  # its finder waits for Lightning


def test_the_example_config_trains_as_the_example_script():
    """examples/config.yaml (LightningCLI) and examples/finetune.py (its command line's defaults)
    describe the same run: the same trainer settings, model and data (the config lacked the
    script's gradient clipping)."""
    import yaml

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from examples.finetune import parser
    finally:
        sys.path.pop(0)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "examples", "config.yaml")) as f:
        config = yaml.safe_load(f)
    defaults = parser().parse_args([])
    trainer, model, data = config["trainer"], config["model"]["init_args"], config["data"]["init_args"]
    assert trainer["gradient_clip_val"] == defaults.gradient_clip_val
    assert trainer["precision"] == defaults.precision and trainer["max_steps"] == defaults.max_steps
    assert config["seed_everything"] == defaults.seed
    assert model["model"] == data["model"] == defaults.model and model["lr"] == defaults.lr
    assert (data["data"], data["seq_len"], data["batch_size"]) == (defaults.data, defaults.seq_len, defaults.batch_size)
    assert trainer["strategy"]["init_args"]["config"]["planning"]["memory_budget"] == defaults.memory_budget


def test_the_planners_lines_go_above_the_progress_bar():
    """With a progress bar shown, the planner's lines are printed through it (they landed on the
    bar's line)."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    class Bar(TQDMProgressBar):
        printed = []

        def print(self, *args, **kwargs):
            self.printed.append(" ".join(map(str, args)))

    torch.manual_seed(1234)
    t = pl.Trainer(strategy="protrain", accelerator="cpu", devices=1, max_steps=14, logger=False,
                   enable_checkpointing=False, enable_model_summary=False, callbacks=[Bar()])
    t.fit(LitLM(), loader(n=64))
    assert any(line.startswith("ProTrain profiling:") for line in Bar.printed)
    assert any(line.startswith("ProTrain: measured step") for line in Bar.printed)
