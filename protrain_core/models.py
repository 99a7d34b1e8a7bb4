"""Model configs built in for machines without a model hub (nothing is downloaded), and the
model a config describes: random weights on the CPU, or on the meta device for a size-only
simulation (protrain_core/simulator)."""

from __future__ import annotations

import torch

# name -> (Hugging Face model type, config fields)
BUILTIN = {
    "tiny-gpt2": ("gpt2", dict(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=1024, bos_token_id=0,
                               eos_token_id=0)),  # GPT-2's own ids (50256) are outside a 256-token vocabulary
    "tiny-llama": ("llama", dict(num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048)),
    "gpt2-124m": ("gpt2", dict()),
    "llama-1b": ("llama", dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)),
    # OpenLLaMA 3B's shape (its released config).
    "llama-3b": ("llama", dict(num_hidden_layers=26, hidden_size=3200, intermediate_size=8640, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048)),
    # LLaMA-2 shapes (Touvron et al. 2023, table 1 and the released configs).
    "llama-7b": ("llama", dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)),
    "llama-13b": ("llama", dict(num_hidden_layers=40, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                                num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096)),
    # No released model of this size: a LLaMA-shaped 20B (20.3B parameters) between 13B and 30B.
    "llama-20b": ("llama", dict(num_hidden_layers=44, hidden_size=6144, intermediate_size=16384, num_attention_heads=48,
                                num_key_value_heads=48, vocab_size=32000, max_position_embeddings=4096)),
    # LLaMA-1 33B's shape (Touvron et al. 2023a, table 2).
    "llama-30b": ("llama", dict(num_hidden_layers=60, hidden_size=6656, intermediate_size=17920, num_attention_heads=52,
                                num_key_value_heads=52, vocab_size=32000, max_position_embeddings=2048)),
    "llama-70b": ("llama", dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)),
}

# The rungs ``protrain plan --largest`` climbs, smallest first.
LADDER = ("llama-1b", "llama-3b", "llama-7b", "llama-13b", "llama-20b", "llama-30b", "llama-70b")


def load_config(name: str):
    """A built-in config by name, or a local Hugging Face model directory / config.json
    (``ValueError`` with the choices when neither)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if name in BUILTIN:
        model_type, fields = BUILTIN[name]
        return CONFIG_MAPPING[model_type](**fields)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a model config from {name!r} ({e}). Give a local model directory, a config.json "
                         f"path, or one of the built-in configs: {', '.join(BUILTIN)}.") from None


def build(config, device: torch.device | str = "cpu", *, lora_rank: int | None = None,
          lora_targets: str = "all-linear"):
    """(a causal LM of ``config``, or a sequence-to-sequence one for an encoder-decoder, with
    random weights on ``device``, AdamW over its trainable parameters); ``device="meta"``: shapes
    only, no memory. ``lora_rank``: LoRA adapters of that rank (peft, alpha twice the rank) on
    ``lora_targets`` ("all-linear": every linear layer but the output head; or module names,
    comma-separated), the base frozen. A config or targets that cannot be built: ``ValueError``."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config.use_cache = False
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(config)
        if lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            targets = lora_targets if lora_targets == "all-linear" else [t.strip() for t in lora_targets.split(",")]
            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets,
                                                     lora_dropout=0.0))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def token_batch(config, batch_size: int, seq_len: int, device: torch.device | str = "cpu") -> dict:
    """Random token ids as inputs and labels (on the meta device: shapes only)."""
    x = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
    return {"input_ids": x, "labels": x}
