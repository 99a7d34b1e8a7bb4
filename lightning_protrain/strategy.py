"""``Trainer(strategy="protrain")``: the ProTrain engine behind Lightning's strategy API.

The strategy is a thin adapter over ``protrain_core``:
  setup       the optimizers from ``configure_optimizers`` (param groups and schedulers kept;
              several under manual optimization) go into the engine, which owns the parameters
              from then on (``model_to_device`` does nothing) and plans as ``wrap`` does; what
              its planner reports is printed and logged under ``protrain/`` (``_report``).
  backward    ``engine.backward``, which runs ``LightningModule.backward`` (streamed chunks are
              updated while it runs); a backward outside ``optimizer_step`` (a non-final
              micro-batch of ``accumulate_grad_batches``), and every ``manual_backward``, runs
              under ``engine.no_sync()``. Manual optimization: ``self.clip_gradients`` clips
              exactly, ``opt.step()`` is ``engine.step()``, ``opt.zero_grad()`` reaches the engine.
  step        ``engine.step()``; updates that overlap the next forward (fp16, norm clipping) are
              waited for at its end when a hook that runs before that forward may read weights.
  clipping    ``gradient_clip_val`` / ``gradient_clip_algorithm`` go to the engine, which clips
              exactly as ``clip_grad_norm_`` / ``clip_grad_value_`` and logs ``grad_norm``; an
              overridden ``configure_gradient_clipping`` clips through it between backward and step.
  checkpoints the model's state dict (fp32 master weights) and the optimizer state in
              ``torch.optim.AdamW`` format, one file written atomically, or sharded directories
              (``CheckpointConfig``); any plan, at any number of processes, loads them.
  processes   ``Trainer(devices=N, num_nodes=M)``, torchrun or SLURM: Lightning's DDP launcher
              starts the processes and the engine shards every chunk over them ([Note: sharded
              chunks] in protrain_core/runtime/sharding.py), following rank 0's plan.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import protrain_core as pt
from protrain_core.precision import parse_precision
from protrain_core.update import clips_norm
from protrain_core.utils import has_meta
from lightning_protrain._common import (
    EnginePrecision,
    StrategyPlumbing,
    for_evaluation,
    checkpoint_optimizer_state,
    close_for_a_new_engine,
    load_checkpoint_optimizer_state,
    parameters_on_meta,
    strategy_config,
    check_optimizers,
    no_parameters,
    own_precision,
)


class ProTrainPrecision(EnginePrecision, Precision):
    """The precision plugin of the ProTrain strategy: the engine's autocast around steps for the
    mixed modes (the engine keeps the compute copies and fp32 masters), backward and step
    through the engine, the fp16 loss scaler's state in checkpoints."""

    def __init__(self, precision: str, scaler: dict | None = None) -> None:
        self.precision = precision
        self.scaler = scaler  # a 16-mixed plugin's GradScaler settings; its state after a fit
        self.strategy: ProTrainStrategy | None = None  # set by the strategy that takes the plugin
        self.device: torch.device | None = None  # where a module without an engine is evaluated
        self.plain_after_fit = False  # the optimizer holds its state again (one process)
        self.wait_after_step = False  # user hooks between step and the next forward may read weights
        self.log_grad_norm = True  # Lightning's own configure_gradient_clipping: log the norm it returns
        self.accumulated = False  # a backward ran since the last step (a micro-batch before one that returned None)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The fp16 loss scaler's state where Lightning's MixedPrecision keeps it (under its class
        name, in torch's GradScaler format): the default strategy resumes from it, and ProTrain
        from the default strategy's."""
        state = checkpoint.pop(type(self).__qualname__, {}).get("scaler")
        if state:
            checkpoint["MixedPrecision"] = state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if checkpoint.get("MixedPrecision"):
            self.load_state_dict({"scaler": checkpoint["MixedPrecision"]})

    def forward_context(self):
        if self.engine is not None:
            return self.engine.autocast()
        dtype = parse_precision(self.precision).autocast_dtype
        if self.device is None or dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)  # evaluation without an engine

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        if self.engine is None:
            self._check_plain()
            return super().backward(tensor, model, optimizer, *args, **kwargs)
        # Only the backward of the closure Lightning runs inside optimizer_step (a step's last
        # micro-batch) may update chunks; under manual optimization every backward accumulates.
        final = self.engine.step_state.step_closure and model.automatic_optimization
        with contextlib.nullcontext() if final else self.engine.no_sync():
            self.engine.backward(tensor, run=lambda loss: model.backward(loss, *args, **kwargs))
        self.accumulated = True

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self.engine is None:
            self._check_plain()
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        with self.engine.step_state.in_step_closure():  # the closure's backward is a step's last micro-batch
            closure_result = closure()
        self._after_closure(model, optimizer)
        if no_parameters([optimizer]):
            return closure_result  # no optimizer: nothing steps
        if closure_result is None and model.automatic_optimization and (
                self.precision == "16-mixed" or not self.accumulated):
            # training_step returned None: no backward, and no step where Lightning's plugin takes
            # none (its loss scaler's; without one, torch's step has no gradient to apply).
            return None
        self.accumulated = False
        self.engine.step(optimizer)  # manual optimization: opt.step() after the manual_backward calls
        if self.wait_after_step:
            self.engine.wait_for_updates()
        return closure_result

    def _check_plain(self) -> None:
        """A backward or step through the strategy after fit: plain PyTorch on the module and its
        optimizer, as under the default strategy -- where the optimizer got its state back."""
        if not self.plain_after_fit:
            raise RuntimeError(
                "The ProTrain engine is built by trainer.fit and closed at its end; after a fit with "
                "several processes the optimizer's state is in the checkpoint, not in the optimizer, "
                "so a step outside fit would start it afresh. Train inside trainer.fit (resume from "
                "the checkpoint with ckpt_path=)."
            )

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping call (from ``configure_gradient_clipping``): the engine clips at
        step() exactly as torch would now; the total norm is logged as ``grad_norm``."""
        requested = gradient_clipping(clip_val, gradient_clip_algorithm)
        if requested is None or not self.engine.clipping.gradients_ready:
            return  # nothing to clip (training_step returned None: no backward ran)
        if requested.algorithm == "value":
            self.engine.clipping.clip_grad_value_(requested.value)
            return
        norm = self.engine.clipping.clip_grad_norm_(requested.value)
        module = self.engine.module
        if self.log_grad_norm and getattr(module, "_trainer", None) is not None:
            module.log("grad_norm", norm, on_step=True, on_epoch=False)


def gradient_clipping(value, algorithm) -> pt.ClippingConfig | None:
    """Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` pair (0 or None: off; an
    algorithm other than "norm" and "value" is refused by ``ClippingConfig``)."""
    if value is None or float(value) <= 0:
        return None
    return pt.ClippingConfig(algorithm=str(getattr(algorithm, "value", algorithm) or "norm"), value=float(value))


# Lightning callbacks that read no weights between a step and the next forward (ModelCheckpoint
# saves through the strategy, whose state dicts wait for the updates), nor gradients.
_SAFE_CALLBACKS = (ProgressBar, ModelCheckpoint, ModelSummary, LearningRateMonitor, Timer, EarlyStopping)
# Hooks that run between a step and the next forward, where user code may read the weights; and
# between a step's backward and its update, where users read and change p.grad.
_BETWEEN_STEPS = ("on_before_zero_grad", "optimizer_zero_grad", "on_train_batch_end")
_BEFORE_UPDATE = ("on_after_backward", "on_before_optimizer_step")


def grad_accumulator(config: pt.ProTrainConfig, trainer, precision: str, *, manual: bool, late: bool) -> bool:
    """``ProTrainConfig.grad_accumulator`` for a fit: None is False where every step has one
    backward whose offloaded chunks can be updated as their gradients land, else True; False
    where that cannot be is refused, with the reason, before anything is built."""
    reasons = [
        (manual, "manual optimization accumulates every manual_backward until opt.step()"),
        (trainer.accumulate_grad_batches != 1, f"accumulate_grad_batches={trainer.accumulate_grad_batches}"),
        (any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks),
         "a GradientAccumulationScheduler callback"),
        (late, "an overridden configure_gradient_clipping, on_after_backward or on_before_optimizer_step may "
               "change the gradients between backward and step"),
        (is_overridden("optimizer_zero_grad", trainer.lightning_module, pl.LightningModule),
         "an overridden optimizer_zero_grad may keep gradients across steps"),
        (clips_norm(config.clipping), "gradient_clip_algorithm='norm' needs every gradient first"),
        (precision != "bf16-mixed", f"precision={precision!r} (it needs 'bf16-mixed')"),
    ]
    why = next((why for needed, why in reasons if needed), None)  # the accumulators are needed
    if config.grad_accumulator is None:
        return why is not None  # kept where a reason needs it
    if config.grad_accumulator is False and why is not None:
        raise ValueError(
            f"ProTrainConfig(grad_accumulator=False) updates each offloaded chunk as its gradients land, during "
            f"backward, which this fit cannot do: {why}. Leave grad_accumulator=None: the strategy then keeps the "
            "accumulators where a fit needs them.")
    return config.grad_accumulator


def overrides(module, callbacks, hooks: tuple[str, ...]) -> bool:
    """Whether the LightningModule or a callback other than Lightning's bookkeeping ones
    overrides one of ``hooks`` (``_BEFORE_UPDATE``: every step's updates then wait for
    ``step()``, [Note: gradients read through p.grad] in protrain_core/runtime/gradients.py)."""
    if any(is_overridden(hook, module, pl.LightningModule) for hook in hooks):
        return True
    return any(not isinstance(cb, _SAFE_CALLBACKS) and any(is_overridden(h, cb, pl.Callback) for h in hooks)
               for cb in callbacks)


class UnevenPredict:
    """[Note: uneven predict batches]
    Lightning gives each rank its share of the predict samples without padding, so the ranks may
    run different numbers of predict steps. With the chunks sharded over the ranks, a forward
    all-gathers each streamed chunk, and a rank whose batches ran out would leave another's
    gathers waiting, or meet them with its next collective (gloo's "collective mismatch"). As
    torch's ``Join`` shadows DDP's collectives, right after its last step of a dataloader a rank
    replays the chunk calls of that step (``engine.hooks.replay``: no module runs) once for each
    step another rank has more. Every step of a dataloader is taken to run the same units, as a
    model's forwards do. A rank with no batch of a dataloader others predict from has no step to
    replay: refused on every rank before the first step."""

    def __init__(self, engine: pt.Engine, own: list[int], most: list[int]) -> None:
        self.engine, self.own, self.more = engine, own, [m - n for m, n in zip(most, own)]
        self.done = [0] * len(own)

    @classmethod
    def of(cls, engine: pt.Engine | None, strategy: ProTrainStrategy) -> UnevenPredict | None:
        """For the predict about to run on ``engine`` (a collective); None where this rank has as
        many steps as any (one process, or a dataloader without a length anywhere)."""
        if engine is None or engine.sharding.whole:
            return None
        own = [-1 if math.isinf(n) else int(n) for n in strategy.lightning_module.trainer.num_predict_batches]
        counts = strategy.all_gather(torch.tensor(own, device=strategy.root_device)).reshape(-1, len(own))
        if (counts < 0).any():
            return None
        top = counts.max(0).values
        if ((counts == 0) & (top > 0)).any():
            raise RuntimeError(
                f"trainer.predict: a rank gets no batch of a dataloader the others predict from (batches per rank and "
                f"dataloader: {counts.tolist()}). ProTrain shards the chunks over the ranks, and that rank has no step "
                f"to take part in the others' forwards with. Give every rank a batch (at least {strategy.world_size} x "
                "batch_size samples), or predict with devices=1.")
        most = top.tolist()
        return cls(engine, own, most) if most != own else None

    def step(self, run, dataloader: int):
        """``run()``, one predict step of ``dataloader``, and after this rank's last the replays."""
        with self.engine.hooks.recording() as log:
            out = run()
        self.done[dataloader] += 1
        if self.done[dataloader] == self.own[dataloader]:
            for _ in range(self.more[dataloader]):
                self.engine.hooks.replay(log)
        return out


class ProTrainStrategy(StrategyPlumbing, ParallelStrategy):
    """Train with ProTrain: chunked model states streamed from host memory, CPU Adam during
    backward, and per-block activation checkpointing/swapping, chosen automatically.

    Args:
        config: every ProTrain setting (``protrain_core.ProTrainConfig``, or a dict of its
            fields, or a ``Plan`` alone for the configuration with that plan; in a LightningCLI
            file, ``init_args: {config: {planning: {memory_budget: 20GiB}}}``): the plan or
            what to search one for, the runtime's switches, and the checkpoint format
            (``CheckpointConfig``). Gradient clipping (``gradient_clip_val``) and precision
            are the Trainer's.
        device, accelerator, checkpoint_io, precision_plugin, parallel_devices,
        cluster_environment: Lightning's (set by the Trainer).
        process_group_backend, timeout, start_method: as for ``DDPStrategy`` (several processes).
    """

    strategy_name = "protrain"
    _cuda_accelerator = CUDAAccelerator
    _ddp_class = DDPStrategy

    def __init__(
        self,
        config: pt.ProTrainConfig | None = None,
        *,
        device=None,
        accelerator=None,
        checkpoint_io=None,
        precision_plugin=None,
        parallel_devices=None,
        cluster_environment=None,
        process_group_backend: str | None = None,
        timeout=None,
        start_method: str = "popen",
    ) -> None:
        config = strategy_config(config, caller="ProTrainStrategy")
        if config.clipping is not None:
            raise ValueError(
                "ProTrainStrategy takes gradient clipping from the Trainer, as every strategy does: remove "
                f"config.clipping and pass Trainer(gradient_clip_val={config.clipping.value}, "
                f"gradient_clip_algorithm={config.clipping.algorithm!r})."
            )
        self.config = config
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._init_plumbing(device, process_group_backend, timeout, start_method)
        self._last_plan: pt.Plan | None = None
        self._final_optimizer_states: dict[int, dict] = {}  # id(optimizer) -> its state when fit ended
        self._sharded_from = None  # a sharded checkpoint directory being restored
        self._sharded_weights: bool | None = None  # its weights wait for the engine (the strict flag)
        self._meta_weights: dict | None = None  # ckpt_path's weights for a module on the meta device
        self._failed = False  # an exception ends the run: teardown runs no collective
        self._uneven: UnevenPredict | None = None  # the predict running, where ranks have uneven batches
        self._wrapped_optimizers: list = []  # Lightning's wrappers of the optimizer, zero_grad routed
        # A fit's engine configuration, and whether the module clips late, changes gradients, optimizes manually
        self._fit: tuple | None = None

    # ----- Lightning plumbing ----------------------------------------------------------------
    @property
    def precision_plugin(self) -> ProTrainPrecision:
        if self._precision_plugin is None:
            self.precision_plugin = ProTrainPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        known = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
        self._precision_plugin = own_precision(plugin, ProTrainPrecision, known)
        if self._precision_plugin is not None:
            self._precision_plugin.strategy = self

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # ckpt_path's weights go into the module before the engine takes them from it (a sharded
        # directory loads right after the engine exists): a file that does not match is refused first.
        return False

    def model_to_device(self) -> None:
        pass  # the engine places every parameter (device or host) itself

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        """``trainer.init_module(empty_init=True)`` builds the model's parameters on the meta device
        (``parameters_on_meta``; FSDP's builds it all there): no memory until the engine fills each
        chunk from ``ProTrainConfig.weights``, a ``ckpt_path``, or the modules' own initialisation
        ([Note: weights straight into chunks]). Otherwise on the host, as FSDP's does: the engine
        moves what the plan keeps on the device."""
        with parameters_on_meta() if empty_init else contextlib.nullcontext(), \
                self.precision_plugin.tensor_init_context():
            yield

    # ----- predict ------------------------------------------------------------------------------
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._uneven = UnevenPredict.of(self._open_engine(), self)

    def predict_step(self, *args, **kwargs) -> Any:
        run = super().predict_step
        if self._uneven is None:
            return run(*args, **kwargs)
        dataloader = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
        return self._uneven.step(lambda: run(*args, **kwargs), dataloader)

    def on_predict_end(self) -> None:
        self._uneven = None
        super().on_predict_end()

    # ----- setup -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """The run ends with ``exception``: teardown follows, with no collective (the other ranks
        may be anywhere): this process ends at once with the user's error, and the others'
        collectives fail on its closed connections within seconds, as under ``strategy="ddp"``."""
        super().on_exception(exception)
        self._failed = True

    def setup(self, trainer) -> None:
        self._failed = False
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = self.precision_plugin
        fitting = trainer.state.fn == TrainerFn.FITTING
        manual = not module.automatic_optimization
        if fitting:
            self.setup_optimizers(trainer)  # (several only under manual optimization: Lightning checks)
            if no_parameters(self.optimizers):
                # configure_optimizers returned None: Lightning's stand-in has no parameters and
                # the fit runs forward and backward only. The engine's own stand-in, which nothing
                # steps, keeps the gradients, accumulated over the steps as Lightning's p.grad are.
                optimizer, manual = torch.optim.SGD(module.parameters(), lr=0.0), True
            else:
                optimizer = check_optimizers(self.optimizers)
            # An overridden configure_gradient_clipping may clip at any step, with any setting.
            late = is_overridden("configure_gradient_clipping", module, pl.LightningModule)
            touched = overrides(module, trainer.callbacks, _BEFORE_UPDATE)
            clipping = None if late or manual else gradient_clipping(trainer.gradient_clip_val,
                                                                     trainer.gradient_clip_algorithm)
            config = self.config.replace(clipping=clipping)
            config = config.replace(grad_accumulator=grad_accumulator(config, trainer, precision.precision,
                                                                      manual=manual, late=late or touched))
        elif next(module.parameters(), None) is None:
            # validate/test/predict of a module without parameters: nothing to place or stream, so
            # no engine; the module runs on the device as under the default strategy.
            module.to(self.root_device)
            self.precision_plugin.device = self.root_device
            self.model = module
            self.setup_precision_plugin()
            return
        else:
            late = touched = False
            optimizer, config = for_evaluation(module, self.config, self._last_plan)  # evaluation only
        self._fit = (config, late, touched, manual) if fitting else None
        if self._meta_weights is not None:  # (load_model_state_dict: ckpt_path's weights fill the chunks)
            config, self._meta_weights = config.replace(weights=self._meta_weights), None
        self._build(module, optimizer, config)
        if self._sharded_weights is not None:  # ckpt_path is a sharded directory (load_model_state_dict)
            self.engine.load_sharded(self._sharded_from, optimizer=False, strict=self._sharded_weights)
            self._sharded_weights = None
        self.model = module
        self.setup_precision_plugin()  # re-creates Lightning's wrappers of the optimizer
        if fitting:
            self._route_wrapped_zero_grad()
        if fitting and self.config.planning.plan is not None:
            rank_zero_info(f"ProTrain: {self.engine.plan} (given), overlap: {self.engine.clipping.overlap(steady=True)}")

    def _build(self, module, optimizer, config) -> None:
        precision = self.precision_plugin
        self._build_engine(module, optimizer, config, precision)
        if self._fit is not None:
            # The engine is told whether clipping or a change of p.grad may come between backward
            # and step (an override) or never (gradient_clip_val, configured ahead).
            _, late, touched, manual = self._fit
            self.engine.clipping.expect_late(late or touched)
            self.engine.step_state.set_manual(manual)
            precision.log_grad_norm = not (late or manual)
            precision.wait_after_step = overrides(module, module.trainer.callbacks, _BETWEEN_STEPS)

    def _wrap_anew(self) -> None:
        """Which parameters train changed between steps (``BaseFinetuning`` unfroze blocks): the
        engine is built again for them (``close_for_a_new_engine``)."""
        optimizer = list(self.engine.optimizers)
        close_for_a_new_engine(self.engine, self.precision_plugin)
        self._build(self.lightning_module, optimizer, self._fit[0])
        self._route_wrapped_zero_grad()

    def _route_wrapped_zero_grad(self) -> None:
        """``self.optimizers().zero_grad()`` (manual optimization) reaches the optimizer class's
        own method through Lightning's wrapper, not the user's optimizer, which the engine routed
        ([Note: routing zero_grad] in protrain_core/runtime/engine.py): the wrapper's goes there."""
        # (Lightning's wrappers as this strategy holds them: module.optimizers() is the user's to
        # override, and runs only when the user calls it.)
        self._wrapped_optimizers = list(self._lightning_optimizers)
        for wrapper in self._wrapped_optimizers:
            wrapper.zero_grad = wrapper.optimizer.zero_grad

    def training_step(self, *args, **kwargs):
        # The batch before anything of it runs: the engine may re-plan for its length.
        if self.engine is not None and self.engine.states.trainables_changed() is not None:
            self._wrap_anew()
        if self.engine is not None and args:
            self.engine.begin_batch(args[0])
        return super().training_step(*args, **kwargs)

    def _report(self, text: str, **metrics) -> None:
        """What the engine's planner says: printed once (rank zero), above the progress bar while
        one is shown (not onto its line); its figures also logged."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        bar = None if trainer is None else trainer.progress_bar_callback
        if bar is not None and bar.is_enabled and self.is_global_zero:
            bar.print(text)
        else:
            rank_zero_info(text)
        if metrics and trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics({f"protrain/{k}": v for k, v in metrics.items()}, step=trainer.global_step)

    # ----- state -------------------------------------------------------------------------------
    def _sharded(self) -> pt.Engine | None:
        """The open engine when checkpoints are sharded directories."""
        return self._open_engine() if self.state_dict_type == "sharded" else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._sharded() is not None:
            return {}  # written by save_checkpoint, shard by shard
        engine = self._open_engine()
        return engine.state_dict() if engine is not None else super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """``state_dict_type="sharded"``: a ``torch.distributed.checkpoint`` directory every rank
        writes its shards into, the rest of Lightning's checkpoint beside them (rank 0);
        "full": one file, gathered to rank 0 chunk by chunk (``lightning_module_state_dict``)."""
        engine = self._sharded()
        if engine is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        engine.save_sharded(filepath, meta=meta)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        meta = self._sharded_meta(checkpoint_path)
        self._sharded_from = None if meta is None else checkpoint_path  # read by the load_*_state_dict below
        if meta is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return {**meta, "state_dict": {}, "optimizer_states": [{}]}

    def optimizer_state(self, optimizer) -> dict:
        engine = self._open_engine()
        if self._sharded() is not None:
            return {}
        if engine is not None and engine.optimizer_states and not no_parameters([optimizer]):
            return checkpoint_optimizer_state(engine, optimizer)
        if id(optimizer) in self._final_optimizer_states:
            return self._final_optimizer_states[id(optimizer)]
        return super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        engine = self._open_engine()
        sharded = self._sharded_from
        if engine is None and sharded is not None:
            from protrain_core.checkpoint import check_sharded

            check_sharded(sharded, self.lightning_module)  # names and sizes now; the pieces after setup
            self._sharded_weights = strict
            return None
        if engine is None and has_meta(self.lightning_module):
            # init_module(empty_init=True): loaded into meta tensors the values would be lost; the
            # engine fills its chunks from them instead ([Note: weights straight into chunks]).
            self._meta_weights = checkpoint["state_dict"]
            return None
        if engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if sharded is not None:
            return engine.load_sharded(sharded, optimizer=False, strict=strict)
        engine.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        engine = self._open_engine()
        if engine is None or no_parameters(self.optimizers):
            return super().load_optimizer_state_dict(checkpoint)
        if self._sharded_from is not None:
            return engine.load_sharded(self._sharded_from, model=False)
        states = checkpoint["optimizer_states"]
        if len(states) != len(engine.optimizers):
            raise ValueError(f"The checkpoint holds {len(states)} optimizer states, for as many optimizers; this run "
                             f"trains with {len(engine.optimizers)}.")
        for optimizer, state in zip(engine.optimizers, states):
            load_checkpoint_optimizer_state(engine, state, optimizer)

    def teardown(self) -> None:
        for wrapper in self._wrapped_optimizers:
            wrapper.__dict__.pop("zero_grad", None)
        self._wrapped_optimizers = []
        engine = self._open_engine()
        if engine is not None and self._failed:
            engine.close(after_failure=True)
        elif engine is not None:
            trained = bool(self.optimizers) and engine.optimizer_states  # not after evaluation only
            if trained:
                # Kept for trainer.save_checkpoint() after fit; the engine and its chunks go away.
                self._final_optimizer_states = {id(o): checkpoint_optimizer_state(engine, o) for o in engine.optimizers}
                self.precision_plugin.scaler = engine.states.scaler()  # and the loss scaler's
            self._last_plan = engine.plan  # the plan evaluation after fit runs with
            engine.close()
            if trained and engine.sharding.whole:
                # The optimizers are plain PyTorch again, with their states as under the default
                # strategy (the tensors are the state dicts': nothing is copied).
                for o in engine.optimizers:
                    o.load_state_dict(self._final_optimizer_states[id(o)])
                self.precision_plugin.plain_after_fit = True
        self.engine = None
        if self._precision_plugin is not None:
            self._precision_plugin.device = None
        module = self.lightning_module
        if module is not None and has_meta(module):
            # setup failed before the engine filled a model built on the meta device: Lightning's
            # teardown would move it to the CPU and fail ("Cannot copy out of meta tensor"),
            # hiding that error behind its own.
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()
