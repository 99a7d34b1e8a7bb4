"""Per-chunk Adam/AdamW with exactly the semantics of the user's torch optimizer (DESIGN §3).

The user's optimizer object stays the one the user (or Lightning) holds: its ``param_groups``
are read at every step, so schedulers that change ``lr`` keep working, and its
``state_dict()`` format is what ``Engine.optimizer_state_dict`` produces. Its own ``state``
stays empty: moments live in the chunks, next to the fp32 master weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from protrain_core.chunk import Chunk
from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision


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
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            raise ValueError("differentiable=True optimizers are not supported by ProTrain.")
        if isinstance(group["lr"], Tensor) and group["lr"].numel() != 1:
            raise ValueError("lr must be a float or a one-element tensor.")
    return decoupled


class ChunkOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, *, compute_is_master: bool) -> None:
        self.optimizer = optimizer
        self.decoupled = check_optimizer(optimizer)
        self.compute_is_master = compute_is_master  # fp32 compute: no low-precision copy
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

    def members_by_group(self, chunk: Chunk) -> dict[int, list[int]]:
        """Members of ``chunk`` the optimizer updates, by param group (trainable ones only)."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(chunk.params):
            g = self.group_of.get(id(p))
            if g is not None and p.requires_grad:
                out.setdefault(g, []).append(i)
        return out

    def update(self, chunk: Chunk, hps: tuple[AdamHyperParams, ...]) -> None:
        """One Adam step of every member that received a gradient since zero_grad.

        Runs on the device for persistent chunks (main thread) and on the host for streamed
        chunks (CPU worker). Params without a gradient are skipped, as torch.optim does.
        """
        for g, members in chunk.opt_members.items():
            selected = [i for i in members if chunk.received[i]]
            if not selected:
                continue
            v = chunk.view
            adam_step(
                [v(chunk.master, i) for i in selected],
                [v(chunk.grad_acc, i) for i in selected],
                [v(chunk.exp_avg, i) for i in selected],
                [v(chunk.exp_avg_sq, i) for i in selected],
                [v(chunk.max_exp_avg_sq, i) for i in selected] if hps[g].amsgrad else [],
                [chunk.steps[i] for i in selected],
                hps[g],
            )
            for i in selected:
                chunk.initialized[i] = True
        if not self.compute_is_master:
            copy_to_low_precision(chunk.param_dev if chunk.persistent else chunk.param_host, chunk.master)

    # ----- torch.optim state-dict format --------------------------------------------------
    def _indexed_params(self):
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                yield index, p
                index += 1

    def state_dict(self, slot_of: dict[int, tuple[Chunk, int]]) -> dict:
        base = self.optimizer.state_dict()  # param_groups with hyper-parameters and indices
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        state = {}
        for index, p in self._indexed_params():
            chunk, i = slot_of[id(p)]
            if not chunk.initialized[i]:
                continue
            entry = {"step": chunk.steps[i].detach().to("cpu", copy=True)}
            for key in keys:
                entry[key] = chunk.view(getattr(chunk, key), i).detach().to("cpu", copy=True)
            state[index] = entry
        return {"state": state, "param_groups": base["param_groups"]}

    def validate_state_dict(self, osd: dict, slot_of: dict[int, tuple[Chunk, int]]) -> None:
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
        params = dict(self._indexed_params())
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

    def load_state_dict(self, osd: dict, slot_of: dict[int, tuple[Chunk, int]]) -> None:
        self.validate_state_dict(osd, slot_of)
        for group, saved in zip(self.optimizer.param_groups, osd["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        states = {int(k): v for k, v in osd["state"].items()}
        for index, p in self._indexed_params():
            chunk, i = slot_of[id(p)]
            if chunk.exp_avg is None:
                continue  # frozen parameter: torch keeps no state for it either
            entry = states.get(index)
            with torch.no_grad():
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    flat = getattr(chunk, key)
                    if flat is None:
                        continue
                    dst = chunk.view(flat, i)
                    if entry is not None and key in entry:
                        dst.copy_(entry[key])
                    else:
                        dst.zero_()
                step = entry["step"] if entry is not None else 0.0
                chunk.steps[i].fill_(float(step.item() if isinstance(step, Tensor) else step))
            chunk.initialized[i] = entry is not None
