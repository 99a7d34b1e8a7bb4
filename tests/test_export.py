"""engine.save_pretrained: the one export of a wrapped Hugging Face model (issue 18, case 4).
The model's own save_pretrained, while the engine is open, writes the compute copies (bf16 in
bf16-mixed) and their dtype; the engine's writes the master weights and their dtype, so that
from_pretrained rebuilds exactly the trained model in every precision."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import protrain_core as pt
from conftest import MODELS, batches

MASTER = {"32-true": torch.float32, "bf16-mixed": torch.float32, "16-mixed": torch.float32, "bf16-true": torch.bfloat16}


def trained(model, precision):
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = pt.wrap(model, torch.optim.AdamW(trainable, lr=1e-2), pt.Plan(n_persist=1, n_buffer=2),
                     precision=precision, device="cpu")
    for x in batches(2):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
    return engine


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("precision", list(MASTER))
def test_save_pretrained_writes_the_master_weights_and_their_dtype(tmp_path, arch, precision):
    engine = trained(MODELS[arch](), precision)
    before = engine.module.config.dtype
    engine.save_pretrained(tmp_path)
    assert engine.module.config.dtype == before  # the running model's config is left as it was
    masters = engine.state_dict()
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(MASTER[precision]).split(".")[1]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == MASTER[precision]
    # The same logits as the master weights loaded by hand into the same architecture.
    by_hand = AutoModelForCausalLM.from_config(loaded.config, dtype=MASTER[precision])
    by_hand.load_state_dict(masters)
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, by_hand(input_ids=x).logits)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, masters[k]), k
    engine.close()


def test_save_pretrained_of_a_peft_model_writes_the_adapters(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(MODELS["llama"](), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = trained(model, "bf16-mixed")
    engine.save_pretrained(tmp_path)
    masters = engine.state_dict()
    again = PeftModel.from_pretrained(MODELS["llama"](), tmp_path).state_dict()
    lora = [k for k in masters if "lora_" in k]
    assert lora and all(again[k].dtype == torch.float32 and torch.equal(again[k], masters[k]) for k in lora)
    engine.close()


def test_save_pretrained_needs_a_model_that_has_it(tmp_path):
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = Plain()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu",
                     example_inputs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="no save_pretrained.*torch.save"):
        engine.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="state_dict= itself"):
        trained(MODELS["gpt2"](), "32-true").save_pretrained(tmp_path, state_dict={})
    engine.close()


def test_save_pretrained_exports_the_hugging_face_model_inside_a_lightning_module(tmp_path):
    """The usual LightningModule holds the model in ``self.model`` (and may own parameters of its
    own): ``trainer.strategy.engine.save_pretrained(dir)`` exports that model, under its own
    names; it was refused ("not a Hugging Face model"). Two models inside: name the one."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from conftest import SEQ, VOCAB
    from lightning_protrain import ProTrainStrategy

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = MODELS["gpt2"]()
            self.scale = torch.nn.Parameter(torch.tensor(1.0))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss * self.scale

        def on_train_end(self):
            self.trainer.strategy.engine.save_pretrained(tmp_path / "hf", safe_serialization=True)
            self.masters = self.trainer.strategy.engine.state_dict()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    lit = Lit()
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (4, SEQ))), batch_size=2)
    # (two buffers: the module's own scale makes its unit one that runs around the model's)
    pl.Trainer(strategy=ProTrainStrategy(pt.Plan(n_persist=1, n_buffer=2)), accelerator="cpu", max_steps=2,
               precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(lit, data)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.float32
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, lit.masters[f"model.{k}"]), k

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.student, self.teacher = MODELS["gpt2"](n_layer=2), MODELS["gpt2"](n_layer=2)

    two = Two()
    engine = pt.wrap(two, torch.optim.AdamW(two.student.parameters()), pt.Plan(n_persist=1, n_buffer=1),
                     device="cpu", config=pt.ProTrainConfig(planning={"blocks": ["student.transformer.h"]}))
    with pytest.raises(ValueError, match=r"several models with save_pretrained \(student, teacher\).*module='student'"):
        engine.save_pretrained(tmp_path / "two")
    engine.save_pretrained(tmp_path / "two", module="teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    assert all(torch.equal(v, two.teacher.state_dict()[k]) for k, v in teacher.state_dict().items())
    engine.close()


def test_a_failed_export_leaves_the_previous_one_whole_and_a_new_one_replaces_its_weight_files(tmp_path, monkeypatch):
    """Nothing saved is lost: an export written beside the directory and renamed into place.
    One that fails half-way (a disk full inside the model's save_pretrained) leaves the
    previous export byte for byte and no temporary; one that succeeds replaces the earlier
    export's weight files, sharded or not (as save_pretrained cleans up its own), and leaves the
    other files of the directory (a tokenizer's) alone."""
    import os

    engine = trained(MODELS["llama"](), "32-true")
    out = tmp_path / "export"
    engine.save_pretrained(out, max_shard_size="20KB")  # several shards and their index
    (out / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len([n for n in before if n.endswith(".safetensors")]) > 1 and "model.safetensors.index.json" in before
    model = engine.module
    real = type(model).save_pretrained

    def full_disk(self, directory, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left"):
        engine.save_pretrained(out)
    monkeypatch.setattr(type(model), "save_pretrained", real)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert os.listdir(tmp_path) == ["export"]
    engine.save_pretrained(out)  # one file now
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    masters = engine.state_dict()
    assert all(torch.equal(v, masters[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("kill_at", range(4))
def test_an_export_stopped_at_any_rename_leaves_one_whole_export(kill_at, tmp_path):
    """An export over an earlier one (several shards, then one file), stopped before each of its
    renames and its removal ([Note: replacing a checkpoint directory]): the directory holds the
    earlier export or the new one whole, never a mix (moved in a file at a time, a kill left some
    shards of each, and from_pretrained loaded them); stopped between the two renames, the next
    export finishes it. The tokenizer's file stays throughout."""
    from conftest import SaveKilled, stop_saves_at

    engine = trained(MODELS["llama"](), "32-true")
    out = tmp_path / "export"
    engine.save_pretrained(out, max_shard_size="20KB")
    (out / "tokenizer.json").write_text("{}")
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    engine.zero_grad()
    restore = stop_saves_at(kill_at)
    try:
        with pytest.raises(SaveKilled):
            engine.save_pretrained(out)
    finally:
        restore()
    masters = engine.state_dict()
    if kill_at < 2:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    elif kill_at == 2:
        assert not out.exists()  # the new export complete beside it, put in place by the next export
    else:
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert all(torch.equal(v, masters[k]) for k, v in loaded.state_dict().items())
    engine.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(v, masters[k]) for k, v in loaded.state_dict().items())
    engine.close()
