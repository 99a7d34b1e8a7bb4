"""Train a small GPT-2-style model with the ProTrain engine (core API, no Lightning).

Default, with no arguments: a 4-layer GPT-2 (~3.3 M parameters) built from a config, trained for
60 steps on the Python standard library's own source files, tokenised as raw bytes (no download,
no tokenizer files). Half of the chunks stream through one device buffer and are updated by the
CPU Adam worker during backward; the first block swaps its activations to host memory and the
second recomputes them in backward.

    python examples/train_gpt2.py [--steps 60] [--precision 32-true] [--n-persist 2 --n-buffer 1]
                                  [--n-swap 1 --n-checkpoint 1]
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import protrain_core as pt


def stdlib_text(max_bytes: int) -> bytes:
    """Concatenated source of the standard library (found on every machine with Python)."""
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                out.append(data)
                total += len(data)
                if total >= max_bytes:
                    return b"".join(out)[:max_bytes]
    return b"".join(out)


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    ap.add_argument("--n-persist", type=int, default=2)
    ap.add_argument("--n-buffer", type=int, default=1)
    ap.add_argument("--n-swap", type=int, default=1)
    ap.add_argument("--n-checkpoint", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(stdlib_text(4_000_000)), dtype=torch.uint8).long()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    print(f"data: {len(data):,} bytes of Python standard-library source (byte-level tokens)")

    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    model = GPT2LMHeadModel(config)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    plan = pt.Plan(n_persist=args.n_persist, n_buffer=args.n_buffer, n_swap=args.n_swap, n_checkpoint=args.n_checkpoint)
    engine = pt.wrap(model, optimizer, plan,
                     precision=args.precision, device=args.device)
    print(engine.summary())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))

    g = torch.Generator().manual_seed(args.seed)

    def batch(source):
        idx = torch.randint(0, len(source) - args.seq_len, (args.batch_size,), generator=g)
        return torch.stack([source[i : i + args.seq_len] for i in idx]).to(engine.device)

    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(1, args.steps + 1):
        x = batch(train)
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        schedule.step()
        loss_value = loss.item()
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss_value:.4f}  {(time.perf_counter() - start) / step:.3f} s/step", flush=True)

    engine.module.eval()
    with torch.no_grad():
        val_loss = sum(engine.module(input_ids=(x := batch(val)), labels=x).loss.item() for _ in range(4)) / 4
    print(f"validation loss {val_loss:.4f} (perplexity {math.exp(val_loss):.2f}); "
          f"{time.perf_counter() - start:.1f} s total; engine stats {engine.stats}")
    return val_loss


if __name__ == "__main__":
    main()
