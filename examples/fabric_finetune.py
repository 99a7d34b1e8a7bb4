"""Fine-tune with Lightning Fabric and ``Fabric(strategy="protrain")``: your own loop.

Same model and data as examples/finetune.py (built-in "tiny-gpt2" on the standard library's
source by default). ProTrain builds its engine at ``fabric.setup`` on a safe plan, profiles the
first training steps (they train as usual) and then switches to the plan it picked (printed,
and later its predicted against the measured step time). Gradient accumulation uses ``fabric.no_backward_sync``; the
checkpoint at the end is written atomically by ``fabric.save`` and holds the model's own state
dict and a ``torch.optim.AdamW`` state dict.

    python examples/fabric_finetune.py [--model tiny-gpt2] [--data file.txt] [--steps 40] [--accumulate 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from lightning.fabric import Fabric

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune import CausalLM, TextData  # noqa: E402


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--data", default=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--save", default=None, help="write a checkpoint here at the end")
    args = ap.parse_args(argv)

    fabric = Fabric(strategy="protrain", precision=args.precision, devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    data = TextData(args.data, args.model, batch_size=args.batch_size)
    data.setup("fit")
    lit = CausalLM(args.model)
    optimizer = lit.configure_optimizers()["optimizer"]
    model, optimizer = fabric.setup(lit.model, optimizer)
    train = fabric.setup_dataloaders(data.train_dataloader())

    start, it = time.perf_counter(), iter(train)
    for step in range(1, args.steps + 1):
        for micro in range(args.accumulate):
            x = next(it)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model(input_ids=x, labels=x).loss / args.accumulate
                fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 10 == 0:
            fabric.print(f"step {step:4d}  loss {loss.item() * args.accumulate:.4f}  "
                         f"{(time.perf_counter() - start) / step:.3f} s/step")
    model.eval()
    with torch.no_grad():
        val = [model(input_ids=x.to(fabric.device), labels=x.to(fabric.device)).loss.item()
               for _, x in zip(range(4), data.val_dataloader())]
    val_loss = sum(val) / len(val)
    fabric.print(f"validation loss {val_loss:.4f} (perplexity {math.exp(val_loss):.2f}); "
                 f"{time.perf_counter() - start:.1f} s")
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})
    return val_loss


if __name__ == "__main__":
    main()
