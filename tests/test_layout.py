"""Block discovery and the execution-order chunk layout."""

import copy

import pytest
import torch
from torch import nn

import protrain_core as pt
from protrain_core.chunk_format import ALIGN
from protrain_core.structure.layout import pack as _pack, search_chunk_size
from conftest import tiny_gpt2, tiny_llama, train_engine, train_reference


def _hf(name):
    import transformers as tf

    small = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64)
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(intermediate_size=64, num_key_value_heads=2, **small))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **small))
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, **small))
    if name == "gpt2":
        return tiny_gpt2(n_layer=3)
    return tiny_llama(n_layer=3)


@pytest.mark.parametrize(
    "name,path", [("gpt2", "transformer.h"), ("llama", "model.layers"), ("mistral", "model.layers"), ("qwen2", "model.layers"), ("opt", "model.decoder.layers")]
)
def test_block_discovery_for_hf_families(name, path):
    model = _hf(name)
    found, blocks = pt.find_blocks(model)
    assert found == path and len(blocks) == 3


class Plain(nn.Module):
    def __init__(self, n=4, d=16):
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.stack_a = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.stack_b = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])  # two same-class stacks: ambiguous
        self.head = nn.Linear(d, 50)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.stack_a:
            h = torch.relu(layer(h))
        for layer in self.stack_b:
            h = layer(h)
        return self.head(h)


def test_single_homogeneous_modulelist_is_found():
    model = Plain()
    model.stack_b = nn.ModuleList([nn.Linear(16, 16), nn.ReLU()])
    assert pt.find_blocks(model)[0] == "stack_a"


def test_no_blocks_found_lists_candidates_and_blocks_override_works():
    model = Plain()
    with pytest.raises(ValueError) as err:
        pt.find_blocks(model)
    assert "'stack_a': 4 x Linear" in str(err.value) and "'stack_b': 2 x Linear" in str(err.value) and "planning={'blocks'" in str(err.value)
    assert pt.find_blocks(model, "stack_a")[0] == "stack_a"
    assert pt.find_blocks(model, model.stack_a)[0] == "stack_a"
    with pytest.raises(ValueError, match="does not name"):
        pt.find_blocks(model, "head")
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu",
                     example_inputs=torch.zeros(2, 3, dtype=torch.long),
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(blocks="stack_a")))
    assert engine.layout.order_source == "traced"


class Uncalled(nn.Module):
    """Blocks that are containers: the model calls the layers inside each, never the block."""

    def __init__(self, d=16, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"lin": nn.Linear(d, d), "out": nn.Linear(d, d)}) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b["out"](torch.relu(b["lin"](x)))
        return x


def test_blocks_the_model_never_calls_are_refused_with_the_fix():
    """A block list whose blocks have no forward (nn.ModuleDict) is refused where the blocks are
    found, named or discovered: ProTrain would never see a block run (with several processes
    and streamed chunks the forward read placeholders: a NaN loss, found in session 28)."""
    model = Uncalled()
    for blocks in ("blocks", model.blocks, None):
        with pytest.raises(ValueError, match="ModuleDict without a forward of their own") as err:
            pt.find_blocks(model, blocks)
        assert "'blocks': 3 x ModuleDict" in str(err.value) and "planning={'blocks'" in str(err.value)
    with pytest.raises(ValueError, match="without a forward of their own"):
        pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu",
                config=pt.ProTrainConfig(planning=pt.PlanningConfig(blocks="blocks")))


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "opt"])
def test_layout_properties(name, use_cache):
    model = _hf(name)
    model.config.use_cache = use_cache  # training configs often turn the cache off
    path, blocks = pt.find_blocks(model)
    layout = pt.build_layout(model, path, len(blocks))
    assert layout.order_source == "traced"
    names = [n for n, _ in model.named_parameters()]
    placed = [m.name for c in layout.chunks for m in c.members]
    assert sorted(placed) == sorted(names)  # every parameter exactly once (tied ones once)
    for i in range(len(blocks)):  # a block never straddles chunks
        owners = {layout.chunk_of(n) for n in names if n.startswith(f"{path}.{i}.")}
        assert len(owners) == 1
    for c in layout.chunks:
        end = 0
        for m in c.members:
            assert m.offset % ALIGN == 0 and m.offset >= end
            end = m.offset + m.numel
        assert end <= layout.chunk_size
    # Execution order: the embedding comes first, the final norm and the head last.
    assert "embed" in placed[0] or "wte" in placed[0]
    final = {"gpt2": "transformer.ln_f.weight", "opt": "model.decoder.final_layer_norm.weight"}.get(name, "model.norm.weight")
    assert layout.chunk_of(final) == layout.n_chunks - 1
    last_block = [i for i, n in enumerate(placed) if n.startswith(f"{path}.{len(blocks) - 1}.")]
    assert placed.index(final) > max(last_block)
    print(layout.summary())


def test_tied_parameter_goes_where_it_is_first_used():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    path, blocks = pt.find_blocks(model)
    layout = pt.build_layout(model, path, len(blocks))
    assert layout.chunk_of("transformer.wte.weight") == 0
    assert "lm_head.weight" not in [m.name for c in layout.chunks for m in c.members]


def test_chunk_size_search_minimises_waste():
    units = [300, 700, 700, 700, 700, 120, 40]
    best = search_chunk_size(units)
    waste = lambda s: len(_pack(units, s)) * s - sum(units)  # noqa: E731
    brute = min(range(704, 2 * 704 + 1, ALIGN), key=lambda s: (waste(s), s))
    assert waste(best) <= waste(brute)
    assert best >= max(units)


def test_chunk_size_override_and_summary():
    model = tiny_gpt2()
    path, blocks = pt.find_blocks(model)
    with pytest.raises(ValueError, match="smaller than the unit"):
        pt.build_layout(model, path, len(blocks), chunk_size=100)
    layout = pt.build_layout(model, path, len(blocks), chunk_size=40_000)
    assert layout.chunk_size == 40_000
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    text = engine.summary()
    assert "persistent" in text and "streamed" in text and "transformer.h.0" in text
    assert str(engine.layout).startswith("ProTrain chunk layout")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_models_are_traced(family, recwarn):
    """Issue 18, case 9: Hugging Face's MoE layers call grouped matmuls whose meta kernels take
    bf16 only; the trace retries with bf16 meta tensors (the call order does not depend on the
    dtype) instead of falling back to registration order, and the model trains."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96)
    torch.manual_seed(0)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                   head_dim=8, **common))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=2), device="cpu")
    assert engine.layout.order_source == "traced"
    assert not [w for w in recwarn if "Could not trace" in str(w.message)]
    x = torch.randint(0, 96, (2, 8))
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    engine.close()


def _encoder_decoder(family):
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    if family == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_decoder_layers=3, num_heads=4, decoder_start_token_id=0,
                                                   pad_token_id=0, dropout_rate=0.0))
    return BartForConditionalGeneration(BartConfig(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_models_have_both_stacks_as_blocks(family):
    """Issue 18, case 9: the encoder's and the decoder's blocks are all blocks (2 + 3 here), so
    the plan checkpoints and swaps either stack; training equals plain PyTorch: bitwise for BART,
    and for T5 bitwise when every block keeps its activations and within float rounding when
    they are recomputed or swapped (its position bias, made by the first block and used by all,
    gets its gradient summed in another order: torch's own gradient checkpointing of T5 moves
    the loss by the same 5e-7)."""
    model = _encoder_decoder(family)
    path, blocks = pt.find_blocks(model)
    assert len(blocks) == 5 and path in ("encoder.block+decoder.block", "model.encoder.layers+model.decoder.layers")
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(3, 96, (2, 12), generator=g) for _ in range(3)]
    ref = copy.deepcopy(model)
    expected = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), data)
    for plan in (pt.Plan(n_persist=1, n_buffer=2), pt.Plan(n_persist=1, n_buffer=2, n_swap=2, n_checkpoint=2)):
        m = copy.deepcopy(model)
        engine = pt.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), plan, device="cpu",
                         config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
        assert engine.layout.n_blocks == 5 and len(engine.block_modes) == 5
        losses = train_engine(engine, data)
        report = engine.activations.report()
        engine.close()
        assert len(report) == 5  # the decoder's blocks too
        if family == "bart" or plan.n_swap == plan.n_checkpoint == 0:
            assert losses == expected, plan
        else:
            assert losses == pytest.approx(expected, abs=1e-5), plan
