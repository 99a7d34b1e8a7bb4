"""How far the mixed-precision recipes stray from fp32: ProTrain's bf16-mixed against Lightning's.

    python -m benchmarks.bench_precision [--steps 30 --layers 4 --hidden 256 --seq 128 --batch 8 --lr 1e-3]

The same randomly initialised LLaMA-architecture model (a config, no download), the same batches
(a few distinct ones, cycled, so the loss falls) and AdamW (fused) at the same hyper-parameters,
trained four ways on the CPU:
  fp32              plain PyTorch in fp32: the reference
  lightning-bf16    Lightning's bf16-mixed recipe: fp32 weights, forward under
                    ``torch.autocast(bfloat16)`` (what ``Trainer(precision="bf16-mixed")`` does
                    with its default strategy)
  protrain-bf16     ``protrain_core.wrap(..., precision="bf16-mixed")``: every parameter has a bf16
                    compute copy of its fp32 master, the forward runs under autocast too, the
                    gradients are bf16 and accumulated and applied in fp32 (DeepSpeed's recipe)
  protrain-fp32     ``precision="32-true"``: equal to the reference bitwise (a check of the setup)
Reported: per recipe the largest and the mean |loss - fp32 loss| over the steps, and the final
loss. The figures depend on the model and data; the command reproduces them.
"""

from __future__ import annotations

import argparse
import copy

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_attention_heads=max(1, args.hidden // 64), vocab_size=args.vocab,
                      max_position_embeddings=args.seq, use_cache=False)
    return LlamaForCausalLM(cfg)


def batches(args) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(4)]
    return [pool[i % len(pool)] for i in range(args.steps)]


def plain(model, data, autocast: bool, lr: float) -> list[float]:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for x in data:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def protrain(model, data, precision: str, lr: float) -> list[float]:
    model = copy.deepcopy(model)
    # The plan is searched (numerics do not depend on it: [Note] parity in tests/test_parity.py).
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=lr), None, precision=precision, device="cpu",
                     report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget="8GiB", profile_cache=False)))
    losses = []
    for x in data:
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    engine.close()
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    model, data = build(args), batches(args)
    runs = {
        "fp32": plain(model, data, False, args.lr),
        "lightning-bf16": plain(model, data, True, args.lr),
        "protrain-bf16": protrain(model, data, "bf16-mixed", args.lr),
        "protrain-fp32": protrain(model, data, "32-true", args.lr),
    }
    ref = runs["fp32"]
    print(machine_line(torch.device("cpu")))
    print(f"LLaMA {args.layers} x {args.hidden}, batch {args.batch} x {args.seq}, {args.steps} steps, AdamW lr {args.lr:g}\n")
    print("| recipe | max abs(loss - fp32) | mean abs(loss - fp32) | final loss |")
    print("|---|---|---|---|")
    for name, losses in runs.items():
        gaps = [abs(a - b) for a, b in zip(losses, ref)]
        print(f"| {name} | {max(gaps):.4f} | {sum(gaps) / len(gaps):.4f} | {losses[-1]:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
