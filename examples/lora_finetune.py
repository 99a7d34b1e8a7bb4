"""LoRA fine-tuning with PEFT and ``Trainer(strategy="protrain")``.

Default, with no arguments: the built-in "tiny-llama" config (randomly initialised; nothing is
downloaded) wrapped by ``peft.get_peft_model`` with LoRA adapters on the attention's q and v
projections, trained for 60 steps in bf16-mixed on the same embedded data as
``examples/finetune.py`` (the Python standard library's source, as bytes). ProTrain keeps the
frozen base in its compute dtype only (2 bytes a parameter) and the adapters with their fp32
master weights, gradients and Adam states; the plan it prints splits the two. At the end the
adapter is saved with PEFT's own ``save_pretrained`` (and merged weights, with
``--merged-dir``), loadable without ProTrain.

    python examples/lora_finetune.py [--model tiny-llama | /path/to/hf/model] [--data file.txt]
                                     [--rank 8] [--targets q_proj,v_proj] [--max-steps 60]
                                     [--memory-budget 64MiB] [--adapter-dir lora-adapter] [--merged-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples are scripts, not a package
from finetune import TextData  # noqa: E402  (the same data as the full fine-tune)

from protrain_core.models import BUILTIN, load_config  # noqa: E402


class LoRALM(pl.LightningModule):
    """A causal LM (built-in config or local model) with PEFT LoRA adapters; only they train."""

    def __init__(self, model: str = "tiny-llama", rank: int = 8, targets: str = "q_proj,v_proj", lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if model in BUILTIN:
            config = load_config(model)
            config.use_cache = False
            base = AutoModelForCausalLM.from_config(config)
        else:
            base = AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
            base.config.use_cache = False
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets.split(","), lora_dropout=0.0)
        self.model = get_peft_model(base, lora)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--data", default=None)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--memory-budget", default=None, help='device memory for the plan, e.g. "64MiB" (default: free memory)')
    ap.add_argument("--adapter-dir", default="lora-adapter", help="where PEFT's save_pretrained writes the adapter")
    ap.add_argument("--merged-dir", default=None, help="also save the merged model (merge_and_unload) here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from lightning_protrain import ProTrainStrategy
    from protrain_core import PlanningConfig, ProTrainConfig

    pl.seed_everything(args.seed)
    data = TextData(None if args.data is None else args.data, args.model, seq_len=args.seq_len,
                    batch_size=args.batch_size)
    lit = LoRALM(args.model, rank=args.rank, targets=args.targets, lr=args.lr)
    trainable = sum(p.numel() for p in lit.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lit.parameters())
    print(f"LoRA: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f} %)")
    trainer = pl.Trainer(strategy=ProTrainStrategy(ProTrainConfig(planning=PlanningConfig(memory_budget=args.memory_budget))),
                         precision=args.precision,
                         max_steps=args.max_steps, limit_val_batches=0, log_every_n_steps=10, logger=False,
                         enable_checkpointing=False)
    start = time.perf_counter()
    trainer.fit(lit, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    lit.model.save_pretrained(args.adapter_dir)  # PEFT's adapter files: loadable with PeftModel.from_pretrained
    if args.merged_dir:
        lit.model.merge_and_unload().save_pretrained(args.merged_dir)
    print(f"final: train loss {metrics.get('train_loss', float('nan')):.4f}; {time.perf_counter() - start:.1f} s; "
          f"adapter saved to {args.adapter_dir}")
    return metrics


if __name__ == "__main__":
    main()
