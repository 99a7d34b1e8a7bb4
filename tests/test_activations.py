"""Block-wise activation management: keep, checkpoint or swap, interleaved (DESIGN §4).

Identity: checkpointing and swapping do not change what is computed, so losses and weights are
bitwise those of plain AdamW training, for every layout and chunk plan.
Recompute is real: counted FLOPs. Swap is real: bytes of live activation storages during
backward, measured by a dispatch-mode tracker independent of the swap code.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

import protrain_core as pt
from protrain_core.plan import BlockMode, describe_modes, interleaved_modes
from protrain_core.runtime.activations import MIN_SWAP_BYTES
from protrain_core.memtrack import LiveStorageTracker
from conftest import MODELS, assert_same_weights, batches, n_chunks, train_engine, train_reference

K, C, S = BlockMode.KEEP, BlockMode.CHECKPOINT, BlockMode.SWAP
CACHE_WARNING = "ignore:ProTrain. a key/value cache"


# ----- layout ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,swap,ckpt,expected",
    [
        (8, 2, 3, (S, S, C, K, C, K, C, K)),
        (4, 0, 2, (C, K, C, K)),
        (4, 0, 4, (C, C, C, C)),
        (4, 4, 0, (S, S, S, S)),
        (4, 1, 3, (S, C, C, C)),
        (5, 1, 1, (S, C, K, K, K)),
        (3, 0, 0, (K, K, K)),
    ],
)
def test_interleaved_examples(n, swap, ckpt, expected):
    assert interleaved_modes(n, swap, ckpt) == expected


def test_interleaved_properties():
    for n in range(0, 13):
        for swap in range(n + 1):
            for ckpt in range(n - swap + 1):
                modes = interleaved_modes(n, swap, ckpt)
                assert modes == interleaved_modes(n, swap, ckpt)  # deterministic
                assert modes[:swap] == (S,) * swap  # swapped blocks first
                assert sum(m is C for m in modes) == ckpt and S not in modes[swap:]
                if swap + ckpt < n:
                    assert modes[-1] is K  # the last block keeps its activations
                positions = [i for i, m in enumerate(modes) if m is C]
                gaps = {b - a for a, b in zip(positions, positions[1:])}
                assert not gaps or max(gaps) - min(gaps) <= 1  # evenly spread


def test_engine_exposes_layout():
    model = MODELS["gpt2"](n_layer=6)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=2, n_swap=2, n_checkpoint=2), device="cpu")
    assert engine.block_modes == (S, S, C, K, C, K)
    assert "S S C K C K (2 swap, 2 checkpoint, 2 keep)" in engine.summary()
    assert describe_modes(engine.block_modes) in engine.summary()
    assert [r.mode for r in engine.activations.report()] == list(engine.block_modes)


# ----- identity ----------------------------------------------------------------------------
LAYOUTS = {"keep": (0, 0), "all-checkpoint": (0, 4), "all-swap": (4, 0), "mixed-1s2c": (1, 2), "mixed-2s1c": (2, 1)}


def chunk_plans(model, swap, ckpt):
    n = n_chunks(model)
    return {
        "all-persistent": pt.Plan(n_persist=n, n_buffer=0, n_swap=swap, n_checkpoint=ckpt),
        "streamed-buf1": pt.Plan(n_persist=0, n_buffer=1, n_swap=swap, n_checkpoint=ckpt),
        "mixed-buf2": pt.Plan(n_persist=1, n_buffer=2, n_swap=swap, n_checkpoint=ckpt),
    }


_REFERENCE = {}


def reference(arch, data):
    if arch not in _REFERENCE:
        ref = MODELS[arch]()
        losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True), data)
        _REFERENCE[arch] = (losses, ref)
    return _REFERENCE[arch]


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.grid(ci=lambda arch, layout, chunk_plan: (arch == "llama" and chunk_plan == "streamed-buf1")
                  or (arch == "gpt2" and layout == "mixed-1s2c"))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunk_plan", ["all-persistent", "streamed-buf1", "mixed-buf2"])
def test_fp32_identity_across_layouts(arch, layout, chunk_plan):
    data = batches(5)
    ref_losses, ref = reference(arch, data)
    model = MODELS[arch]()
    plan = chunk_plans(model, *LAYOUTS[layout])[chunk_plan]
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), plan, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = train_engine(engine, data)
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    stats = engine.activations.stats
    assert stats["recomputed_blocks"] == plan.n_checkpoint * len(data)
    assert (stats["swap_out_bytes"] > 0) == (plan.n_swap > 0)
    assert stats["swap_in_bytes"] == stats["swap_out_bytes"]


@pytest.mark.filterwarnings(CACHE_WARNING)
@pytest.mark.parametrize("arch,precision", [("gpt2", "bf16-mixed"), ("llama", "bf16-mixed"), ("llama", "16-mixed")])
def test_mixed_precision_identity_across_layouts(arch, precision):
    """Mixed precision: a layout change does not change a single bit either."""
    data = batches(5)
    results = {}
    for layout in ("keep", "mixed-1s2c", "all-swap", "all-checkpoint"):
        model = MODELS[arch]()
        plan = chunk_plans(model, *LAYOUTS[layout])["mixed-buf2"]
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, precision=precision, device="cpu")
        results[layout] = (train_engine(engine, data), engine.state_dict())
    losses, sd = results["keep"]
    for layout, (other_losses, other_sd) in results.items():
        assert other_losses == losses, layout
        for k in sd:
            assert torch.equal(sd[k], other_sd[k]), (layout, k)


@pytest.mark.filterwarnings(CACHE_WARNING)
def test_frozen_parameters_with_swap_and_checkpoint():
    """Frozen weights (embedding, a whole block, another block's attention) in managed blocks."""
    data = batches(5)
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for name, p in m.named_parameters():
            if "wte" in name or ".h.0." in name or ".h.2.attn" in name:
                p.requires_grad_(False)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    engine = pt.wrap(model, torch.optim.AdamW(trainable(model), lr=3e-3),
                     pt.Plan(n_persist=1, n_buffer=2, n_swap=2, n_checkpoint=1), device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = train_engine(engine, data)
    assert losses == train_reference(ref, torch.optim.AdamW(trainable(ref), lr=3e-3, fused=True), data)
    assert_same_weights(engine.state_dict(), ref)


def test_cache_is_dropped_with_a_warning_only_where_needed():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=2, n_checkpoint=1), device="cpu")
    x = batches(1)[0]
    with pytest.warns(UserWarning, match="past_key_values=None, use_cache=False"):
        out = engine.module(input_ids=x, labels=x)
    assert out.past_key_values.layers[0].keys is None  # block 0 is checkpointed: no cache entry
    assert out.past_key_values.layers[1].keys.shape[-2] == x.shape[1]  # kept blocks fill it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.module(input_ids=x, labels=x, use_cache=False)  # nothing to drop, no warning
        with torch.no_grad():
            engine.module(input_ids=x)  # no gradients: the cache is left alone


# ----- recompute is real -------------------------------------------------------------------
def _flops(engine, x):
    with FlopCounterMode(display=False) as fwd:
        out = engine.module(input_ids=x, labels=x, use_cache=False)
    with FlopCounterMode(display=False) as bwd:
        engine.backward(out.loss)
    engine.step()
    engine.zero_grad()
    per_module = {name: sum(ops.values()) for name, ops in fwd.get_flop_counts().items()}
    return per_module, bwd.get_total_flops()


@pytest.mark.parametrize("arch,block_prefix,last_proj", [
    ("gpt2", "GPT2LMHeadModel.transformer.h", "mlp.c_proj"),
    ("llama", "LlamaForCausalLM.model.layers", "mlp.down_proj"),
])
def test_checkpoint_recomputes_exactly_the_forward(arch, block_prefix, last_proj):
    """Backward FLOPs grow by the checkpointed blocks' forward FLOPs.

    With PyTorch's default early stop, recomputation ends once every tensor the backward
    needs is rebuilt, so the block's last projection (whose output is not saved) is skipped:
    the growth is then the forward FLOPs minus exactly that projection's.
    """
    x = batches(1)[0]
    flops = {}
    for name, ckpt, early_stop in [("keep", 0, True), ("full", 2, False), ("early", 2, True)]:
        model = MODELS[arch]()
        plan = pt.Plan(n_persist=1, n_buffer=2, n_checkpoint=ckpt)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), plan, device="cpu")
        with set_checkpoint_early_stop(early_stop):
            flops[name] = _flops(engine, x)
        if ckpt:
            assert engine.activations.stats["recomputed_blocks"] == ckpt
            checkpointed = [i for i, m in enumerate(engine.block_modes) if m is C]
    fwd, bwd_keep = flops["keep"]
    assert checkpointed == [0, 2]
    block_fwd = sum(fwd[f"{block_prefix}.{i}"] for i in checkpointed)
    last = sum(fwd[f"{block_prefix}.{i}.{last_proj}"] for i in checkpointed)
    assert block_fwd > 0 and 0 < last < block_fwd
    assert flops["full"][0] == fwd and flops["early"][0] == fwd  # forward itself is unchanged
    assert flops["full"][1] - bwd_keep == block_fwd
    assert flops["early"][1] - bwd_keep == block_fwd - last


# ----- swap is real ------------------------------------------------------------------------
def _live_activation_bytes_in_backward(engine, x):
    """Bytes of storages made by the forward pass still alive when backward starts."""
    seen = {}
    with LiveStorageTracker() as tracker:
        out = engine.module(input_ids=x, labels=x, use_cache=False)

    def at_backward_start(_grad):
        seen["live"] = tracker.live_bytes(exclude=engine.activations.host.storages())

    out.logits.register_hook(at_backward_start)
    engine.backward(out.loss)
    engine.step()
    engine.zero_grad()
    return seen["live"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("chunk_plan", ["all-persistent", "mixed-buf2"])
def test_swap_and_checkpoint_free_device_activations(arch, chunk_plan):
    x = batches(1)[0]
    live, reports = {}, {}
    for swap, ckpt in [(0, 0), (2, 0), (4, 0), (0, 2)]:
        model = MODELS[arch]()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), chunk_plans(model, swap, ckpt)[chunk_plan], device="cpu")
        live[swap, ckpt] = _live_activation_bytes_in_backward(engine, x)
        reports[swap, ckpt] = engine.activations.report()
        assert engine.activations.stats["swap_in_bytes"] == engine.activations.stats["swap_out_bytes"]
    kept = reports[0, 0]
    assert all(r.saved_bytes > 0 and r.device_bytes == r.saved_bytes and r.host_bytes == 0 for r in kept)
    for swap in (2, 4):
        swapped = reports[swap, 0][:swap]
        drop = live[0, 0] - live[swap, 0]
        assert drop == sum(r.host_bytes for r in swapped)
        for r, k in zip(swapped, kept):
            assert r.saved_bytes == k.saved_bytes  # the same tensors were saved...
            assert r.host_bytes + r.device_bytes == r.saved_bytes  # ...and all but tiny ones moved
            assert r.device_bytes < MIN_SWAP_BYTES * 4 and r.host_bytes > 0.9 * r.saved_bytes
    # A checkpointed block keeps its inputs (and checkpoint's bookkeeping: < 1 % here), not
    # what it saved when kept.
    ckpt = [r for r in reports[0, 2] if r.mode is C]
    freed = sum(k.saved_bytes - r.input_bytes for r, k in zip(ckpt, [kept[0], kept[2]]))
    assert 0.99 * freed <= live[0, 0] - live[0, 2] <= freed


def test_inputs_shared_by_all_blocks_are_not_swapped():
    """LLaMA's rotary cos/sin tables (made once per forward, saved by every block) stay put."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=96, max_position_embeddings=64))

    x = batches(1)[0]
    live, reports = {}, {}
    for swap in (0, 2):
        model = llama()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=2, n_swap=swap), device="cpu")
        live[swap] = _live_activation_bytes_in_backward(engine, x)
        reports[swap] = engine.activations.report()
    head_dim_table = 16 * 32 * 4  # (1, seq, head_dim) fp32: big enough to be swapped if it were
    assert head_dim_table >= MIN_SWAP_BYTES
    assert live[0] - live[2] == sum(r.host_bytes for r in reports[2][:2])
    for r, k in zip(reports[2][:2], reports[0]):
        assert r.host_bytes + r.device_bytes == r.saved_bytes == k.saved_bytes
        assert r.host_bytes == reports[2][0].host_bytes  # no block pays for the shared tables


def test_forward_without_backward_frees_everything():
    """A graph dropped without backward (evaluation with gradients on, a skipped batch) is freed
    at once -- while measuring, with swapped and checkpointed blocks -- and so are host buffers."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=2, n_swap=2, n_checkpoint=1), device="cpu")
    x = batches(1)[0]
    for _ in range(3):
        engine.activations.measure_next_forward()
        with LiveStorageTracker() as tracker:
            out = engine.module(input_ids=x, labels=x, use_cache=False)
        assert tracker.live_bytes(exclude=engine.activations.host.storages()) > 0
        del out
        assert tracker.live_bytes(exclude=engine.activations.host.storages()) == 0
    host = engine.activations.host
    assert sum(len(b) for b in host._free.values()) == len(host._all) > 0  # all back in the pool


def test_two_forwards_then_two_backwards():
    """Each backward brings back only its own forward's swapped activations, and the
    accumulated result equals plain PyTorch."""
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=1, n_buffer=2, n_swap=3), device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    x1, x2 = batches(2)
    stats = engine.activations.stats
    out1 = engine.module(input_ids=x1, labels=x1, use_cache=False)
    one_forward = stats["swap_out_bytes"]
    out2 = engine.module(input_ids=x2, labels=x2, use_cache=False)
    with engine.no_sync():
        engine.backward(out2.loss)
    assert stats["swap_in_bytes"] == one_forward  # forward 1's activations stayed on the host
    engine.backward(out1.loss)
    assert stats["swap_in_bytes"] == 2 * one_forward
    engine.step()
    ref(input_ids=x2, labels=x2).loss.backward()
    ref(input_ids=x1, labels=x1).loss.backward()
    ref_opt.step()
    assert_same_weights(engine.state_dict(), ref)


class _KwBlock(nn.Module):
    """Called with keyword arguments only; dropout makes recomputation depend on the RNG."""

    def __init__(self, d=64):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, *, x, scale):
        return x + self.drop(torch.tanh(self.lin(x))) * scale


class _KwModel(nn.Module):
    def __init__(self, n=4, d=64):
        super().__init__()
        self.blocks = nn.ModuleList(_KwBlock(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x=x, scale=0.5)
        return x.square().mean()


def _kw_losses(device, ckpt):
    torch.manual_seed(0)
    model = _KwModel()
    x = torch.randn(4, 32, 64)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=1, n_buffer=1, n_checkpoint=ckpt),
                     device=device, example_inputs=(x,))
    x = x.to(device)
    losses = []
    torch.manual_seed(1)
    for _ in range(4):
        loss = engine.module(x)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses, engine.state_dict()


def test_keyword_only_blocks_with_dropout_recompute_identically():
    keep, ckpt = _kw_losses("cpu", 0), _kw_losses("cpu", 4)
    assert keep[0] == ckpt[0]
    for k in keep[1]:
        assert torch.equal(keep[1][k], ckpt[1][k]), k


@pytest.mark.cuda
def test_cuda_keyword_only_blocks_with_dropout_recompute_identically():
    """checkpoint restores the CUDA RNG only if it sees a CUDA tensor among the positional
    arguments: the engine passes one."""
    keep, ckpt = _kw_losses("cuda", 0), _kw_losses("cuda", 4)
    assert keep[0] == ckpt[0]
    for k in keep[1]:
        assert torch.equal(keep[1][k], ckpt[1][k]), k


class _ViewBlock(nn.Module):
    """Saves views of one storage (q, k, v), a parameter view and a non-contiguous slice."""

    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # three strided views of one storage
        a = torch.sigmoid(q) * k * v  # saves q's sigmoid output, views k and v
        return x + a @ self.out.weight.t()  # saves a and a view of a parameter


class _ViewModel(nn.Module):
    def __init__(self, d=64, n=3, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_ViewBlock(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())


@pytest.mark.parametrize("n_persist", [0, 99])
def test_swap_copies_each_storage_once_and_keeps_parameter_views(n_persist):
    torch.manual_seed(0)
    model, d, n = _ViewModel(), 64, 3
    ref = copy.deepcopy(model)
    x = torch.randint(0, 50, (2, 16))
    chunks = pt.build_layout(model, "blocks", n, example_inputs=(x,)).n_chunks
    plan = pt.Plan(n_persist=min(n_persist, chunks), n_buffer=2, n_swap=n)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu", example_inputs=(x,),
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        loss = engine.module(x)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == ref_loss.item()
    assert_same_weights(engine.state_dict(), ref)
    # Per block and step: the block input x (saved by the qkv linear), the qkv output once for
    # q, k and v, sigmoid(q), sigmoid(q)*k, and a -- never the output projection's weight.
    tokens = x.numel()
    per_block = 4 * tokens * (d + 3 * d + d + d + d)
    assert engine.activations.stats["swap_out_bytes"] == 3 * n * per_block
    assert all(r.host_bytes == per_block for r in engine.activations.report())


def test_in_place_change_of_a_saved_tensor_is_reported():
    """Autograd's version check survives the saved-tensor hooks (for a swapped tensor: while
    the modified tensor is still alive, which is how a later in-place change can happen)."""

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            y = torch.sigmoid(self.lin(x))  # sigmoid saves its output
            y.mul_(2)  # ...which is then modified in place: a bug in the model
            self.last = y
            return y

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Bad() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    x = torch.randn(4, 300, 32)  # large enough to be swapped
    for swap in (0, 2):
        model = M()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1, n_swap=swap), device="cpu", example_inputs=(x,))
        engine.activations.measure_next_forward()  # kept blocks run under the counting hooks too
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.backward(engine.module(x))


# ----- report ------------------------------------------------------------------------------
@pytest.mark.filterwarnings(CACHE_WARNING)
def test_activation_report():
    model = MODELS["llama"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=1), device="cpu")
    assert engine.block_modes == (S, C, K, K)
    assert all(r.saved_bytes is None and r.device_bytes == 0 for r in engine.activations.report())  # nothing ran yet
    train_engine(engine, batches(2))
    swap, ckpt, keep, _ = engine.activations.report()
    assert swap.host_bytes > 0 and swap.saved_bytes == keep.saved_bytes > 0
    assert ckpt.saved_bytes is None and ckpt.device_bytes == ckpt.input_bytes > 0 and ckpt.host_bytes == 0
    assert keep.device_bytes == keep.saved_bytes > ckpt.input_bytes
    # Kept blocks are measured once; later forwards run without hooks until asked again.
    assert engine.activations._measure is False
    engine.activations.measure_next_forward()
    x = batches(1, batch=4)[0]  # twice the batch: twice the activations (the rotary cos/sin
    engine.module(input_ids=x, labels=x)  # tables, shared by all blocks, are not counted per block)
    assert engine.activations.report()[2].saved_bytes == 2 * keep.saved_bytes


def test_close_restores_forwards_and_removes_hooks():
    """Only checkpointed blocks get an instance ``forward`` ([Note: block forwards]); kept and
    swapped blocks are managed by hooks. ``close`` leaves the model as it was."""
    model = MODELS["gpt2"]()
    cls_forward = type(model.transformer.h[0]).forward
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1, n_swap=1, n_checkpoint=1), device="cpu")
    blocks = list(model.transformer.h)
    assert engine.block_modes == (S, C, K, K)
    assert [("forward" in b.__dict__) for b in blocks] == [False, True, False, False]
    assert blocks[0]._forward_pre_hooks and blocks[3]._forward_hooks
    engine.close()
    assert all("forward" not in b.__dict__ for b in blocks)
    assert type(model.transformer.h[0]).forward is cls_forward
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# ----- CUDA --------------------------------------------------------------------------------
def _cuda_gpt2(n_layer=8, d=512):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=d, n_head=8, vocab_size=512, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["all-checkpoint", "all-swap", "mixed-2s1c"])
def test_cuda_identity_across_layouts(layout):
    data = batches(5, device="cuda")
    results = {}
    for name in ("keep", layout):
        model = MODELS["gpt2"]()
        plan = chunk_plans(model, *LAYOUTS[name])["mixed-buf2"]
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, device="cuda",
                         config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[name] = (train_engine(engine, data), engine.state_dict())
        assert engine.activations.host.pin
    (keep_losses, keep_sd), (losses, sd) = results["keep"], results[layout]
    assert losses == keep_losses
    for k in keep_sd:
        assert torch.equal(sd[k], keep_sd[k]), k


def _cuda_peak(swap, ckpt, x):
    model = _cuda_gpt2()
    plan = pt.Plan(n_persist=n_chunks(model), n_buffer=0, n_swap=swap, n_checkpoint=ckpt)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), plan, device="cuda")
    for _ in range(2):  # the second step reuses the host buffers
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    engine.close()
    return peak


@pytest.mark.cuda
def test_cuda_peak_memory_falls_with_checkpointing_and_swapping():
    x = torch.randint(0, 512, (8, 512), device="cuda")
    keep = _cuda_peak(0, 0, x)
    ckpt = [_cuda_peak(0, n, x) for n in (2, 4, 8)]
    swap = [_cuda_peak(n, 0, x) for n in (2, 4, 8)]
    assert keep > ckpt[0] > ckpt[1] > ckpt[2]
    assert keep > swap[0] > swap[1] > swap[2]


@pytest.mark.cuda
def test_cuda_swap_copies_overlap_compute():
    """Device-to-host activation copies run on the swap stream while forward kernels run."""
    from torch.profiler import ProfilerActivity, profile

    model = _cuda_gpt2()
    plan = pt.Plan(n_persist=n_chunks(model), n_buffer=0, n_swap=8)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), plan, device="cuda")
    x = torch.randint(0, 512, (8, 512), device="cuda")
    engine.backward(engine.module(input_ids=x, labels=x).loss)  # warm-up: host buffers exist
    engine.step()
    engine.zero_grad()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss = engine.module(input_ids=x, labels=x).loss
        torch.cuda.synchronize()
    engine.backward(loss)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in events if "DtoH" in e.name or "Device -> Pinned" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels
    overlapping = [
        c for c in copies
        if any(k.time_range.start < c.time_range.end and c.time_range.start < k.time_range.end for k in kernels)
    ]
    # How many overlap depends on the copy / compute ratio of the GPU and its link (the first GPU
    # session, an H200: 57 of 129); that they overlap at all, and begin while the forward's
    # kernels still run, does not.
    assert overlapping, f"none of {len(copies)} swap copies overlaps a kernel"
    first_copy = min(c.time_range.start for c in copies)
    assert first_copy < max(k.time_range.start for k in kernels), "the swap copies began after the forward's kernels"


def test_host_buffers_are_reused_across_steps_and_follow_shape_changes():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=2, n_swap=4), device="cpu")
    host, stats = engine.activations.host, engine.activations.stats

    def step(x):
        before = stats["swap_out_bytes"]
        engine.backward(engine.module(input_ids=x, labels=x, use_cache=False).loss)
        engine.step()
        engine.zero_grad()
        return stats["swap_out_bytes"] - before

    x = batches(1)[0]
    swapped = step(x)
    first = host.nbytes
    assert swapped <= first <= 1.125 * swapped  # size classes: at most 1/8 more
    for _ in range(3):
        step(x)
        assert host.nbytes == first  # same shapes: the same buffers
    for seq in range(4, 16):  # a sequence-length warm-up: new shapes at every step
        swapped = step(x[:, :seq])
        assert host.nbytes <= 1.125 * swapped  # buffers of earlier shapes were freed


def test_size_classes():
    from protrain_core.runtime.swap import size_class as _size_class

    for n in list(range(1, 5000)) + [2**20 + 1, 3 * 2**30 + 7]:
        c = _size_class(n)
        assert n <= c <= max(n * 1.125, n + 63) and c % 64 == 0


class _NormBlock(nn.Module):
    """Updates buffers in forward (BatchNorm's running statistics, ``num_batches_tracked``) and
    reads one it updated (a step counter that scales the output)."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x + torch.tanh(self.norm(self.lin(x))) / self.calls


class _NormModel(nn.Module):
    def __init__(self, n=4, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(_NormBlock(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.parametrize("ckpt,n_persist,plain_backward", [(0, 1, False), (2, 1, False), (4, 1, False),
                                                        (4, 1, True), (4, 4, True)])
def test_buffers_updated_in_forward_stay_exact_under_recomputation(ckpt, n_persist, plain_backward):
    """Checkpointed blocks recompute their forward in backward; the buffers the forward updates
    are updated once per forward all the same, and the recomputation reads what the forward
    read: losses, weights and buffers bitwise equal to plain PyTorch (4 steps; before: the
    running statistics and counters were updated twice, and the counter's second value changed
    the recomputed activations). Also with ``loss.backward()`` where every chunk persists: the
    last block's recomputation is then the backward's first act, before any runtime hook."""
    torch.manual_seed(0)
    reference = _NormModel()
    model = copy.deepcopy(reference)
    xs = [torch.randn(16, 32) for _ in range(4)]
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    ref_losses = []
    for x in xs:
        loss = reference(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    plan = pt.Plan(n_persist=n_persist, n_buffer=1 if n_persist < 4 else 0, n_checkpoint=ckpt)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu", example_inputs=(xs[0],))
    assert engine.block_modes.count(C) == ckpt
    losses = []
    for x in xs:
        loss = engine.module(x)
        loss.backward() if plain_backward else engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    assert losses == ref_losses
    state = engine.state_dict()
    for name, t in reference.state_dict().items():
        assert torch.equal(state[name], t), name
    assert int(state["blocks.0.norm.num_batches_tracked"]) == 4
    engine.close()
