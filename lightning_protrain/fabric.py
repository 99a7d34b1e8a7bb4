"""``Fabric(strategy="protrain")``: the Fabric twin of ``ProTrainStrategy``.

``model, optimizer = fabric.setup(model, optimizer)`` hands both to the ProTrain engine (after
``fabric.launch()`` with several processes; on one device it is not needed: [Note: Fabric
without launch]). Without a plan the engine profiles the first training steps (they train as
usual), then switches to the fastest plan that fits ``planning.memory_budget`` and re-plans for
batches of other lengths; ``example_inputs=`` (with ``loss_fn``, default ``output.loss``)
profiles ahead at setup instead. Then ``fabric.backward(loss)``, ``optimizer.step()``,
``optimizer.zero_grad()`` (a step also clears the gradients it used), ``fabric.no_backward_sync``
for accumulation, and ``fabric.save`` / ``fabric.load`` (portable state dicts, written
atomically) work as usual. ``fabric.clip_gradients(model, optimizer, max_norm=...)`` between
backward and step clips exactly as with the default strategies and returns the total norm.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.accelerators import CUDAAccelerator
from lightning.fabric.strategies import DataParallelStrategy, DDPStrategy, ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

import protrain_core as pt
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
    own_precision,
)


class ProTrainFabricPrecision(EnginePrecision, Precision):
    def __init__(self, precision: str, strategy: ProTrainFabricStrategy, scaler: dict | None = None,
                 lightning: Precision | None = None) -> None:
        self.precision = precision
        self.strategy = strategy
        self.scaler = scaler  # a 16-mixed plugin's GradScaler settings
        # Lightning's own plugin of this precision (the one Fabric made): what runs, as under the default
        # strategy, a module and optimizers no engine runs (set up before any module, or never).
        self.lightning = lightning or Precision()

    def convert_input(self, data):
        """As Lightning's plugin of this precision: floating inputs in the compute dtype (without
        one, bf16-true's only)."""
        own = self.lightning.precision == self.precision
        return self.lightning.convert_input(data) if own else super().convert_input(data)

    def convert_output(self, data):
        """As Lightning's: floating outputs in the default dtype (a loss taken outside the module in fp32)."""
        return self.lightning.convert_output(data)

    def forward_context(self):
        engine = self.engine
        if engine is None:
            return self.lightning.forward_context()
        if torch.is_grad_enabled() and engine.states.trainables_changed() is not None:
            engine = self.strategy.wrap_anew()  # before the training forward
        return engine.autocast()

    def backward(self, tensor, model, *args, **kwargs) -> None:
        if self.engine is None:
            return self.lightning.backward(tensor, model, *args, **kwargs)
        self.engine.backward(tensor, run=(lambda t: t.backward(*args, **kwargs)) if args or kwargs else None)

    def unscale_gradients(self, optimizer) -> None:
        if self.engine is None:  # (the engine's own clipping unscales)
            self.lightning.unscale_gradients(optimizer)

    def optimizer_step(self, optimizer, **kwargs):
        engine = self.engine
        if engine is None:
            return self.lightning.optimizer_step(optimizer, **kwargs)
        # Fabric's optimizer wrapper resolves zero_grad to the optimizer class's own method,
        # which cannot see gradients kept in chunks: the step consumes them instead (Fabric
        # loops call zero_grad right after step anyway).
        engine.step(optimizer)
        if len(engine.optimizers) == 1:
            engine.zero_grad()  # (with several, gradients stay until the wrapper's zero_grad: it sets p.grad = None)
        # Fabric cannot see the loop between this step and the next forward, where code may read
        # the weights (an EMA, a save_pretrained): the offloaded chunks' updates end here too.
        engine.wait_for_updates()


class ProTrainFabricStrategy(StrategyPlumbing, ParallelStrategy):
    """Fabric strategy running the ProTrain engine.

    Args:
        config: every ProTrain setting (``protrain_core.ProTrainConfig``, or a dict of its
            fields, or a ``Plan`` alone; ``ProTrainStrategy``), gradient clipping included
            (``config.clipping``: ``fabric.clip_gradients`` with the same setting then only
            returns the norm).
        example_inputs: one batch to profile ahead, at ``fabric.setup`` (default: profile the
            first training steps).
        loss_fn: ``loss_fn(output) -> loss`` for profiling ahead (default ``output.loss``).
        device, accelerator, checkpoint_io, precision, parallel_devices, cluster_environment:
            Fabric's (set by ``Fabric(...)``).
        process_group_backend, timeout, start_method: as for Fabric's ``DDPStrategy`` (several
            processes: ``Fabric(devices=N, num_nodes=M)``, torchrun, SLURM).
    """

    _cuda_accelerator = CUDAAccelerator
    _ddp_class = DDPStrategy

    def __init__(
        self,
        config: pt.ProTrainConfig | None = None,
        *,
        example_inputs=None,
        loss_fn=None,
        device=None,
        accelerator=None,
        checkpoint_io=None,
        precision=None,
        parallel_devices=None,
        cluster_environment=None,
        process_group_backend: str | None = None,
        timeout=None,
        start_method: str = "popen",
    ) -> None:
        self.config = strategy_config(config, caller="ProTrainFabricStrategy")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        self._init_plumbing(device, process_group_backend, timeout, start_method)
        self.example_inputs, self.loss_fn = example_inputs, loss_fn
        self._waiting: list[torch.optim.Optimizer] = []  # set up before any module (setup_optimizer)
        self._backward_sync_control = self  # of which Fabric calls only no_backward_sync (its base class is private)

    # ----- Fabric plumbing ---------------------------------------------------------------------
    @property
    def precision(self) -> ProTrainFabricPrecision:
        if self._precision is None:
            self._precision = ProTrainFabricPrecision("32-true", self)
        return self._precision

    @precision.setter
    def precision(self, plugin) -> None:
        known = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
        self._precision = own_precision(plugin, ProTrainFabricPrecision, known, strategy=self, lightning=plugin)

    def _environment_for(self, call: str) -> None:
        """What ``fabric.launch()`` would have done, where it was not called: in one process,
        set up the device here; with several, refuse with the fix."""
        if not self._processes_ready:
            self.require_processes(call)
            self.setup_environment()

    def no_backward_sync(self, module, enabled: bool):
        """``fabric.no_backward_sync(model)``: the engine accumulates the gradients (``no_sync``)."""
        return self.engine.no_sync() if enabled and self.engine is not None else contextlib.nullcontext()

    def all_reduce(self, tensor, *args, **kwargs):
        if not self.is_distributed:
            return tensor
        self.require_processes("an all-reduce")
        return self.ddp().all_reduce(tensor, *args, **kwargs)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        self.require_processes("an all-gather")  # without a process group torch's returns the tensor alone
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def module_to_device(self, module: nn.Module) -> None:
        pass  # the engine places every parameter itself

    def module_init_context(self, empty_init: bool | None = None):
        """``fabric.init_module(empty_init=True)`` builds the model's parameters on the meta device
        (``parameters_on_meta``): the engine fills each chunk from ``ProTrainConfig.weights`` or the
        modules' own initialisation ([Note: weights straight into chunks]). Otherwise on the host,
        as FSDP's does: the engine moves what the plan keeps on the device."""
        stack = contextlib.ExitStack()
        if empty_init:
            stack.enter_context(parameters_on_meta())
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_module(self, module: nn.Module) -> nn.Module:
        """``fabric.setup(model)`` and ``fabric.setup_module(model)``: an engine for evaluation
        (``for_evaluation``), which ``fabric.setup_optimizers(optimizer)`` replaces by a training
        engine (the optimizer may be built from the set-up module's parameters, as for FSDP)."""
        if next(module.parameters(), None) is None:
            return module  # nothing to manage (Lightning's own tests set up an empty nn.Sequential beside a model)
        if self._open_engine() is not None and module is self.engine.module:
            return module  # set up again: the engine it has
        if self._waiting:  # fabric.setup_optimizers(optimizer) came first (DDP allows that order)
            return self.setup_module_and_optimizers(module, [])[0]
        self._refuse_a_second_model()
        self._environment_for("fabric.setup_module(model)")
        self._build_engine(module, *for_evaluation(module, self.config, None), self.precision)
        return module

    def setup_optimizer(self, optimizer):
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``: a training
        engine with this optimizer replaces the evaluation one. Before any module: the optimizer
        waits for the ``fabric.setup_module`` of a module with its parameters."""
        engine = self._open_engine()
        if engine is None:
            self._waiting.append(optimizer)
        else:
            self._rebuild([*engine.optimizers, optimizer] if engine.optimizer_states else [optimizer])
        return optimizer

    def _rebuild(self, optimizers: list) -> None:
        """The engine built again for its module with ``optimizers`` (``fabric.setup_optimizers``
        after ``setup_module``, or ``fabric.setup`` of its module again), with the weights and
        the optimizer states it had."""
        engine = self.engine
        optimizers = self._checked(optimizers)
        if engine.optimizer_states:  # (fabric.setup_optimizers(opt_a, opt_b): one engine steps both)
            close_for_a_new_engine(engine, self.precision)
        else:
            engine.close()
        self._build_for_training(engine.module, optimizers)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if self._open_engine() is not None and module is self.engine.module:  # set up again
            self._rebuild(list(optimizers))
            return module, optimizers, scheduler
        self._refuse_a_second_model()
        optimizers = self._checked(self._claim_waiting(module, list(optimizers)))
        self._environment_for("fabric.setup(model, optimizer)")
        self._build_for_training(module, optimizers)
        return module, optimizers, scheduler

    def _claim_waiting(self, module: nn.Module, optimizers: list) -> list:
        """``optimizers`` and those set up before any module (over ``module``'s parameters, or
        refused): the engine's."""
        params = {id(p) for p in module.parameters()}
        for o in self._waiting:
            if o not in optimizers and not any(id(p) in params for g in o.param_groups for p in g["params"]):
                raise RuntimeError(
                    "fabric.setup_optimizers set up an optimizer over parameters of another model than "
                    f"{type(module).__name__}, and one ProTrain strategy runs one model. Put both models in one "
                    "nn.Module (e.g. nn.ModuleDict) and set it up once, or give the other model its own Fabric.")
        self._waiting, claimed = [], [o for o in self._waiting if o not in optimizers]
        return optimizers + claimed

    def _refuse_a_second_model(self) -> None:
        if self._open_engine() is not None:
            raise RuntimeError(
                "This ProTrain strategy already runs a model: fabric.setup was called "
                f"before (for {type(self.engine.module).__name__}), and one ProTrain strategy runs one model. "
                "To train several models, put them in one nn.Module (e.g. nn.ModuleDict({'generator': g, "
                "'discriminator': d})) and call fabric.setup once, with an optimizer for each part (of one class) or "
                "one optimizer with a param group each; or give the other model its own Fabric."
            )

    def _checked(self, optimizers: list) -> list[torch.optim.Optimizer]:
        optimizers = check_optimizers(optimizers)
        if len(optimizers) > 1 and self.is_distributed:
            raise RuntimeError(
                "The ProTrain Fabric strategy runs several optimizers in one process only: Fabric's optimizer.zero_grad() "
                "reaches the engine through p.grad, which no rank holds whole when the chunks are sharded over "
                f"{self.world_size} processes. Use the Trainer's manual optimization for several processes, or one "
                "optimizer with a param group per part.")
        return optimizers

    def _build_for_training(self, module: nn.Module, optimizers: list) -> None:
        searched = self.config.planning.plan is None
        self._build_engine(module, optimizers, self.config, self.precision,
                           example_inputs=self.example_inputs if searched else None, loss_fn=self.loss_fn)
        if not searched:
            rank_zero_info(f"ProTrain: {self.engine.plan} (given), overlap: {self.engine.overlap}")
        elif self.example_inputs is not None:
            rank_zero_info(self.engine.explain())

    def wrap_anew(self) -> pt.Engine:
        """Which parameters train changed between steps: the engine is built again for them
        (``close_for_a_new_engine``), before the training forward."""
        engine = self.engine
        close_for_a_new_engine(engine, self.precision)
        return self._build_engine(engine.module, list(engine.optimizers), self.config, self.precision)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        if self.engine is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return self.engine.clipping.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module, optimizer, clip_val):
        if self.engine is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self.engine.clipping.clip_grad_value_(clip_val)

    # ----- state -------------------------------------------------------------------------------
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if self.engine is not None and module is self.engine.module:
            return self.engine.state_dict()
        return super().get_module_state_dict(module)

    def get_optimizer_state(self, optimizer) -> dict:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if self.engine is not None and any(optimizer is o for o in self.engine.optimizers):
            return checkpoint_optimizer_state(self.engine, optimizer)
        return super().get_optimizer_state(optimizer)

    def load_module_state_dict(self, module, state_dict, strict: bool = True) -> None:
        if self.engine is not None and module is self.engine.module:
            return self.engine.load_state_dict(state_dict, strict=strict)
        return super().load_module_state_dict(module, state_dict, strict=strict)

    def _is_engine_object(self, obj) -> str | None:
        """"model" / "optimizer" when ``obj`` (maybe wrapped by Fabric) is the engine's."""
        obj = getattr(obj, "_forward_module", obj)
        engine = self._open_engine()
        if engine is None:
            return None
        if obj is engine.module:
            return "model"
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return None  # it has an .optimizer too, but its own state
        return "optimizer" if any(getattr(obj, "optimizer", obj) is o for o in engine.optimizers) else None

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        """``state_dict_type="sharded"``: the model and optimizer go into a
        ``torch.distributed.checkpoint`` directory, every rank writing its own shards; the rest
        of ``state`` beside them (rank 0)."""
        if self.state_dict_type != "sharded" or not any(self._is_engine_object(v) for v in state.values()):
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        meta = {k: (v.state_dict() if hasattr(v, "state_dict") else v)
                for k, v in state.items() if not self._is_engine_object(v)}
        self.engine.save_sharded(path, meta=meta)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None):
        raw = isinstance(state, (nn.Module, torch.optim.Optimizer))  # fabric.load_raw: the file is its state dict
        meta = self._sharded_meta(path)
        if meta is None:
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            if raw:
                return self._restore(path, {"raw": state}, {"raw": checkpoint}, strict)
            return self._restore(path, state or {}, checkpoint, strict)
        if raw:
            raise ValueError(f"fabric.load_raw reads one state-dict file, and {path} is a sharded checkpoint "
                             "directory: load it with fabric.load(path, {'model': model, 'optimizer': optimizer}).")
        state = state or {}
        if self.engine is None:
            raise RuntimeError("The ProTrain engine is built by fabric.setup(model, optimizer) or "
                               "fabric.setup_module(model); neither was called yet.")
        kinds = {key: self._is_engine_object(obj) for key, obj in state.items()}
        self.engine.load_sharded(path, model="model" in kinds.values(), optimizer="optimizer" in kinds.values(),
                                 strict=strict)
        return self._restore(path, state, meta, strict, skip={k for k, kind in kinds.items() if kind})

    def _restore(self, path, state: dict, saved: dict, strict: bool, skip=frozenset()) -> dict:
        """Every entry of ``state`` but ``skip`` from ``saved``: modules and the engine's
        optimizers through the engine, other objects by their ``load_state_dict``, anything else
        replaced in ``state``. What is left of ``saved``."""
        for key in [k for k in state if k not in skip]:
            obj = getattr(state[key], "_forward_module", state[key])
            if key not in saved:
                if strict:
                    raise KeyError(f"'{key}' is not in the checkpoint {path}; its keys: {sorted(saved)}.")
                continue
            value = saved.pop(key)
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(obj, value, strict=strict)
            elif self._is_engine_object(obj) == "optimizer":  # not an LR scheduler (it has .optimizer too)
                load_checkpoint_optimizer_state(self.engine, value, getattr(obj, "optimizer", obj))
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return saved

    def teardown(self) -> None:
        engine = self._open_engine()
        if engine is not None:
            self.precision.scaler = engine.states.scaler()  # for fabric.save after teardown
            engine.close()
        super().teardown()


# [Note: Fabric without launch]
# Fabric asks for fabric.launch() before setup, collectives and checkpoints with every strategy
# that is not one of its single-device or DataParallel strategies, with a message about "more
# than one device". ProTrain's cannot be a SingleDeviceStrategy: Fabric turns no_backward_sync
# (which ProTrain needs to accumulate) into a no-op for those. So the class is a *virtual*
# subclass of DataParallelStrategy (ABCMeta.register: isinstance only, no method is inherited),
# which exempts it from that check, as Fabric() on one device is exempt; Lightning 2.6's Fabric
# tests that class nowhere else. The launch is then checked here, where it matters:
# - one process: fabric.setup(model, optimizer) sets up the device itself (what launch() does:
#   setup_environment) when launch() was not called; the data order, seeds and samplers are a
#   single-device run's either way;
# - several (devices x nodes > 1, torchrun, SLURM): fabric.setup and every collective before
#   launch() are refused, saying to call fabric.launch() (StrategyPlumbing.require_processes); a
#   distributed sampler's arguments need no process group (as DDP's strategy gives them).
DataParallelStrategy.register(ProTrainFabricStrategy)
