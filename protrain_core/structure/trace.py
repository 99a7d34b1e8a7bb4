"""The execution order of a model, traced on the meta device (no memory, no compute).

The forward pass runs once with every parameter and buffer replaced by a meta tensor of the
same shape (``torch.func.functional_call``). Hooks record the modules that own parameters in
the order of their first call (the chunk layout packs parameters in that order) and, for the
*units* the runtime will hook (each transformer block as a whole, every other module that owns
parameters), which of them run inside one another: each such stack of active units must have
all its chunks on the device at once ([Note: plan validity] in plan.py).

Without ``example_inputs`` a Hugging Face model gets ``input_ids`` of shape (1, 8) (and
``decoder_input_ids`` for an encoder-decoder). If tracing is impossible the module registration
order is used, with a warning, and each unit is taken to run inside the units that contain it
(as a module's forward calls its children's).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.func import functional_call

from protrain_core.memtrack import on_host
from protrain_core.structure.blocks import SEP, block_modules, inner_hf_lm, is_hf_lm, split_paths


@dataclass(frozen=True)
class Trace:
    order: tuple[str, ...]  # modules owning parameters, in order of first call (then the uncalled ones)
    source: str  # "traced" (meta-device forward) or "registration"
    stacks: tuple[tuple[str, ...], ...]  # distinct sets of units active at once (each unit alone included)


def unit_names(model: nn.Module, block_path: str) -> list[str]:
    """The units the runtime hooks: each block as a whole, and every module outside the blocks
    that owns parameters (a block's submodules are part of the block's unit). A module that is
    registered twice is one unit, under its first name (as ``model.named_modules()`` gives it)."""
    blocks = {id(b) for b in block_modules(model, block_path)}
    names: list[str] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if id(module) in blocks or any(True for _ in module.parameters(recurse=False)):
            names.append(prefix)
        if id(module) in blocks:
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return names


def trace(model: nn.Module, block_path: str, example_inputs=None) -> Trace:
    """The execution order of ``model`` and its nested units (see the module docstring)."""
    owners = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    units = unit_names(model, block_path)
    registration = Trace(tuple(owners), "registration", tuple(_inside((u,), units) for u in units))
    inner = inner_hf_lm(model) if not is_hf_lm(model) else None
    if inner is not None:
        return _trace_wrapper(registration, units, block_path, *inner)
    inputs = _default_inputs(model, example_inputs)
    if inputs is None:
        return registration
    error = None
    # Some kernels' meta implementations accept bf16 only (the grouped matmuls of Hugging Face's
    # mixture-of-experts layers: Mixtral, Qwen3-MoE); the order of the calls does not depend on
    # the dtype, so a failed trace is tried again with bf16 meta tensors.
    for dtype in (None, torch.bfloat16):
        recorder = _Recorder(model, owners, units)
        try:
            with on_host():  # (meta tensors: no memory a tracker or a simulated device may count)
                _run_on_meta(model, inputs, dtype)
            return recorder.result(owners, units)
        except Exception as e:  # noqa: BLE001 - any failure falls back to registration order
            error = error or e
        finally:
            recorder.remove()
    warnings.warn(
        f"Could not trace the execution order of {type(model).__name__} on the meta device "
        f"({type(error).__name__}: {error}); the chunk layout follows the module registration order instead "
        "(training is unaffected; chunks may hold parameters used far apart, so a plan may need more "
        "buffers). If the model needs other inputs than input_ids, pass them as example_inputs= (they are "
        "traced on the meta device too).",
        stacklevel=4,
    )
    return registration


def _inside(stack: tuple[str, ...], units: list[str]) -> tuple[str, ...]:
    """``stack`` with the units that contain one of its units as a submodule: a module's forward
    runs its children's inside it (a wrapper owning a parameter around a model's blocks)."""
    around = {a for a in units for u in stack if a != u and (not a or u.startswith(f"{a}."))}
    return tuple(sorted(set(stack) | around))


def _trace_wrapper(registration: Trace, units: list[str], block_path: str, name: str, lm: nn.Module) -> Trace:
    """A wrapper (a LightningModule, a user's module) around one Hugging Face causal LM: trace
    the LM with its own default inputs (the wrapper's inputs, a training batch, need not be the
    LM's), inside the wrapper's units that contain it; the wrapper's own parameters come after
    it (``registration``: the wrapper's order)."""
    prefix = f"{name}."
    paths = split_paths(block_path)
    inner_blocks = SEP.join(p[len(prefix):] for p in paths) if all(p.startswith(prefix) for p in paths) else ""
    if not inner_blocks:
        return registration
    inner = trace(lm, inner_blocks, None)
    full = lambda n: f"{prefix}{n}" if n else name  # noqa: E731
    called = [full(n) for n in inner.order]
    order = called + [n for n in registration.order if n not in called]
    stacks = [_inside(tuple(full(u) for u in s), units) for s in inner.stacks]
    stacks += [s for u, s in zip(units, registration.stacks) if u != name and not u.startswith(prefix)]
    return Trace(tuple(order), inner.source, tuple(stacks))


class _Recorder:
    """Forward hooks that record first calls of parameter owners and stacks of active units."""

    def __init__(self, model: nn.Module, owner_names: list[str], units: list[str]) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        self.called: dict[str, None] = {}  # ordered set
        self.active: list[str] = []
        self.stacks: dict[tuple[str, ...], None] = {}
        self.handles = [modules[n].register_forward_pre_hook(partial(self._first_call, n)) for n in owner_names]
        for u in units:
            self.handles.append(modules[u].register_forward_pre_hook(partial(self._enter, u)))
            self.handles.append(modules[u].register_forward_hook(partial(self._leave, u), always_call=True))

    def _first_call(self, name: str, *_hook_args) -> None:
        self.called.setdefault(name)

    def _enter(self, unit: str, *_hook_args) -> None:
        self.active.append(unit)
        self.stacks[tuple(sorted(set(self.active)))] = None

    def _leave(self, unit: str, *_hook_args) -> None:
        if self.active and self.active[-1] == unit:
            self.active.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def result(self, owner_names: list[str], units: list[str]) -> Trace:
        order = list(self.called) + [n for n in owner_names if n not in self.called]
        stacks = list(self.stacks) + [(u,) for u in units if (u,) not in self.stacks]
        return Trace(tuple(order), "traced", tuple(stacks))


def _run_on_meta(model: nn.Module, inputs, dtype: torch.dtype | None = None) -> None:
    """One forward pass with meta tensors for every parameter and buffer (floating ones in
    ``dtype`` when given).

    One name per (module, attribute) and the same meta tensor for tied tensors: torch's own
    ``tie_weights=True`` (and names of a module registered twice) would leave a module that is
    shared under two names with meta parameters after the call."""
    memo: dict[int, torch.Tensor] = {}
    metas: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if id(t) not in memo:
                cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                memo[id(t)] = torch.empty_like(t, device="meta", dtype=cast)
            metas[f"{module_name}.{name}" if module_name else name] = memo[id(t)]
    args, kwargs = _meta_inputs(inputs)
    with torch.no_grad():
        functional_call(model, metas, args, kwargs, tie_weights=False, strict=False)


def _meta_inputs(example_inputs):
    def to_meta(x):
        return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x

    if isinstance(example_inputs, dict):
        return (), {k: to_meta(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(to_meta(v) for v in example_inputs), {}
    return (to_meta(example_inputs),), {}


def _default_inputs(model: nn.Module, example_inputs):
    """What the trace runs: ``example_inputs``, adjusted for a Hugging Face model (which gets
    default token ids when none are given)."""
    if not is_hf_lm(model):
        return example_inputs
    # use_cache=True: without a cache, Hugging Face's mask code checks position_ids for packed
    # sequences, a data-dependent test that cannot run on meta tensors. The loss (labels) does
    # not use parameters in an order of its own.
    if example_inputs is None:
        example_inputs = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    elif not isinstance(example_inputs, dict):
        return example_inputs
    inputs = {k: v for k, v in example_inputs.items() if k != "labels"}
    inputs.setdefault("use_cache", True)
    if getattr(model.config, "is_encoder_decoder", False) and "input_ids" in inputs:
        inputs.setdefault("decoder_input_ids", inputs["input_ids"])
    return inputs

