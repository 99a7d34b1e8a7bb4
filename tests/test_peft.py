"""PEFT LoRA through the core API and the Trainer: tiny LLaMA, GPT-2 and Qwen2; all-persistent,
all-streamed and mixed plans with swap and checkpoint. fp32 is bitwise plain PEFT +
``AdamW(fused=True)``; bf16-mixed the matching recipe (test_frozen.reference). Checkpoints keep
PEFT's keys and load into a plain PEFT model; merged weights give the plainly trained logits."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

import protrain_core as pt
from conftest import MODELS, SEQ, VOCAB, batches, train_engine
from lightning_protrain import ProTrainStrategy
from test_frozen import LR, plans, reference

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "qwen2": ["q_proj", "v_proj"]}


def tiny_qwen2(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64))


def lora(arch, seed=0):
    base = tiny_qwen2(seed) if arch == "qwen2" else MODELS[arch](seed=seed)
    torch.manual_seed(seed + 100)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[arch], lora_dropout=0.0))
    with torch.no_grad():  # LoRA's B starts at zero: start it elsewhere so that every adapter weight trains
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.filterwarnings("ignore:ProTrain. a key/value cache")
@pytest.mark.grid(ci=lambda arch, plan_name, precision: arch == "llama" or plan_name == "mixed-swap-checkpoint")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("plan_name", ["all-persistent", "all-streamed", "mixed-swap-checkpoint"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_lora_core_api(arch, plan_name, precision):
    model = lora(arch)
    data = batches(4)
    ref_losses, ref_values = reference(model, data, precision)
    engine = pt.wrap(model, torch.optim.AdamW(trainable(model), lr=LR), plans(model)[plan_name], precision=precision,
                     device="cpu", config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    assert train_engine(engine, data) == ref_losses
    sd = engine.state_dict()
    assert list(sd) == list(model.state_dict())  # PEFT's own names
    ulp = 1.2e-7 if precision == "bf16-mixed" else 0.0
    for k, v in ref_values.items():
        torch.testing.assert_close(sd[k], v, rtol=ulp, atol=0, msg=k)


def test_lora_model_states_bytes():
    """bf16-mixed LoRA: the frozen base costs its bf16 copy, the adapters their full states.
    Host + device model-state bytes <= 1.1 x (2 B x frozen + 16 B x trainable) + chunk rounding,
    on every plan; and far below the same model fully fine-tuned."""
    model = lora("llama")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n_train = sum(p.numel() for p in trainable(model))
    held = {}
    for plan_name, plan in plans(lora("llama")).items():
        m = lora("llama")
        engine = pt.wrap(m, torch.optim.AdamW(trainable(m)), plan, precision="bf16-mixed", device="cpu")
        held[plan_name] = engine.memory.host_bytes() + sum(c.storage.device_bytes() for c in engine.chunks
                                                           if c.persistent)
        padding = engine.layout.waste * 2
        assert held[plan_name] <= 1.1 * (2 * frozen + 16 * n_train) + padding, (plan_name, held[plan_name])
        engine.close()
    full = MODELS["llama"]()
    engine = pt.wrap(full, torch.optim.AdamW(full.parameters()), pt.Plan(n_persist=0, n_buffer=1), precision="bf16-mixed",
                     device="cpu")
    assert held["all-streamed"] < 0.2 * engine.memory.host_bytes()


def test_lora_plans_stream_the_frozen_base_when_it_does_not_fit():
    """The planner sees frozen chunks (compute copy, upload only): with a budget below the
    all-persistent plan it streams them, and its explanation splits trainable and frozen bytes."""
    model = lora("llama")
    x = batches(1)[0]
    prof = pt.profile(model, torch.optim.AdamW(trainable(model)), {"input_ids": x, "labels": x}, cache=False,
                      precision="bf16-mixed")
    assert sum(c.frozen_numel for c in prof.chunks) > 10 * sum(c.updated_numel for c in prof.chunks) > 0
    cm = pt.CostModel(prof)
    everything = cm.memory(pt.Plan(n_persist=prof.n_chunks, n_buffer=0)).peak_bytes
    choice = pt.search(prof, int(0.6 * everything))
    assert choice.plan.n_persist < prof.n_chunks and choice.memory.peak_bytes <= 0.6 * everything
    text = choice.explain()
    assert "trainable" in text and "frozen" in text
    # bf16-mixed, fp32 moments: a trainable parameter's compute copy, master, accumulator and two
    # moments on the host, the chunks' frozen base apart (and the alignment between members)
    per_trainable = float(text.split("a trainable parameter holds ")[1].split(" B")[0])
    assert 18 <= per_trainable < 19, text
    for c in prof.chunks:  # no gradient offload and no CPU Adam is charged for the frozen base
        assert c.offload_bytes == c.state_numel * 2 and c.updated_numel <= c.trainable_numel < c.frozen_numel // 10


# ----- the Trainer ----------------------------------------------------------------------------
class LitLoRA(pl.LightningModule):
    def __init__(self, arch="llama"):
        super().__init__()
        self.model = lora(arch)
        self.losses = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.AdamW(trainable(self), lr=LR, fused=True)


def fit(strategy, arch="llama", **kw):
    torch.manual_seed(1234)
    lit = LitLoRA(arch)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (16, SEQ), generator=g)), batch_size=4, shuffle=False)
    t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
    t.fit(lit, data)
    return lit, t


@pytest.mark.filterwarnings("ignore:ProTrain. a key/value cache")
@pytest.mark.grid(ci=lambda arch, plan_name: arch == "llama" or plan_name == "mixed-swap-checkpoint")
@pytest.mark.parametrize("plan_name", ["all-persistent", "all-streamed", "mixed-swap-checkpoint"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_lora_trainer_checkpoint_and_merge(tmp_path, arch, plan_name):
    ref_lit, _ = fit("auto", arch)
    lit, t = fit(ProTrainStrategy(plans(lora(arch))[plan_name]), arch)
    assert lit.losses == ref_lit.losses
    path = tmp_path / "lora.ckpt"
    t.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    inner = {k[len("model."):]: v for k, v in ckpt["state_dict"].items()}
    assert list(inner) == list(ref_lit.model.state_dict())  # PEFT's own keys
    plain = lora(arch, seed=7)
    plain.load_state_dict(inner, strict=True)  # loads into a plain PEFT model
    for k, v in ref_lit.model.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[k], v, rtol=0, atol=0, msg=k)
    # merge_and_unload -> save_pretrained -> from_pretrained: the plainly trained model's logits.
    merged = plain.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    again = type(merged).from_pretrained(tmp_path / "merged")
    ref_merged = copy.deepcopy(ref_lit.model).merge_and_unload()
    x = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, ref_merged(input_ids=x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("plan_name", ["all-persistent", "all-streamed", "mixed-swap-checkpoint"])
def test_merge_and_unload_while_the_engine_is_open_merges_as_plain_peft(plan_name):
    """``merge_and_unload()`` between steps, the engine open (a callback's ``on_train_end``):
    PEFT's delta is computed with gradients on (its weights used outside their blocks: their
    chunk is fetched), then written as ``base.weight.data += delta`` (a rebinding). Every chunk
    keeps what its parameters were rebound to when it points them anew (released to make room
    for the next layer's chunk), so the merged model gives plain PEFT's merged logits."""
    data, x = batches(3), batches(1, seed=9)[0]
    ref = lora("llama")
    opt = torch.optim.AdamW(trainable(ref), lr=LR, fused=True)
    for batch in data:
        ref(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model = lora("llama")
    engine = pt.wrap(model, torch.optim.AdamW(trainable(model), lr=LR), plans(model)[plan_name], device="cpu")
    train_engine(engine, data)
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, ref.merge_and_unload()(input_ids=x).logits, rtol=0,
                                   atol=0)
    engine.close()


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_lora(precision):
    """On the GPU, all chunks streamed: close to plain PEFT (fp32: CPU and CUDA fused Adam may
    round differently) and to the recipe (bf16-mixed)."""
    model = lora("llama")
    data = batches(6, device="cuda")
    ref_losses, _ = reference(copy.deepcopy(model).cuda(), data, precision)
    engine = pt.wrap(model, torch.optim.AdamW(trainable(model), lr=LR), pt.Plan(n_persist=0, n_buffer=1),
                     precision=precision, device="cuda",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses = train_engine(engine, data)
    assert engine.memory.host_locked_bytes() > 0
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5 if precision == "32-true" else 2e-2, atol=0)
