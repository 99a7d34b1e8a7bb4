"""Per-chunk Adam/AdamW with exactly the semantics of the user's torch optimizer (DESIGN §3).

The user's optimizer object stays the one the user (or Lightning) holds: its ``param_groups``
are read at every step, so schedulers that change ``lr`` keep working, and its
``state_dict()`` format is what ``Engine.optimizer_state_dict`` produces. Its own ``state``
stays empty: moments live in the chunks, next to the master weights.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision

if TYPE_CHECKING:
    from protrain_core.runtime.chunk import Chunk

# parameter id -> (its chunk, its member index): how the optimizer finds a parameter's states.
SlotMap = dict[int, tuple["Chunk", int]]


def check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Validate the optimizer; return whether weight decay is decoupled (AdamW)."""
    if isinstance(optimizer, torch.optim.AdamW):
        decoupled = True
    elif isinstance(optimizer, torch.optim.Adam):
        decoupled = bool(optimizer.defaults.get("decoupled_weight_decay", False))
    else:
        raise ValueError(
            f"ProTrain runs the optimizer per chunk and supports torch.optim.AdamW and "
            f"torch.optim.Adam; got {type(optimizer).__name__}. Create the optimizer with "
            "torch.optim.AdamW(model.parameters(), ...) (param groups are fine)."
        )
    # torch wraps each optimizer class's step for its profiler hooks: compare what is wrapped.
    own_step = inspect.unwrap(type(optimizer).step)
    if own_step not in (inspect.unwrap(torch.optim.Adam.step), inspect.unwrap(torch.optim.AdamW.step)):
        raise ValueError(
            f"{type(optimizer).__name__} overrides step() ({own_step.__module__}.{own_step.__qualname__}). ProTrain "
            "runs Adam/AdamW's update itself, chunk by chunk on the device and the CPU, so an overridden step "
            "(a closure it needs, gradients it edits before super().step()) would never run. Use "
            "torch.optim.AdamW or torch.optim.Adam itself (a subclass that keeps their step() is fine); "
            "for gradient clipping use wrap(gradient_clipping=...) or Lightning's gradient_clip_val."
        )
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            raise ValueError("differentiable=True optimizers are not supported by ProTrain.")
        if isinstance(group["lr"], Tensor) and group["lr"].numel() != 1:
            raise ValueError("lr must be a float or a one-element tensor.")
    return decoupled


def indexed_params(optimizer: torch.optim.Optimizer):
    """(index, parameter) in torch's state-dict numbering: param groups in order."""
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield index, p
            index += 1


@dataclass(frozen=True)
class UpdateClip:
    """The clipping one update applies (runtime/gradients.py decides it per step)."""

    coef: Tensor | None = None  # clip_grad_norm_'s coefficient: every gradient *= coef first
    value: float | None = None  # clip_grad_value_: clamp every element to [-value, value]

    def on(self, device: torch.device) -> UpdateClip:
        """The same clipping with the coefficient where the gradients are (one copy per update)."""
        return self if self.coef is None or self.coef.device == device else UpdateClip(self.coef.to(device), self.value)


class ChunkOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.decoupled = check_optimizer(optimizer)
        self.group_of: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in self.group_of:
                    raise ValueError("A parameter appears in more than one optimizer param group.")
                self.group_of[id(p)] = g

    @property
    def amsgrad(self) -> bool:
        return any(group.get("amsgrad", False) for group in self.optimizer.param_groups)

    def snapshot(self) -> tuple[AdamHyperParams, ...]:
        return tuple(
            AdamHyperParams.from_group(group, decoupled_weight_decay=self.decoupled)
            for group in self.optimizer.param_groups
        )

    def members_by_group(self, params: list[torch.nn.Parameter]) -> dict[int, list[int]]:
        """Members of a chunk (its ``params``) the optimizer updates, by param group (trainable ones only)."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            g = self.group_of.get(id(p))
            if g is not None and p.requires_grad:
                out.setdefault(g, []).append(i)
        return out

    def selected(self, chunk: Chunk) -> dict[int, list[int]]:
        """The members an update of ``chunk`` steps, by param group: those that received a
        gradient since zero_grad (torch skips parameters whose ``.grad`` is None). Taken on the
        main thread when the update is handed out; the chunk then records their Adam state."""
        out = {}
        for g, members in chunk.opt_members.items():
            selected = [i for i in members if chunk.has_grad(i)]
            if selected:
                out[g] = selected
                for i in selected:
                    chunk.set_adam_state(i)
        return out

    def update(self, chunk: Chunk, hps: tuple[AdamHyperParams, ...], selected: dict[int, list[int]],
               clip: UpdateClip) -> None:
        """One Adam step of the ``selected`` members (``selected(chunk)``), clipped by ``clip``
        first with the calls of clip_grad_norm_ (``_foreach_mul_`` by the coefficient) and
        clip_grad_value_ (clamp), on this chunk's gradients.

        Runs on the device for persistent chunks (main thread) and on the host for streamed
        chunks (CPU worker)."""
        storage = chunk.storage
        for g, members in selected.items():
            views = chunk.update_views(tuple(members))
            if clip.coef is not None:
                torch._foreach_mul_(views.grads, clip.coef)
            if clip.value is not None:
                torch._foreach_clamp_min_(views.grads, -clip.value)
                torch._foreach_clamp_max_(views.grads, clip.value)
            adam_step(views.master, views.grads, views.exp_avgs, views.exp_avg_sqs,
                      views.max_exp_avg_sqs if hps[g].amsgrad else [], views.member_steps, hps[g])
        if storage.fmt.separate_master:
            copy_to_low_precision(storage.compute_span(), storage.master)

    # ----- torch.optim state-dict format --------------------------------------------------
    def state_dict(self, slot_of: SlotMap, *, keep: bool = True) -> dict:
        """The state in torch's format. Sharded over ``W`` processes every rank must call it (the
        states are gathered chunk by chunk, one chunk at a time); ``keep`` False: this rank takes
        part only (its result is empty)."""
        base = self.optimizer.state_dict()  # param_groups with hyper-parameters and indices
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        state = {}
        gathered: tuple[Chunk | None, dict] = (None, {})  # the last chunk's whole states
        for index, p in indexed_params(self.optimizer):
            chunk, i = slot_of[id(p)]
            if not chunk.has_adam_state(i):
                continue
            if gathered[0] is not chunk:
                gathered = chunk, {key: chunk.gathered_values(lambda st, key=key: getattr(st, key)) for key in keys}
            if not keep:
                continue
            entry = {"step": chunk.storage.steps[i].detach().to("cpu", copy=True)}
            for key in keys:
                entry[key] = gathered[1][key][i].detach().reshape(p.shape).to("cpu", copy=True)
            state[index] = entry
        return {"state": state, "param_groups": base["param_groups"]} if keep else {}

    def validate_state_dict(self, osd: dict) -> None:
        groups = self.optimizer.param_groups
        saved = osd.get("param_groups")
        if not isinstance(saved, list) or "state" not in osd:
            raise ValueError("Not an optimizer state dict: expected keys 'state' and 'param_groups'.")
        if len(saved) != len(groups) or any(len(a["params"]) != len(b["params"]) for a, b in zip(groups, saved)):
            raise ValueError(
                "The optimizer state dict has param groups of sizes "
                f"{[len(g['params']) for g in saved]} but the optimizer has "
                f"{[len(g['params']) for g in groups]}; it was saved for a different model or grouping."
            )
        params = dict(indexed_params(self.optimizer))
        for index, entry in osd["state"].items():
            p = params.get(int(index))
            if p is None:
                raise ValueError(f"Optimizer state for parameter index {index}, which does not exist.")
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in entry or tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"Optimizer state {index}.{key} is missing or has shape "
                        f"{tuple(entry[key].shape) if key in entry else None}, expected {tuple(p.shape)}."
                    )

    def load_state_dict(self, osd: dict, slot_of: SlotMap) -> None:
        self.validate_state_dict(osd)
        for group, saved in zip(self.optimizer.param_groups, osd["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        states = {int(k): v for k, v in osd["state"].items()}
        for index, p in indexed_params(self.optimizer):
            chunk, i = slot_of[id(p)]
            storage = chunk.storage
            if storage.exp_avg is None or not chunk.spec.members[i].trainable:
                continue  # frozen parameter: torch keeps no state for it either
            entry = states.get(index)
            with torch.no_grad():
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    flat = getattr(storage, key)
                    if flat is None:
                        continue
                    dst = chunk.state_view(flat, i)
                    if entry is not None and key in entry:
                        dst.copy_(chunk.own_piece(i, entry[key]))
                    else:
                        dst.zero_()
                step = entry["step"] if entry is not None else 0.0
                storage.steps[i].fill_(float(step.item() if isinstance(step, Tensor) else step))
            chunk.set_adam_state(i, entry is not None)
