"""AdamW / Adam over one chunk, on the CPU or on the device.

Both paths build on PyTorch's fused multi-tensor kernel (``torch._fused_adamw_`` /
``torch._fused_adam_``), which runs on CUDA and, since torch 2.4, on the CPU close to memory
bandwidth. The math is exactly ``torch.optim.AdamW(fused=True)``: the step counters are
incremented here (as ``torch.optim.adam._fused_adam`` does) and the kernel does the rest.
(Mixed-precision chunks on the CPU update in one pass instead: onepass.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class AdamHyperParams:
    """Hyper-parameters of one param group, read from the user's optimizer."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = True  # AdamW (True) or Adam with L2 penalty (False)

    @classmethod
    def from_group(cls, group: dict, *, decoupled_weight_decay: bool) -> AdamHyperParams:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),  # (a tensor lr too)
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group.get("amsgrad", False)),
            maximize=bool(group.get("maximize", False)),
            decoupled_weight_decay=decoupled_weight_decay,
        )


def adam_step(
    params: list[Tensor],  # master weights, any shape; updated in place
    grads: list[Tensor],  # gradients, same shapes as params (unscaled)
    exp_avgs: list[Tensor],  # first moments, same shapes; updated in place
    exp_avg_sqs: list[Tensor],  # second moments, same shapes; updated in place
    max_exp_avg_sqs: list[Tensor],  # same shapes when amsgrad, else []
    steps: list[Tensor],  # 0-D fp32 step counters on the params' device; incremented here
    hp: AdamHyperParams,
) -> None:
    """One Adam/AdamW step over a list of tensors that all live on one device and share one
    dtype: fp32, or bf16 (bf16-true: torch.optim keeps a bf16 module's states in bf16) -- or
    fp32 params with bf16 moments (optimizer_state_format "bf16"), stepped as copies in the
    params' dtype and rounded back to nearest."""
    if not params:
        return
    torch._foreach_add_(steps, 1)
    narrow = exp_avgs[0].dtype != params[0].dtype
    assert not (narrow and hp.amsgrad), "narrow moments without amsgrad"
    moments = [exp_avgs, exp_avg_sqs]
    if narrow:
        moments = [[t.to(params[0].dtype) for t in ts] for ts in moments]
    kernel = torch._fused_adamw_ if hp.decoupled_weight_decay else torch._fused_adam_
    kernel(params, grads, *moments, max_exp_avg_sqs if hp.amsgrad else [], steps,
           lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
           amsgrad=hp.amsgrad, maximize=hp.maximize)
    if narrow:
        torch._foreach_copy_(exp_avgs, moments[0])
        torch._foreach_copy_(exp_avg_sqs, moments[1])


def fold_landing(accs: list[Tensor], landings: list[Tensor], *, accumulate: bool) -> None:
    """Landed gradients (any dtype) into the fp32 accumulators: copied, or added when
    micro-batches accumulate."""
    if accumulate:
        torch._foreach_add_(accs, landings)
    else:
        torch._foreach_copy_(accs, landings)


def clip_gradients(grads: list[Tensor], coef: Tensor | None, value: float | None) -> None:
    """The calls of ``clip_grad_norm_`` (multiply by its coefficient) and ``clip_grad_value_``
    (clamp to ``[-value, value]``) on the gradients an update reads."""
    if coef is not None:
        torch._foreach_mul_(grads, coef)
    if value is not None:
        torch._foreach_clamp_min_(grads, -value)
        torch._foreach_clamp_max_(grads, value)


def copy_to_low_precision(
    dst: Tensor,  # (S,) compute-dtype copy (bf16/fp16) of a chunk
    src: Tensor,  # (S,) fp32 master of the same chunk
) -> None:
    """Write the compute-dtype copy of an updated fp32 master (round to nearest even)."""
    dst.copy_(src)
