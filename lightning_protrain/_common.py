"""What the Trainer strategy and the Fabric strategy share: precision plugins, the optimizer
check, the engine's construction (``StrategyPlumbing``), and atomic checkpoint files."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

import protrain_core as pt
from protrain_core.precision import parse_precision
from protrain_core.runtime.optim import check_optimizer


def precision_of_plugin(plugin, known_plugins: tuple[type, ...]) -> str:
    """The engine's precision for one of Lightning's own precision plugins (``known_plugins``;
    through ``protrain_core.precision``'s one table); any other plugin is refused."""
    if type(plugin) not in known_plugins:
        raise ValueError(
            f"The ProTrain strategy cannot use the precision plugin {type(plugin).__name__}; pass precision= "
            "'32-true', '16-mixed', 'bf16-mixed' or 'bf16-true' instead of a plugin."
        )
    return parse_precision(plugin.precision).value


def own_precision(plugin, own: type, known_plugins: tuple[type, ...], **kwargs):
    """``plugin`` as the strategy's own precision plugin class ``own``: Lightning's becomes one of
    its precision, with a 16-mixed plugin's ``torch.amp.GradScaler`` settings (initial scale,
    growth and backoff; its ``state_dict`` format) for the engine's own loss scaler."""
    if plugin is None or isinstance(plugin, own):
        return plugin
    scaler = getattr(plugin, "scaler", None)
    scaler = scaler.state_dict() if scaler is not None and scaler.is_enabled() else None
    return own(precision_of_plugin(plugin, known_plugins), scaler=scaler, **kwargs)


@contextlib.contextmanager
def parameters_on_meta():
    """``init_module(empty_init=True)``: every parameter registered inside is on the meta device
    (no memory until the engine fills its chunk: [Note: weights straight into chunks]); buffers
    and other tensors, such as a torchmetrics metric's states, are made on the host with their
    values, which nothing could fill later."""
    def to_meta(module, name, param):
        if type(param) is nn.Parameter and not param.is_meta:
            return nn.Parameter(param.to("meta"), param.requires_grad)
        return None

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into a temporary file, then rename: never a torn checkpoint file (local
    paths; remote ones and storage options go to Lightning's own writer)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        with pt.utils.atomic_file(path) as f:
            torch.save(checkpoint, f)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        """Memory-mapped (local files): every rank of a sharded run reads only the pieces it
        copies into its shards, not the whole file into memory."""
        if "://" in str(path) or map_location not in (None, "cpu"):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except RuntimeError as e:  # a torn zip archive: say what it means
            raise ValueError(
                f"The checkpoint {path} cannot be read ({e}). The file is truncated (a save that did not finish?) "
                "or not a checkpoint; pass another one, or none to start from scratch."
            ) from None


def _on_gloo() -> bool:
    """The process group is up and gloo's (CPU processes): a barrier and a broadcast then run as
    ProTrain's, which ctrl-C interrupts (in gloo's, with a peer gone, it prints gloo's error)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        "gloo" in str(torch.distributed.get_backend())


class StrategyPlumbing:
    """What the Trainer and the Fabric strategy do alike, placed before their Lightning base
    class (a ``ParallelStrategy``): the engine's construction, checkpoint IO, the root device,
    offloading the open engine's states, and the processes. One process: nothing is launched
    and no process group is created (a single-device run's data order, seeds and loaders).
    Several (``devices`` x ``num_nodes`` > 1, torchrun, SLURM): Lightning's own DDP strategy of
    that flavour (``_ddp_class``) launches them, sets up the process group ProTrain shards its
    chunks over, and runs this strategy's collectives (but a barrier and a broadcast on gloo)."""

    _ddp_class: type
    _cuda_accelerator: type  # that flavour's CUDAAccelerator
    config: pt.ProTrainConfig

    def _init_plumbing(self, device, process_group_backend, timeout, start_method) -> None:
        # device None: the accelerator's (Lightning creates registered strategies without one).
        self._root_device = torch.device(device) if device is not None else None
        self.num_nodes = 1  # set by Lightning's connectors
        self._pg_args = dict(process_group_backend=process_group_backend, start_method=start_method)
        if timeout is not None:
            self._pg_args["timeout"] = timeout
        self._ddp = None
        self._processes_ready = False
        self.engine: pt.Engine | None = None
        self._filled = weakref.WeakSet()  # modules an engine filled from ProTrainConfig.weights

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """Several processes (Lightning then adds distributed samplers)."""
        return self.num_processes * self.num_nodes > 1 or (
            self.cluster_environment is not None and self.cluster_environment.creates_processes_externally
            and self.cluster_environment.world_size() > 1)

    def ddp(self):
        """Lightning's DDP strategy for the same devices, nodes and cluster environment: it
        launches the processes and sets up the process group."""
        if self._ddp is None:
            self._ddp = self._ddp_class(accelerator=self.accelerator, parallel_devices=self.parallel_devices,
                                        cluster_environment=self.cluster_environment, **self._pg_args)
            self._ddp.num_nodes = self.num_nodes
        return self._ddp

    def _configure_launcher(self) -> None:
        if not self.is_distributed:
            self._launcher = None
            return
        if self._root_device is not None:
            raise ValueError(
                f"ProTrain was given device={self._root_device} but runs {self.num_processes} processes x "
                f"{self.num_nodes} nodes, each on its own device: remove device= (or use devices=1)."
            )
        if self._pg_args["start_method"] != "popen":
            raise ValueError(
                f"ProTrain starts its processes with Lightning's script launcher (start_method='popen'); "
                f"start_method={self._pg_args['start_method']!r} is not supported. Run a script (python train.py, "
                "torchrun or srun) rather than a notebook."
            )
        ddp = self.ddp()
        ddp._configure_launcher()  # the hook every Lightning strategy implements
        self._launcher = ddp.launcher

    def set_world_ranks(self) -> None:
        """This process's global rank and the world size, from the devices and nodes (what
        Lightning's connectors ask every strategy for before the launch)."""
        env = self.cluster_environment
        if env is None or not self.is_distributed:
            return
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks  # (Fabric's connector's name for it)

    def setup_environment(self) -> None:
        """After the launch, in every process: the device, and the process group (and the world
        ranks)."""
        super().setup_environment()
        if self.is_distributed:
            self.ddp().setup_environment()
        self._processes_ready = True

    def require_processes(self, call: str) -> None:
        """Several processes: refuse ``call`` before their launch set up the process group
        (Fabric without ``fabric.launch()``: see [Note: Fabric without launch])."""
        if self.is_distributed and not self._processes_ready:
            raise RuntimeError(
                f"ProTrain runs {self.num_processes} process(es) x {self.num_nodes} node(s) here, and {call} needs "
                "them started: call fabric.launch() first (it starts the other processes, or joins them under "
                "torchrun/SLURM, and sets up their process group), or run the script with `fabric run`. "
                "On one device, fabric.launch() is not needed."
            )

    @property
    def distributed_sampler_kwargs(self) -> dict | None:
        """None in one process (Fabric then keeps the loaders' samplers)."""
        if not self.is_distributed:
            return None
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def barrier(self, *args, **kwargs) -> None:
        if not self.is_distributed:
            return
        self.require_processes("a barrier")
        if _on_gloo():
            pt.barrier()
            return
        self.ddp().barrier(*args, **kwargs)

    def broadcast(self, obj, src: int = 0):
        if not self.is_distributed:
            return obj
        self.require_processes("a broadcast")
        return pt.broadcast_object(obj, src) if _on_gloo() else self.ddp().broadcast(obj, src)

    def reduce(self, tensor, *args, **kwargs):
        return self.ddp().reduce(tensor, *args, **kwargs) if self.is_distributed else tensor

    @property
    def state_dict_type(self) -> str:
        return self.config.checkpoint.state_dict_type

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "protrain" not in strategy_registry:
            strategy_registry.register(
                "protrain", cls, description="ProTrain: chunked, offloaded model states with automatic planning"
            )

    def _report(self, text: str, **metrics) -> None:
        """What the engine's planner says (``wrap``'s ``report``), printed once (rank zero)."""
        rank_zero_info(text)

    def _build_engine(self, module: nn.Module, optimizer, config: pt.ProTrainConfig, plugin: EnginePrecision,
                      **kwargs) -> pt.Engine:
        """``self.engine``: ``wrap`` of ``module`` at the precision of ``plugin``, whose loss scaler
        state (the user's GradScaler settings, or a closed engine's) it starts from."""
        if config.weights is not None and module in self._filled:  # by an engine before (evaluation after fit,
            config = config.replace(weights=None)                     # an engine built again)
        self.engine = pt.wrap(module, optimizer, config=config, precision=plugin.precision, device=self.root_device,
                              report=self._report, **kwargs)
        if config.weights is not None:
            self._filled.add(module)
        # What module.to() records on Lightning's modules (the engine placed the parameters itself):
        # self.device is the device computing, self.dtype bf16 under bf16-true. Lightning's own
        # Fabric records them so for strategies that place parameters (no public setter exists).
        _update_properties(module, device=self.root_device,
                           dtype=torch.bfloat16 if plugin.precision == "bf16-true" else None)
        if plugin.scaler and self.engine.scaler is not None:
            self.engine.states.load_scaler(plugin.scaler)
        return self.engine

    def _open_engine(self) -> pt.Engine | None:
        return self.engine if self.engine is not None and not self.engine.closed else None

    # ----- the device lent between phases ([Note: parking] in protrain_core/runtime/parking.py) --
    def offload_states(self, *, non_blocking: bool = False):
        """Move the training state off the device (``Engine.offload_states``) between steps, from
        a Trainer callback or a Fabric loop, until ``onload_states()``; the engine's handle, or
        None without an open engine (between Trainer ``fit`` calls)."""
        engine = self._open_engine()
        return None if engine is None else engine.offload_states(non_blocking=non_blocking)

    def onload_states(self) -> None:
        """Back to the device what ``offload_states`` moved (every rank calls it)."""
        engine = self._open_engine()
        if engine is not None:
            engine.onload_states()

    def _sharded_meta(self, path) -> dict | None:
        """What a sharded checkpoint directory ``path`` keeps beside its shards, once rank 0
        finished what a save of it killed between its renames left (``checkpoint.recover``);
        None where ``path`` is no such directory."""
        from protrain_core.checkpoint import is_sharded_checkpoint, read_meta, recover

        if self.global_rank == 0:
            recover(path)
        self.barrier("protrain-recover-checkpoint")
        return read_meta(path) if is_sharded_checkpoint(path) else None

    @property
    def checkpoint_io(self):
        """``AtomicCheckpointIO`` unless another IO is set."""
        io = self._checkpoint_io
        if io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif getattr(io, "checkpoint_io", False) is None:  # a wrapping IO given none (AsyncCheckpointIO()): ours
            io.checkpoint_io = AtomicCheckpointIO()      # inside, as Lightning's strategies give theirs
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        self._checkpoint_io = io

    @property
    def root_device(self) -> torch.device:
        """The ``device=`` given; else this process's device of the accelerator's devices; else
        the accelerator's current device."""
        if self._root_device is not None:
            return self._root_device
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank]
        cuda = isinstance(self.accelerator, self._cuda_accelerator)
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


class EnginePrecision:
    """What both precision plugins do alike, placed before their Lightning base class:
    bf16-true inputs, and the checkpoint entry: the fp16 loss scaler's state (empty otherwise;
    ``scaler``: the state kept when the last engine closed, or the user's GradScaler settings)."""

    precision: str
    scaler: dict | None
    strategy: StrategyPlumbing | None  # whose engine runs the steps (None: no strategy took the plugin yet)

    @property
    def engine(self) -> pt.Engine | None:
        return None if self.strategy is None else self.strategy.engine

    @contextlib.contextmanager
    def tensor_init_context(self):
        """bf16-true: tensors (a model under ``init_module``) are created in bf16, as Lightning's
        HalfPrecision creates them: the model is built in half the memory."""
        if self.precision != "bf16-true":
            yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def module_init_context(self):
        return self.tensor_init_context()

    def convert_input(self, data):
        """bf16-true: floating-point inputs become bf16 (as Lightning's HalfPrecision converts them)."""
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    def state_dict(self) -> dict:
        engine = self.engine
        scaler = engine.states.scaler() if engine is not None and not engine.closed else self.scaler
        return {"scaler": scaler} if scaler else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("scaler") and self.engine is not None and self.engine.scaler is not None:
            self.engine.states.load_scaler(state_dict["scaler"])


def check_optimizers(optimizers) -> list[torch.optim.Optimizer]:
    """The optimizers, unwrapped from Lightning's wrappers, checked as ``wrap`` checks each one;
    optimizers without parameters are refused."""
    opts = [o if isinstance(o, torch.optim.Optimizer) else getattr(o, "optimizer", o) for o in optimizers]
    if no_parameters(opts):
        raise ValueError(
            "The ProTrain strategy trains with an optimizer over the model's parameters, and got one without "
            "parameters: build it from model.parameters(), or set the model up alone (fabric.setup(model)) to "
            "evaluate."
        )
    for opt in opts:
        check_optimizer(opt)  # raises ValueError naming what is supported
    return opts


def no_parameters(optimizers) -> bool:
    """Whether ``optimizers`` hold no parameter (Lightning's stand-in when ``configure_optimizers``
    returns None has none)."""
    return not any(group.get("params") for opt in optimizers for group in getattr(opt, "param_groups", None) or [])


def strategy_config(config, *, caller: str) -> pt.ProTrainConfig:
    """A strategy's ``config`` argument (a ``ProTrainConfig``, a dict of its fields, a ``Plan`` or
    a dict of its fields, or None: the defaults); what the Lightning loop decides itself is
    refused here, before anything is built."""
    if isinstance(config, dict) and config and set(config) <= {f.name for f in dataclasses.fields(pt.Plan)}:
        config = pt.Plan.from_dict(config)  # (no Plan field is a configuration field)
    if isinstance(config, pt.Plan):
        config = pt.ProTrainConfig(planning=pt.PlanningConfig(plan=config))
    elif isinstance(config, dict):
        config = pt.ProTrainConfig(**config)
    elif config is not None and not isinstance(config, pt.ProTrainConfig):
        raise ValueError(f"{caller}(config=...) takes a protrain_core.ProTrainConfig, a dict of its fields, or a Plan; "
                         f"got {type(config).__name__}.")
    config = config or pt.ProTrainConfig()
    if not config.optimizer_states:
        raise ValueError(
            f"{caller}(config=ProTrainConfig(optimizer_states=False)): the strategy decides that itself (fit "
            "trains; validate, test and predict build an engine without optimizer states). Remove the setting."
        )
    return config


def for_evaluation(module: nn.Module, config: pt.ProTrainConfig, plan: pt.Plan | None) -> tuple:
    """(optimizer, config) of an engine that only evaluates: an optimizer nobody steps (the
    engine allocates no states for it), and ``plan`` -- else the configuration's, else every
    chunk streamed -- with no search."""
    plan = config.planning.plan or plan or pt.Plan(n_persist=0, n_buffer=2)
    return torch.optim.AdamW(module.parameters()), config.replace(
        planning={"plan": plan, "memory_budget": None, "max_tokens": None}, optimizer_states=False)


def close_for_a_new_engine(engine: pt.Engine, plugin: EnginePrecision) -> None:
    """Close ``engine`` so that a new one can be built for the parameters that train now
    (``StateAccess.trainables_changed``; a plan of the configuration is kept, a searched one is
    searched again), from the weights (the module's after ``close``) and the optimizer state
    (loaded into the optimizer); ``plugin`` keeps the loss scaler's state for the new engine."""
    changed = engine.states.trainables_changed()
    if changed is not None:
        rank_zero_info(f"ProTrain: {changed}; the engine is built again for the parameters that train now.")
    states = [engine.states.optimizer(rank0_only=False, of=o) for o in engine.optimizers]
    plugin.scaler = engine.states.scaler() or plugin.scaler
    engine.close()
    for optimizer, state in zip(engine.optimizers, states):
        optimizer.load_state_dict(state)


# The exact 8-bit optimizer state beside torch's format in a full checkpoint's optimizer entry.
EXACT_STATE = "protrain_8bit_state"


def checkpoint_optimizer_state(engine: pt.Engine, optimizer: torch.optim.Optimizer) -> dict:
    """A full checkpoint's entry for ``optimizer`` (one of the engine's), in the format of the
    user's torch optimizer, which loads it under Lightning's default strategies. With 8-bit
    moments that is their fp32 values, and the 8-bit state itself is kept beside them
    (``EXACT_STATE``: torch's ``load_state_dict`` ignores the key) to resume from bit for bit."""
    osd = engine.states.optimizer(of=optimizer)
    if engine.config.optimizer_state_format != "8bit" or not osd:
        return osd
    return {**pt.to_fp32_adam_state(osd), EXACT_STATE: osd}


def load_checkpoint_optimizer_state(engine: pt.Engine, osd: dict, optimizer: torch.optim.Optimizer) -> None:
    """The entry ``checkpoint_optimizer_state`` wrote: the exact 8-bit state where the engine keeps
    8-bit moments, else the fp32 values beside it (no bitsandbytes needed to read those)."""
    if EXACT_STATE in osd and engine.config.optimizer_state_format == "8bit":
        osd = osd[EXACT_STATE]
    engine.states.load_optimizer({k: v for k, v in osd.items() if k != EXACT_STATE}, of=optimizer)

