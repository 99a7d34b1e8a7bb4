"""Optimizers other than Adam/AdamW, run per chunk by torch's own implementation.

[Note: elementwise optimizers]
An optimizer whose update treats every element on its own (SGD, RMSprop, Adagrad, Adadelta,
Adamax, NAdam, RAdam, Rprop, ASGD) is stepped per chunk by an instance of the user's own class
over the views of its members (masters, gradients): bitwise torch's result.

``describe`` steps the user's class on a small throwaway matrix with each param group's
settings and sorts its state: tensors of the parameter's shape become the chunk's state slots
(``ChunkFormat.adam_states`` of them, beside the master); one-element states ("step", NAdam's
``mu_product``) stay with the instance. A state of another shape (Adafactor's factored moments)
is refused, as is an optimizer that needs a closure (LBFGS) or sparse gradients (SparseAdam),
and a subclass of a torch optimizer that overrides its ``step``. A slot holds its value only
once the member has been stepped: the instance creates the state, and the step's end copies it
into the slot and points the instance at the slot.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

# Optimizers that take whole parameters, or the loss again: refused by name with the reason.
_WHOLE = {
    "LBFGS": "it needs a closure and treats all parameters as one vector",
    "SparseAdam": "it needs sparse gradients",
    "Adafactor": "its second moment is factored by rows and columns of each parameter",
    "Muon": "it orthogonalises each whole weight matrix",
}


@dataclass(frozen=True)
class Elementwise:
    """What ``describe`` found for optimizer class ``cls``: the state keys that become chunk
    ``slots`` and the ``order`` of every key of a parameter's state entry."""

    cls: type
    slots: tuple[str, ...]
    order: tuple[str, ...]


def describe(optimizer: torch.optim.Optimizer) -> Elementwise:
    """Check that ``optimizer`` can run per chunk ([Note: elementwise optimizers]); raise
    ValueError with the reason and the fix otherwise."""
    cls = type(optimizer)
    name = cls.__name__
    hint = ("Use an elementwise torch.optim optimizer (AdamW, Adam, SGD, RMSprop, Adagrad, Adadelta, Adamax, "
            "NAdam, RAdam, Rprop, ASGD).")
    for base in cls.__mro__:
        if base.__name__ in _WHOLE and base.__module__.startswith("torch.optim"):
            raise ValueError(f"ProTrain cannot run {name} per chunk: {_WHOLE[base.__name__]}. {hint}")
    own_step = inspect.unwrap(cls.step)
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("torch.optim") and base is not torch.optim.Optimizer and "step" in vars(base):
            if own_step is not inspect.unwrap(base.step):
                raise ValueError(
                    f"{name} overrides step() of {base.__name__} ({own_step.__module__}.{own_step.__qualname__}). "
                    "ProTrain steps each chunk's flat views (and with several processes, pieces of them) with the "
                    "optimizer's step, so a step that edits gradients by their shape, or needs a closure, would "
                    f"be wrong. Use {base.__name__} itself (a subclass that keeps its step() is fine); for gradient "
                    "clipping use ProTrainConfig(clipping=...) or Lightning's gradient_clip_val."
                )
            break
    slots: dict[str, None] = {}  # (dicts as ordered sets)
    order: dict[str, None] = {}
    for group in optimizer.param_groups:
        for key, value in _probe(cls, group, hint).items():
            order[key] = None
            if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) == _PROBE_SHAPE:
                slots[key] = None
            elif not (isinstance(value, numbers.Number) or (isinstance(value, Tensor) and value.numel() == 1)):
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"ProTrain cannot run {name} per chunk: its state {key!r} of a {_PROBE_SHAPE} parameter is "
                    f"{shape}, not the parameter's shape, so it needs whole parameters. {hint}"
                )
    if len(slots) > 3:
        raise ValueError(f"{name} keeps {len(slots)} state tensors per parameter ({list(slots)}); "
                         "ProTrain holds at most 3.")
    return Elementwise(cls, tuple(slots), tuple(order))


_PROBE_SHAPE = (3, 4)


def is_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Adam/AdamW: run by the fused kernel (optim.py), not by instances of their class."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def state_slots(optimizer: torch.optim.Optimizer) -> int:
    """State tensors per trainable element the chunks hold for ``optimizer``."""
    if is_adam(optimizer):
        return 3 if any(g.get("amsgrad", False) for g in optimizer.param_groups) else 2
    return len(describe(optimizer).slots)


def constructor_args(cls: type, group: dict) -> dict:
    """The settings of ``group`` its class's constructor takes."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in group.items() if k != "params" and k in accepted}


def _probe(cls: type, group: dict, hint: str) -> dict:
    """The state of a small parameter after two steps of ``cls`` with ``group``'s settings."""
    p = torch.zeros(_PROBE_SHAPE)
    p.grad = torch.full(_PROBE_SHAPE, 0.5)
    try:
        probe = cls([p], **constructor_args(cls, group))
        with torch.no_grad():
            probe.step()
            probe.step()
    except Exception as e:  # the optimizer's own refusal: say why it cannot run per chunk
        raise ValueError(f"ProTrain could not step {cls.__name__} on its own ({type(e).__name__}: {e}). {hint}") from e
    return dict(probe.state[p])


class ElementwiseSteps:
    """The instances that step one optimizer's chunks, and its states that are not slots."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: Elementwise) -> None:
        self.optimizer = optimizer
        self.kind = kind
        self._instances: dict[tuple[int, int, tuple[int, ...]], tuple[object, torch.optim.Optimizer]] = {}
        self.extra: dict[tuple[int, int], dict] = {}  # (chunk, member) -> its non-slot state, once stepped

    def snapshot(self) -> tuple[dict, ...]:
        """Each group's settings now (numbers: a one-element tensor as a float)."""
        return tuple({k: (float(v) if isinstance(v, Tensor) else v) for k, v in g.items() if k != "params"}
                     for g in self.optimizer.param_groups)

    def forget(self) -> None:
        """After a state load: every instance is built again from the slots and ``extra``."""
        self._instances.clear()

    def step(self, chunk, group: int, members: tuple[int, ...], views, settings: dict) -> None:
        """One step of ``members`` of ``chunk`` (param group ``group``) on their ``views``
        (``ChunkValues.update_views``) with ``settings`` (``snapshot()[group]``)."""
        key = (chunk.index, group, members)
        held = self._instances.get(key)
        if held is None or held[0] is not views:
            held = self._instances[key] = views, self._instance(chunk, members, views, settings)
        inner = held[1]
        inner.param_groups[0].update(settings)
        inner.step()
        slots = views.states
        for j, (i, p) in enumerate(zip(members, views.master)):
            state = inner.state[p]
            for k, name in enumerate(self.kind.slots):
                value = state.get(name)
                if value is not None and value is not slots[k][j]:
                    slots[k][j].copy_(value)
                    state[name] = slots[k][j]
            self.extra[(chunk.index, i)] = {n: v for n, v in state.items() if n not in self.kind.slots}

    def _instance(self, chunk, members, views, settings) -> torch.optim.Optimizer:
        """An instance of the user's class over ``views``, with each stepped member's state."""
        cls = self.kind.cls
        params = list(views.master)
        for p, g in zip(params, views.grads):
            p.grad = g
        inner = cls(params, **constructor_args(cls, settings))
        for j, (i, p) in enumerate(zip(members, params)):
            extra = self.extra.get((chunk.index, i))
            if extra is None:
                continue  # not stepped yet: the state torch creates (Adagrad's, in its constructor)
            # As torch's load_state_dict places them: "step" as it is, other tensors with the parameter.
            placed = {n: v.to(p.device, p.dtype) if isinstance(v, Tensor) and n != "step" and v.is_floating_point() else v
                      for n, v in extra.items()}
            inner.state[p] = {**placed, **{name: views.states[k][j] for k, name in enumerate(self.kind.slots)}}
        return inner
