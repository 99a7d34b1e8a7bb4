"""The one-pass CPU update of bf16-mixed chunks (protrain_ops/onepass.py) gives the results of
the separate passes bit for bit: the landing folded into the fp32 accumulator, clipping,
torch's fused Adam/AdamW, the copy back into the bf16 compute copy.

The kernel is built here as on any Linux machine with a C++ compiler (CI has one): a kernel that
does not build or does not match torch fails these tests instead of skipping them.
"""

import contextlib

import pytest
import torch

import protrain_core as pt
from conftest import batches
from protrain_ops import onepass


@pytest.fixture(scope="module")
def kernel():
    module = onepass.kernel()
    assert module is not None, onepass.status()
    return module


def test_the_kernel_matches_torch_on_every_kind_of_step(kernel):
    assert onepass.verify(kernel) == ""
    assert onepass.status().startswith("one pass")


class _Off:
    """The kernel with one wrong rounding: the master's last bit flipped in its first element."""

    def __init__(self, module):
        self.module = module

    def lanes(self):
        return self.module.lanes()

    def adam_onepass(self, params, *args):
        self.module.adam_onepass(params, *args)
        if params and params[0].numel():
            bits = params[0].view(-1)[:1].view(torch.int32)
            bits ^= 1


def test_verify_names_a_difference(kernel):
    difference = onepass.verify(_Off(kernel))
    assert difference.startswith("master of shape"), difference


def odd_llama(seed=0):
    """Sizes that are not multiples of the kernel's vectors: every tensor has elements that
    torch's own kernel updates (the rest of ``onepass.update``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=40, intermediate_size=70, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def optimizer(model, kind):
    """Two param groups; the final norm is trainable but in no group (it gets a gradient, and
    neither torch nor the engine steps it)."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1 and n != "model.norm.weight"]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    return torch.optim.Adam(groups, lr=1e-2, amsgrad=True, maximize=True)  # L2 weight decay


def train(kind, clipping, accumulate, *, steps=3):
    """Losses, then per step the chunks' gradients left after step() (as ``p.grad`` stays until
    zero_grad), then the final weights and optimizer state."""
    model = odd_llama()
    engine = pt.wrap(model, optimizer(model, kind), pt.Plan(n_persist=0, n_buffer=2), precision="bf16-mixed",
                     device="cpu", gradient_clipping=clipping, report=None)
    data = batches(steps * accumulate, seed=3, distinct=3)
    losses, grads = [], []
    for i in range(0, len(data), accumulate):
        for j, x in enumerate(data[i:i + accumulate]):
            with engine.no_sync() if j < accumulate - 1 else contextlib.nullcontext():
                loss = engine.module(input_ids=x, labels=x).loss
                engine.backward(loss)
            losses.append(loss.item())
        engine.step()
        engine.wait_for_updates()
        grads.append([c.storage.grad_acc.clone() for c in engine.chunks if c.storage.grad_acc is not None])
        engine.zero_grad()
    state, optim = engine.state_dict(), engine.optimizer_state_dict()
    engine.close()
    return losses, grads, state, optim


@pytest.mark.parametrize("kind, clipping, accumulate", [
    ("adamw", None, 1),
    ("adamw", None, 2),  # the last landing is added to the accumulator in the pass
    ("adamw", ("value", 0.01), 1),  # clamped in the pass, during backward
    ("adamw", ("norm", 0.5), 2),  # the update waits for the norm: the gradient is in the accumulator
    ("adam-amsgrad-maximize", None, 1),
])
def test_training_with_the_kernel_equals_the_separate_passes_bit_for_bit(kernel, monkeypatch, kind, clipping, accumulate):
    calls = []
    update = onepass.update
    monkeypatch.setattr(onepass, "update", lambda *a, **kw: (calls.append(kw["landed"]), update(*a, **kw)))
    with onepass.turned_off():
        separate = train(kind, clipping, accumulate)
    assert calls == []
    fused = train(kind, clipping, accumulate)
    # The first step is held for a clipping request that may come after backward (its update
    # finds the gradient in the accumulator); later ones update as the gradient lands, unless a
    # norm must be known first.
    expected = {None: {False, True}, "value": {True}, "norm": {False}}[clipping and clipping[0]]
    assert set(calls) == expected, calls

    assert fused[0] == separate[0]
    for ours, theirs in zip(fused[1], separate[1]):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert fused[2].keys() == separate[2].keys()
    assert all(torch.equal(fused[2][k], separate[2][k]) for k in fused[2])
    for index, entry in separate[3]["state"].items():
        for key, value in entry.items():
            assert torch.equal(fused[3]["state"][index][key], value), (index, key)
    assert fused[3]["state"].keys() == separate[3]["state"].keys()
