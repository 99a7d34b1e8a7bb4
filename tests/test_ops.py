"""protrain_ops kernels against torch.optim and for determinism."""

import pytest
import torch

from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision


def _tensors(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


SHAPES = [(64, 32), (32,), (7, 5, 3)]


@pytest.mark.parametrize("cls,decoupled", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("fused_ref", [True, False])
def test_adam_step_matches_torch(cls, decoupled, amsgrad, fused_ref):
    params = _tensors(0, SHAPES)
    ref = [p.clone().requires_grad_(True) for p in params]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad, maximize=False)
    opt = cls(ref, fused=fused_ref, foreach=None if fused_ref else False, **kw)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    maxs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    hp = AdamHyperParams.from_group(opt.param_groups[0], decoupled_weight_decay=decoupled)
    for i in range(5):
        grads = _tensors(100 + i, SHAPES)
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        adam_step(params, grads, exp_avgs, exp_avg_sqs, maxs, steps, hp)
    tol = dict(rtol=0, atol=0) if fused_ref else dict(rtol=1e-5, atol=1e-6)  # nanochat's bar
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), **tol)
    for e, r in zip(exp_avg_sqs, ref):
        torch.testing.assert_close(e, opt.state[r]["exp_avg_sq"], **tol)
    assert all(s.item() == 5 for s in steps)


def test_adam_step_is_deterministic():
    outs = []
    for _ in range(2):
        params = _tensors(0, SHAPES)
        states = [[torch.zeros_like(p) for p in params] for _ in range(3)]
        steps = [torch.zeros(()) for _ in params]
        hp = AdamHyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        for i in range(3):
            adam_step(params, _tensors(10 + i, SHAPES), states[0], states[1], [], steps, hp)
        outs.append(params)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_to_low_precision_rounds_like_torch(dtype):
    src = torch.randn(1000)
    dst = torch.empty(1000, dtype=dtype)
    copy_to_low_precision(dst, src)
    assert torch.equal(dst, src.to(dtype))
