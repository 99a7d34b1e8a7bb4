"""Fine-tune a Hugging Face causal LM with ``Trainer(strategy="protrain")``.

Default, with no arguments: the built-in "tiny-gpt2" config (4 layers, byte-level vocabulary,
~0.9 M parameters; nothing is downloaded) trained for 60 steps on the Python standard library's
own source (text found on every machine), tokenised as raw bytes, with validation perplexity
(torchmetrics) every 30 steps, the gradient norm clipped at 1.0 as most fine-tuning recipes do
(logged as ``grad_norm``). ProTrain profiles the first training steps (they train as usual),
prints the plan it switched to and, a few steps later, its predicted against the measured step
time.

    python examples/finetune.py [--model tiny-gpt2 | tiny-llama | /path/to/hf/model]
                                [--data file.txt | file.jsonl] [--max-steps 60] [--precision 32-true]
                                [--gradient-clip-val 1.0] [--memory-budget 2GiB] [--ckpt-dir checkpoints]

A local model directory brings its own tokenizer (``AutoTokenizer``, local files only); the
built-in configs use bytes. JSONL files are read line by line, taking each record's "text".
The same classes serve LightningCLI: ``python -m lightning_protrain.cli fit --config examples/config.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

from protrain_core.models import BUILTIN, load_config


def stdlib_text(max_bytes: int) -> str:
    """Concatenated source of the standard library (found on every machine with Python)."""
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                    data = f.read()
                out.append(data)
                total += len(data)
                if total >= max_bytes:
                    return "".join(out)[:max_bytes]
    return "".join(out)


def read_text(path: str | None, max_bytes: int) -> str:
    if path is None:
        return stdlib_text(max_bytes)
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"--data {path!r} is not a file; give a .txt or .jsonl file (or leave it out).")
    if p.suffix == ".jsonl":
        lines = (json.loads(line).get("text", "") for line in p.open(encoding="utf-8") if line.strip())
        return "\n\n".join(lines)[:max_bytes]
    return p.read_text(encoding="utf-8", errors="replace")[:max_bytes]


class Windows(Dataset):
    """``n`` windows of ``seq_len`` tokens at fixed random offsets (the same every epoch)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, n: int, seed: int) -> None:
        if len(tokens) <= seq_len:
            raise SystemExit(f"The text has {len(tokens)} tokens, fewer than one window of {seq_len + 1}.")
        g = torch.Generator().manual_seed(seed)
        self.tokens, self.seq_len = tokens, seq_len
        self.offsets = torch.randint(0, len(tokens) - seq_len, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        o = int(self.offsets[i])
        return self.tokens[o : o + self.seq_len]


class TextData(pl.LightningDataModule):
    """Text from a local .txt/.jsonl file (default: the standard library's source), tokenised by
    the model's local tokenizer or as bytes; 95 % for training, 5 % for validation."""

    def __init__(self, data: str | None = None, model: str = "tiny-gpt2", seq_len: int = 128, batch_size: int = 8,
                 train_windows: int = 4096, val_windows: int = 64, max_bytes: int = 4_000_000, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        text = read_text(h.data, h.max_bytes)
        if h.model in BUILTIN:
            tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        else:
            from transformers import AutoTokenizer

            tokens = torch.tensor(AutoTokenizer.from_pretrained(h.model, local_files_only=True)(text)["input_ids"])
        split = int(0.95 * len(tokens))
        self.train = Windows(tokens[:split], h.seq_len, h.train_windows, h.seed)
        self.val = Windows(tokens[split:], h.seq_len, h.val_windows, h.seed + 1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.hparams.batch_size)


class CausalLM(pl.LightningModule):
    """A Hugging Face causal LM: a built-in config (randomly initialised) or a local model path."""

    def __init__(self, model: str = "tiny-gpt2", lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModelForCausalLM

        if model in BUILTIN:
            config = load_config(model)
            config.use_cache = False
            self.model = AutoModelForCausalLM.from_config(config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
            self.model.config.use_cache = False
        self.val_perplexity = Perplexity()

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch).logits
        # Next-token prediction: logits at t predict the token at t + 1.
        self.val_perplexity.update(logits[:, :-1].float(), batch[:, 1:])
        self.log("val_perplexity", self.val_perplexity, prog_bar=True)

    def configure_optimizers(self):
        h = self.hparams
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=h.lr)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, h.warmup_steps)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def parser() -> argparse.ArgumentParser:
    """The command line (examples/config.yaml holds the same defaults for LightningCLI)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--data", default=None)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--gradient-clip-val", type=float, default=1.0, help="clip the gradient norm (0: off)")
    ap.add_argument("--memory-budget", default=None, help='device memory for the plan, e.g. "2GiB" (default: free memory)')
    ap.add_argument("--ckpt-dir", default=None, help="save checkpoints here (ModelCheckpoint)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> dict:
    args = parser().parse_args(argv)

    from lightning_protrain import ProTrainStrategy
    from protrain_core import PlanningConfig, ProTrainConfig

    pl.seed_everything(args.seed)
    data = TextData(args.data, args.model, seq_len=args.seq_len, batch_size=args.batch_size)
    model = CausalLM(args.model, lr=args.lr)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)] if args.ckpt_dir else []
    trainer = pl.Trainer(
        strategy=ProTrainStrategy(ProTrainConfig(planning=PlanningConfig(memory_budget=args.memory_budget))),
        precision=args.precision,
        gradient_clip_val=args.gradient_clip_val or None, max_steps=args.max_steps,
        val_check_interval=min(30, args.max_steps), check_val_every_n_epoch=None, limit_val_batches=4,
        log_every_n_steps=10, logger=False, callbacks=callbacks, enable_checkpointing=bool(callbacks),
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print(f"final: train loss {metrics.get('train_loss', float('nan')):.4f}, validation perplexity "
          f"{metrics.get('val_perplexity', float('nan')):.2f}; {time.perf_counter() - start:.1f} s")
    return metrics


if __name__ == "__main__":
    main()
