"""One configuration for ProTrain: ``ProTrainConfig``, taken by ``wrap`` and by both Lightning
strategies (``ProTrainStrategy(config=...)``, ``ProTrainFabricStrategy(config=...)``), and set
from a LightningCLI config file like any other argument.

It is frozen and nested by concern: what to plan (``planning``), how to clip gradients
(``clipping``), the runtime's switches (``runtime``) and the checkpoint format
(``checkpoint``). Each part checks its fields when it is created, so a wrong setting fails where
it is written. Nested parts may be given as dicts, as a YAML file gives them
(``ProTrainConfig(planning={"memory_budget": "20GiB"})``).

What is not a setting stays an argument: the model, the optimizer, the device and precision
(under Lightning: the Trainer's and Fabric's own), a batch to profile ahead, the report
callback and the process group.

Environment variables may set some defaults (read when the part is created):
``PROTRAIN_REPROFILE``, ``PROTRAIN_CACHE_DIR`` (planning), ``PROTRAIN_NO_PIN``,
``PROTRAIN_CPU_ADAM_THREAD``, ``PROTRAIN_ONEPASS`` (runtime). A field given explicitly wins.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from protrain_core.plan import Plan, plan_arguments
from protrain_core.runtime.compiled import check_compile
from protrain_core.runtime.options import RuntimeConfig, env_flag
from protrain_core.runtime.frozen_formats import check_frozen_format
from protrain_core.runtime.state_formats import check_format
from protrain_core.update import ClippingConfig

__all__ = ["CheckpointConfig", "ClippingConfig", "PlanningConfig", "ProTrainConfig", "RuntimeConfig"]


@dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """What the engine runs: a given plan, or what to search one for."""

    plan: Plan | None = None
    """The plan to run (a ``Plan``, or a dict of its fields). None: search the fastest plan that
    fits ``memory_budget`` on the first training steps (or ahead, given a batch to profile)."""

    memory_budget: int | str | None = None
    """Device memory the searched plan may use: bytes, or "20GiB", "500MB"... None: the device's
    free memory less a margin. Only without ``plan``."""

    max_tokens: int | None = None
    """Plan once for batches of up to this many tokens (batch x sequence). None: the plan
    follows the batch shapes. Only without ``plan``."""

    blocks: str | Sequence[str] | None = None
    """The transformer blocks, when discovery fails: the dotted name of their ``nn.ModuleList``
    (or a list of names: an encoder-decoder's stacks; from Python, the ModuleList itself)."""

    chunk_size: int | None = None
    """Elements per chunk. None: the size that wastes the least."""

    profile_cache: bool = True
    """Reuse a profile cached on disk for the same model, batch shape, precision and hardware."""

    cache_dir: str | None = None
    """Where profiles are cached. None: ``$PROTRAIN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/protrain``, else ``~/.cache/protrain``."""

    reprofile: bool = field(default_factory=lambda: env_flag("PROTRAIN_REPROFILE", False))
    """Profile again even when a cached profile matches. Default: False, unless
    ``PROTRAIN_REPROFILE=1``."""

    def __post_init__(self) -> None:
        plan, _ = plan_arguments(self.plan, self.memory_budget, self.max_tokens)
        object.__setattr__(self, "plan", plan)
        blocks = self.blocks
        if isinstance(blocks, list):
            object.__setattr__(self, "blocks", blocks := tuple(blocks))
        if isinstance(blocks, tuple) and not blocks:
            raise ValueError("blocks=[] names no block list: give one or more dotted names, or None to discover them.")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):
            raise ValueError(f"chunk_size={self.chunk_size!r}: give the elements per chunk, a positive integer, or "
                             "None for the automatic search.")
        for name in ("profile_cache", "reprofile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PlanningConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"PlanningConfig.cache_dir must be a directory path or None, got {self.cache_dir!r}.")
        if not (blocks is None or isinstance(blocks, (str, nn.ModuleList)) or isinstance(blocks, tuple)
                and all(isinstance(b, (str, nn.ModuleList)) for b in blocks)):
            raise ValueError(f"PlanningConfig.blocks must name the blocks' nn.ModuleList (a dotted name, or a list of "
                             f"them), or be None to discover them; got {blocks!r}.")

    @property
    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None: the default)."""
        return plan_arguments(None, self.memory_budget)[1] if self.plan is None else None


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How the Lightning strategies write checkpoints (``wrap``'s engine saves with its own
    ``save_sharded`` / ``state_dict``)."""

    state_dict_type: Literal["full", "sharded"] = "full"
    """"full": one checkpoint file, gathered to rank 0 (opens anywhere); "sharded": a
    ``torch.distributed.checkpoint`` directory written by every rank (no gather)."""

    def __post_init__(self) -> None:
        if self.state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r}: use 'full' (one checkpoint file, gathered to rank 0) or "
                "'sharded' (a torch.distributed.checkpoint directory written by every rank)."
            )


_PARTS = {"planning": PlanningConfig, "runtime": RuntimeConfig, "checkpoint": CheckpointConfig}


@dataclass(frozen=True, kw_only=True)
class ProTrainConfig:
    """Every setting of a ProTrain run (see the module's docstring)."""

    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """The plan, or what to search one for."""

    clipping: ClippingConfig | None = None
    """Gradient clipping before every update (None: none). Under the Trainer, set
    ``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)`` instead, as for any
    strategy."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """The runtime's switches."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The checkpoint format of the Lightning strategies."""

    optimizer_states: bool = True
    """False (``wrap`` only): an engine for evaluation only, which never steps and holds no
    optimizer states; it needs a plan. (The strategies build one for validate, test and
    predict themselves.)"""

    optimizer_state_format: Literal["fp32", "bf16", "8bit"] = "fp32"
    """How Adam's moments are kept, in every chunk ([Note: optimizer-state formats]):
    "fp32" as torch keeps them (8 bytes per trainable parameter; bitwise torch AdamW),
    "bf16" in bfloat16 (4 bytes; bitwise ``protrain_core.AdamWBf16Moments``), "8bit" in
    bitsandbytes' block-wise 8-bit format (2.03 bytes; bitwise ``bitsandbytes.optim.AdamW8bit``;
    needs ``pip install 'lightning-protrain[8bit]'``; sharded over processes at block boundaries).
    The master weights and the gradient accumulator stay fp32."""

    frozen_dtype: Literal["int8", "fp8"] | None = None
    """How frozen weight matrices (LoRA's base) are kept on the host and uploaded ([Note:
    quantised frozen chunks]): None in the compute dtype (2 bytes in the bf16 modes), "int8"
    (8-bit integers) or "fp8" (float8 e4m3), each with a power-of-two fp32 scale per output
    channel (about 1 byte), dequantised on the device after the upload. The model computes with
    the dequantised weights (``protrain_core.dequantised`` gives the plain-PyTorch reference);
    norms and biases keep the compute dtype. Sharded over processes as the unquantised span is."""

    grad_accumulator: bool | None = None
    """Whether each offloaded (streamed) chunk keeps an fp32 gradient accumulator in host
    memory: 4 bytes per trainable parameter ([Note: gradients consumed where they land]).
    False keeps none: the CPU Adam reads each gradient where it lands, during backward, with
    the same results. It needs precision "bf16-mixed", one backward per step (no ``no_sync``
    accumulation) and no clipping by norm or between backward and step. None: the Trainer
    strategy leaves it out where its settings allow; elsewhere True."""

    weights: str | None = None
    """Where a model built on the meta device (``with torch.device("meta")``, ``init_module(
    empty_init=True)``) takes its weights, chunk by chunk, without a host copy of the model
    ([Note: weights straight into chunks]): a Hugging Face model directory (safetensors files),
    a ``.safetensors`` file, a ``torch.save``d state dict or Lightning checkpoint, or a sharded
    ProTrain checkpoint directory (from Python also a state dict itself). Parameters it does not
    hold, and every parameter when None, are initialised by their modules (a Hugging Face
    model's ``_init_weights``, PEFT's LoRA initialisation, else ``reset_parameters``). A model
    whose parameters are on the host is used as it is."""

    compile: bool | dict = False
    """``torch.compile`` of each transformer block and of the stem and head units, per module,
    with the runtime's hooks outside the compiled regions ([Note: compiled units] in
    runtime/compiled.py): False (default) runs them eagerly, True compiles with torch's
    defaults, a dict gives ``torch.compile``'s ``backend``, ``mode``, ``options``, ``dynamic``
    and ``fullgraph``. Every plan works compiled; a checkpointed block recomputes with the
    compiled forward. Under the Trainer and Fabric a model compiled with ``torch.compile`` is
    compiled this way, with its options."""

    def __post_init__(self) -> None:
        for name, cls in _PARTS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, _part(cls, value, name))
            elif not isinstance(value, cls):
                raise ValueError(f"ProTrainConfig.{name} must be a {cls.__name__} (or a dict of its fields), "
                                 f"got {type(value).__name__}.")
        clipping = self.clipping
        if isinstance(clipping, (tuple, list)):  # ("norm", 1.0[, norm_type])
            clipping = dict(zip(("algorithm", "value", "norm_type"), clipping))
        if isinstance(clipping, dict):
            object.__setattr__(self, "clipping", _part(ClippingConfig, clipping, "clipping"))
        elif clipping is not None and not isinstance(clipping, ClippingConfig):
            raise ValueError(f"ProTrainConfig.clipping must be a ClippingConfig, a dict of its fields, "
                             f"(algorithm, value) or None, got {type(clipping).__name__}.")
        if not any(self.grad_accumulator is v for v in (None, True, False)):
            raise ValueError(f"ProTrainConfig.grad_accumulator must be True, False or None, got {self.grad_accumulator!r}.")
        if not isinstance(self.optimizer_states, bool):
            raise ValueError(f"ProTrainConfig.optimizer_states must be True or False, got {self.optimizer_states!r}.")
        check_format(self.optimizer_state_format)
        check_frozen_format(self.frozen_dtype)
        check_compile(self.compile)

    @property
    def keeps_accumulators(self) -> bool:
        """Whether streamed chunks keep a gradient accumulator (``grad_accumulator`` not False)."""
        return self.grad_accumulator is not False

    def replace(self, **parts) -> ProTrainConfig:
        """A copy with some fields replaced; nested parts by dict: ``replace(planning={"plan": p})``
        keeps the other planning fields."""
        _check_fields(ProTrainConfig, parts, "ProTrainConfig")
        changes = {}
        for name, value in parts.items():
            current = getattr(self, name)
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                _check_fields(type(current), value, f"ProTrainConfig.{name}")
                value = dataclasses.replace(current, **value)
            changes[name] = value
        return dataclasses.replace(self, **changes)


def _part(cls, values: dict, name: str):
    _check_fields(cls, values, f"ProTrainConfig.{name}")
    return cls(**values)


def _check_fields(cls, values: dict, what: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{what} has no field {unknown[0]!r}; its fields are {', '.join(sorted(known))}.")
