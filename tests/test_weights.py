"""A model built on the meta device, filled chunk by chunk ([Note: weights straight into chunks]
in protrain_core/runtime/weights.py): from a Hugging Face directory, a safetensors file or a
``torch.save``d checkpoint, or by its modules' own initialisation."""

import warnings

import pytest
import torch
from torch import nn

import protrain_core as pt
from conftest import batches, tiny_llama, train_engine, train_reference


def _meta_like(model):
    with torch.device("meta"):
        return type(model)(model.config)


def _wrap(model, plan, weights=None, **kwargs):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return pt.wrap(model, opt, plan, device="cpu", config=pt.ProTrainConfig(weights=weights), **kwargs)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("plan", [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=2, n_buffer=1, n_checkpoint=1)],
                         ids=["streamed", "mixed"])
def test_a_meta_model_filled_from_a_hugging_face_directory_trains_exactly_as_the_saved_model(plan, shards, tmp_path):
    """save_pretrained's directory (one file, or shards with their index) fills every parameter;
    the optimizer built over the meta parameters steps them; losses and weights are plain
    PyTorch's (fused AdamW) on the saved model, bit for bit; no warning (the rotary embedding's
    frequencies, a buffer no checkpoint holds, come from its initialisation)."""
    ref = tiny_llama(n_layer=3)
    size = sum(p.numel() * 4 for p in ref.parameters())
    ref.save_pretrained(tmp_path, max_shard_size=size // shards + 1 if shards > 1 else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (shards > 1)
    meta = _meta_like(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine = _wrap(meta, plan, weights=str(tmp_path))
    assert not any(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert torch.equal(meta.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    data = batches(4)
    losses = train_engine(engine, data)
    state = engine.state_dict()
    engine.close()
    assert losses == train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), data)
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k


def test_a_checkpoint_file_fills_a_model_under_another_prefix(tmp_path):
    """A Lightning checkpoint (its 'state_dict' holds 'model.'-prefixed keys) fills the bare model,
    and a bare state dict (``torch.save(engine.state_dict())``, a .safetensors file) fills a
    model held in a wrapper; values equal, nothing initialised."""
    from safetensors.torch import save_file

    ref = tiny_llama(n_layer=2)
    lightning = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in ref.state_dict().items()}, "epoch": 3}, lightning)
    bare = tmp_path / "weights.pt"
    torch.save(ref.state_dict(), bare)
    single = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, single)

    class Holder(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, **kwargs):
            return self.model(**kwargs)

    for path, wrapped in [(lightning, False), (bare, True), (single, True)]:
        meta = _meta_like(ref)
        model = Holder(meta) if wrapped else meta
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            engine = _wrap(model, pt.Plan(n_persist=1, n_buffer=1), weights=str(path))
        state = engine.state_dict()
        engine.close()
        prefix = "model." if wrapped else ""
        for k, v in ref.state_dict().items():
            assert torch.equal(state[prefix + k], v), (path.name, k)


def test_a_sharded_protrain_checkpoint_fills_a_meta_model(tmp_path):
    """``engine.save_sharded``'s directory (a torch.distributed.checkpoint) as ``weights``: the
    chunks are initialised, then read from it in place; the weights are the saved engine's."""
    model = tiny_llama(n_layer=2)
    engine = _wrap(model, pt.Plan(n_persist=1, n_buffer=1))
    train_engine(engine, batches(2))
    engine.save_sharded(tmp_path / "sharded")
    saved = engine.state_dict()
    engine.close()
    filled = _wrap(_meta_like(model), pt.Plan(n_persist=0, n_buffer=1), weights=str(tmp_path / "sharded"))
    state = filled.state_dict()
    filled.close()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)


def test_a_tensor_missing_from_the_checkpoint_is_initialised_beside_the_ones_it_holds(tmp_path):
    """GPT-2's checkpoint without one attention bias: the bias is initialised by the model's
    ``_init_weights`` (zero), its module's weight stays the checkpoint's, and the warning names it."""
    from conftest import tiny_gpt2

    ref = tiny_gpt2(n_layer=2)
    state = {k: v for k, v in ref.state_dict().items() if k != "transformer.h.1.attn.c_attn.bias"}
    torch.save(state, tmp_path / "partial.pt")
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) .*: transformer.h.1.attn.c_attn.bias\."):
        engine = _wrap(_meta_like(ref), pt.Plan(n_persist=1, n_buffer=1), weights=str(tmp_path / "partial.pt"))
    filled = engine.state_dict()
    engine.close()
    assert torch.equal(filled["transformer.h.1.attn.c_attn.bias"], torch.zeros(96))
    for k, v in state.items():
        assert torch.equal(filled[k], v), k


def test_without_weights_every_module_initialises_its_own_parameters():
    """No checkpoint: the Hugging Face model's ``_init_weights`` per module, chunk by chunk --
    norms at one, projections and embeddings at the configured deviation, the rotary
    frequencies as the model computes them -- and the model trains."""
    ref = tiny_llama(n_layer=2)
    meta = _meta_like(ref)
    engine = _wrap(meta, pt.Plan(n_persist=0, n_buffer=1))
    state = engine.state_dict()
    std = ref.config.initializer_range
    assert torch.equal(state["model.norm.weight"], torch.ones(32))
    big = [k for k in state if k.endswith("proj.weight") or "embed" in k]
    assert big and all(abs(state[k].std().item() - std) < 0.25 * std for k in big), {k: state[k].std() for k in big}
    assert torch.equal(meta.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    losses = train_engine(engine, batches(4))
    engine.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_a_lora_model_over_a_meta_base_takes_the_base_from_the_checkpoint_and_initialises_its_adapters(tmp_path):
    """PEFT's LoRA over a base built on the meta device: the base from the Hugging Face
    directory (PEFT's ``.base_layer`` names matched), the adapters by PEFT's own initialisation
    (B at zero: the model starts as the base), with a warning that names them."""
    peft = pytest.importorskip("peft")
    ref = tiny_llama(n_layer=2)
    ref.save_pretrained(tmp_path)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(_meta_like(ref), config)
    with pytest.warns(UserWarning, match=r"8 tensor\(s\) .* initialised by their modules: .*lora_A"):
        engine = _wrap(model, pt.Plan(n_persist=1, n_buffer=1), weights=str(tmp_path))
    state = engine.state_dict()
    base = ref.state_dict()
    for k, v in state.items():
        plain = k.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_B" in k:
            assert torch.equal(v, torch.zeros_like(v)), k
        elif "lora_A" in k:
            assert v.abs().sum() > 0, k
        else:
            assert torch.equal(v, base[plain]), k
    x = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(engine.module(input_ids=x).logits, ref(input_ids=x).logits)
    engine.close()


def test_profiling_ahead_leaves_the_parameters_to_the_checkpoint(tmp_path):
    """``wrap(example_inputs=...)`` profiles a meta model on initial values, then puts its
    parameters back on the meta device: the engine that trains holds the checkpoint's values."""
    ref = tiny_llama(n_layer=3)
    ref.save_pretrained(tmp_path)
    meta = _meta_like(ref)
    x = batches(1)[0]
    engine = _wrap(meta, None, weights=str(tmp_path), example_inputs={"input_ids": x, "labels": x},
                   report=lambda *a, **k: None)
    state = engine.state_dict()
    engine.close()
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k


def test_what_cannot_be_filled_is_refused_with_the_fix(tmp_path):
    ref = tiny_llama(n_layer=2)
    ref.save_pretrained(tmp_path / "hf")
    plan = pt.Plan(n_persist=0, n_buffer=1)
    with pytest.raises(ValueError, match="all hold values already"):
        _wrap(tiny_llama(n_layer=2), plan, weights=str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _wrap(_meta_like(ref), plan, weights=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without safetensors files"):
        _wrap(_meta_like(ref), plan, weights=str(tmp_path / "empty"))
    other = tiny_llama(n_layer=2)
    other.config.intermediate_size = 48
    with pytest.raises(ValueError, match=r"mlp.*is \(48, 32\).*another model configuration"):
        _wrap(_meta_like(type(other)(other.config)), plan, weights=str(tmp_path / "hf"))
    torch.save({"unrelated.weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="holds none of the model's parameters"):
        _wrap(_meta_like(ref), plan, weights=str(tmp_path / "other.pt"))

    class Scale(nn.Module):  # a parameter no initialisation knows
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(32))

        def forward(self, x):
            return x * self.gain

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), Scale()) for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with torch.device("meta"):
        net = Net()
    with pytest.raises(ValueError, match=r"'layers.0.1.gain' is on the meta device .* \(Scale\)"):
        pt.wrap(net, torch.optim.AdamW(net.parameters()), plan, device="cpu")
