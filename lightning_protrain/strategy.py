"""``Trainer(strategy="protrain")``: the ProTrain engine behind Lightning's strategy API.

The strategy is a thin adapter over ``protrain_core``:
  setup       the user's Adam/AdamW from ``configure_optimizers`` (param groups, schedulers kept);
              unless a plan is given, one training batch (the first of the train dataloader, read
              with the random state restored afterwards) is profiled through ``training_step`` and
              the fastest plan that fits ``memory_budget`` is chosen; the explanation is printed
              once. The engine then owns the parameters: ``model_to_device`` does nothing.
  backward    ``engine.backward`` (streamed chunks are updated while it runs); a backward that
              Lightning runs outside ``optimizer_step`` is a non-final micro-batch of
              ``accumulate_grad_batches`` and runs under ``engine.no_sync()``.
  step        ``engine.step()``; LR schedulers step the user's optimizer as usual.
  clipping    ``gradient_clip_val`` / ``gradient_clip_algorithm`` are handed to the engine,
              which clips exactly as ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``.
  checkpoints the model's own state dict (fp32 master weights) and the optimizer state in
              ``torch.optim.AdamW`` format, written atomically; any plan can load them.
One process, one device for now: multi-GPU is not implemented yet.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import protrain_core as pt
from protrain_core.phase import TrainingPhase
from protrain_core.plan import plan_arguments
from protrain_core.planner.profiles import discard as discard_profile
from lightning_protrain._common import (
    OneDevicePlumbing,
    build_engine,
    check_optimizers,
    convert_input,
    gradient_clipping,
    load_scaler_state,
    loss_of,
    precision_of_plugin,
    register_as_protrain,
    scaler_settings,
    scaler_state,
    unroute_zero_grad,
)
from protrain_core.utils import format_seconds

# Steps whose time is reported against the prediction (after the first WARMUP_STEPS).
WARMUP_STEPS, TIMED_STEPS = 2, 5
# A prediction off by more than this factor means the profile does not describe this machine as
# it runs now (typically a cached profile taken while something else loaded the machine).
STALE_FACTOR = 1.5


class ProTrainPrecision(Precision):
    """The precision plugin of the ProTrain strategy: the engine's autocast around steps for the
    mixed modes (the engine keeps the compute copies and fp32 masters), backward and step
    through the engine, the fp16 loss scaler's state in checkpoints."""

    def __init__(self, precision: str, scaler: dict | None = None) -> None:
        self.precision = precision
        self.scaler = scaler  # a 16-mixed plugin's GradScaler settings; its state after a fit
        self.engine: pt.Engine | None = None
        self.clipping: tuple[str, float] | None = None
        self.on_step = None  # the strategy's step timer
        # STEP inside optimizer_step: the closure's backward is a step's last micro-batch.
        self.phase = TrainingPhase.IDLE

    def forward_context(self):
        return self.engine.autocast() if self.engine is not None else contextlib.nullcontext()

    def convert_input(self, data):
        return convert_input(data, self.precision)

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        # Lightning runs the closure of a non-final micro-batch directly, the last one's inside
        # optimizer_step: only that backward may update chunks.
        final = self.phase is TrainingPhase.STEP
        with contextlib.nullcontext() if final else self.engine.no_sync():
            self.engine.backward(tensor)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        self.phase = TrainingPhase.STEP
        try:
            closure_result = closure()
        finally:
            self.phase = TrainingPhase.IDLE
        self._after_closure(model, optimizer)
        if closure_result is None:
            return None  # training_step returned None: no backward, no step (as Lightning)
        self.engine.step()
        if self.on_step is not None:
            self.on_step()
        return closure_result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        requested = gradient_clipping(clip_val, gradient_clip_algorithm)
        if requested != self.clipping:
            raise ValueError(
                f"ProTrain clips gradients inside its optimizer step (before chunks are updated during backward), "
                f"configured from Trainer(gradient_clip_val=..., gradient_clip_algorithm=...) as {self.clipping}; "
                f"configure_gradient_clipping asked for {requested}. Set the Trainer's arguments instead of "
                "clipping with other values in configure_gradient_clipping."
            )

    def state_dict(self) -> dict[str, Any]:
        return scaler_state(self.engine, self.scaler)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_scaler_state(self.engine, state_dict)


# Lightning's own plugins for the flags the engine implements; any other plugin is refused.
_KNOWN_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def to_protrain_precision(plugin) -> ProTrainPrecision:
    if isinstance(plugin, ProTrainPrecision):
        return plugin
    return ProTrainPrecision(precision_of_plugin(plugin, _KNOWN_PLUGINS), scaler_settings(plugin))


class ProTrainStrategy(OneDevicePlumbing, SingleDeviceStrategy):
    """Train with ProTrain: chunked model states streamed from host memory, CPU Adam during
    backward, and per-block activation checkpointing/swapping, chosen automatically.

    Args:
        plan: a ``protrain_core.Plan`` (or a dict of its fields) to skip profiling and search.
        memory_budget: device memory the searched plan may use: bytes or a string such as
            "20GiB". Default: the device's free memory minus a margin.
        blocks: the transformer blocks (dotted name or ``nn.ModuleList``) when discovery fails.
        chunk_size: chunk size in elements (default: the waste-minimising search).
        reprofile: profile again even when a cached profile of this set-up exists.
    """

    strategy_name = "protrain"
    _cuda_accelerator = CUDAAccelerator

    def __init__(
        self,
        plan: pt.Plan | dict | None = None,
        memory_budget: int | str | None = None,
        blocks=None,
        chunk_size: int | None = None,
        reprofile: bool = False,
        device=None,
        accelerator=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        plan, _ = plan_arguments(plan, memory_budget)
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        # None: the accelerator's first device (Lightning creates registered strategies without one).
        self._root_device = torch.device(device) if device is not None else None
        self.plan = plan
        self.memory_budget = memory_budget
        self.blocks = blocks
        self.chunk_size = chunk_size
        self.reprofile = reprofile
        self.engine: pt.Engine | None = None
        self._last_plan: pt.Plan | None = None
        self._final_optimizer_state: dict | None = None
        self._step_ends: list[float] = []

    # ----- Lightning plumbing ----------------------------------------------------------------
    @property
    def precision_plugin(self) -> ProTrainPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ProTrainPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        self._precision_plugin = None if plugin is None else to_protrain_precision(plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (and its chunks) must exist before weights are loaded into it

    def model_to_device(self) -> None:
        pass  # the engine places every parameter (device or host) itself

    # ----- setup -------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        if trainer.num_devices * trainer.num_nodes > 1:
            raise ValueError(
                f"The ProTrain strategy runs on one device for now; got {trainer.num_devices} devices x "
                f"{trainer.num_nodes} nodes. Use Trainer(devices=1, num_nodes=1)."
            )
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = self.precision_plugin
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not module.automatic_optimization:
            raise ValueError("The ProTrain strategy needs automatic optimization (self.automatic_optimization = True).")
        if fitting:
            self.setup_optimizers(trainer)
            optimizer = check_optimizers(self.optimizers)
            clipping = gradient_clipping(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            plan, example, step_fn = self.plan, None, None
            if plan is None:
                example, step_fn = self._example_batch(trainer), self._profile_step
            budget = self.memory_budget if plan is None else None
        else:
            # Evaluation only: an optimizer nobody steps (the engine allocates no states for it);
            # without a known plan everything streams.
            optimizer = torch.optim.AdamW(module.parameters())
            clipping, example, step_fn, budget = None, None, None, None
            plan = self.plan or self._last_plan or pt.Plan(n_persist=0, n_buffer=2)
        self.engine = build_engine(
            module, optimizer, plan=plan, memory_budget=budget, blocks=self.blocks, chunk_size=self.chunk_size,
            precision=precision.precision, device=self.root_device, example_inputs=example, step_fn=step_fn,
            clipping=clipping, reprofile=self.reprofile, scaler=precision.scaler, training=fitting,
        )
        self._last_plan = self.engine.plan
        precision.engine, precision.clipping = self.engine, clipping
        precision.on_step = self._on_step if fitting else None
        self._step_ends = []
        self.model = module
        self.setup_precision_plugin()
        if fitting:
            if self.engine.choice is not None:
                rank_zero_info(self.engine.explain())
            else:
                rank_zero_info(f"ProTrain: {self.engine.plan} (given), overlap: {self.engine.overlap}")

    def _example_batch(self, trainer):
        """The first training batch, on the device, for profiling; the random state (shuffling
        draws from it) is restored so training sees exactly the batches it would have."""
        trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        if loader is None or isinstance(loader, (dict, list, tuple)):
            raise ValueError(
                "The ProTrain strategy profiles one training batch to choose its plan, but the train dataloader "
                "is missing or a collection of loaders. Pass ProTrainStrategy(plan=protrain_core.Plan(...))."
            )
        with torch.random.fork_rng(devices=[]):
            batch = next(iter(loader))
        return self.batch_to_device(batch)

    def _profile_step(self, module, batch):
        """One training step for the profiler: ``training_step`` with logging switched off.

        [Note: logging off while profiling]
        ``self.log`` / ``self.log_dict`` are replaced by no-ops on the module instance for these
        calls (the class is untouched, the instance attributes are removed afterwards): Lightning
        has no public switch that turns a LightningModule's logging off for a call it does not
        run itself, and the profiler's passes must not log. Profiling on the first real training
        steps instead (no extra calls at all) removes this."""
        saved = {name: module.__dict__.get(name) for name in ("log", "log_dict")}
        module.log = module.log_dict = lambda *args, **kwargs: None
        try:
            with self.precision_plugin.train_step_context():
                loss = loss_of(module.training_step(batch, 0))
        finally:
            for name, value in saved.items():
                if value is None:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
        if loss is None:
            raise ValueError("training_step returned None for the profiled batch; ProTrain needs its loss.")
        return loss

    def _on_step(self) -> None:
        """After the first steps: predicted vs measured step time, printed and logged once."""
        self._step_ends.append(time.perf_counter())
        choice = self.engine.choice if self.engine is not None else None
        if choice is None or len(self._step_ends) != WARMUP_STEPS + TIMED_STEPS + 1:
            return
        times = [b - a for a, b in zip(self._step_ends[WARMUP_STEPS:], self._step_ends[WARMUP_STEPS + 1:])]
        measured = statistics.median(times)
        trainer = self.lightning_module.trainer
        predicted = choice.runtime.total_s * trainer.accumulate_grad_batches
        message = (
            f"ProTrain: measured step {format_seconds(measured)} (median of {len(times)} after {WARMUP_STEPS} "
            f"warm-up steps, data loading and hooks included), predicted {format_seconds(predicted)} "
            f"({(predicted - measured) / measured:+.1%})."
        )
        if not 1 / STALE_FACTOR <= predicted / measured <= STALE_FACTOR:
            removed = discard_profile(choice.profile.key)
            message += (
                " The profile does not describe this machine as it runs now (was it taken, or cached, while other "
                "work loaded the machine?), so the plan may not be the best one. "
                + ("It has been removed from the profile cache: the next run profiles again."
                   if removed else "Profile again with ProTrainStrategy(reprofile=True).")
            )
        rank_zero_info(message)
        for logger in trainer.loggers:
            logger.log_metrics({"protrain/predicted_step_s": predicted, "protrain/measured_step_s": measured},
                               step=trainer.global_step)

    # ----- state -------------------------------------------------------------------------------
    def _open_engine(self) -> pt.Engine | None:
        return self.engine if self.engine is not None and not self.engine.closed else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        engine = self._open_engine()
        return engine.state_dict() if engine is not None else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        engine = self._open_engine()
        if engine is not None and engine.optimizer_states:
            return engine.optimizer_state_dict()
        if self._final_optimizer_state is not None:
            return self._final_optimizer_state
        return super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        engine = self._open_engine()
        if engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        engine.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        engine = self._open_engine()
        if engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != 1:
            raise ValueError(f"The checkpoint holds {len(states)} optimizer states; ProTrain trains with one.")
        engine.load_optimizer_state_dict(states[0])

    def teardown(self) -> None:
        engine = self._open_engine()
        if engine is not None:
            if self.optimizers and engine.optimizer_states:  # not after evaluation only
                # Kept for trainer.save_checkpoint() after fit; the engine and its chunks go away.
                self._final_optimizer_state = engine.optimizer_state_dict()
                self.precision_plugin.scaler = engine.scaler_state_dict()  # and the loss scaler's
            unroute_zero_grad(engine.optimizer)
            engine.close()
        self.engine = None
        if self._precision_plugin is not None:
            self._precision_plugin.engine = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_as_protrain(strategy_registry, cls)
