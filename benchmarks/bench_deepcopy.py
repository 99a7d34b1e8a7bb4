"""``copy.deepcopy`` of a model between training steps (what an EMA or Lightning's weight averaging
does): seconds and the bytes of the tensors the copy holds, for the wrapped model against the same
model trained by plain PyTorch.

    python -m benchmarks.bench_deepcopy [--layers 8 --hidden 512 --precision bf16-mixed]

The bytes are those of the distinct storages among the copied tensors (the deep copy's memo):
a copy that takes the engine's chunks along holds their masters, moments and host buffers too.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import protrain_core as pt


def build(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def copied(module) -> tuple[float, int]:
    """(seconds, bytes of the copy's distinct tensor storages) of one deep copy."""
    memo: dict = {}
    start = time.perf_counter()
    copy.deepcopy(module, memo)
    seconds = time.perf_counter() - start
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for v in memo.values() if isinstance(v, torch.Tensor)}
    return seconds, sum(storages.values())


def measure(module, reps: int) -> tuple[float, int]:
    runs = [copied(module) for _ in range(reps)]
    return statistics.median(s for s, _ in runs), runs[0][1]


def main(argv=None) -> list[tuple[str, float, int]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--precision", default="bf16-mixed", choices=["32-true", "bf16-mixed"])  # (PyTorch's recipe for each)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    x = torch.randint(0, 32000, (2, 64))
    rows = []
    model = build(args.layers, args.hidden)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        with torch.autocast("cpu", torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    rows.append(("pytorch", *measure(model, args.reps)))
    for name, persistent in (("protrain, every chunk streamed", False), ("protrain, every chunk persistent", True)):
        model = build(args.layers, args.hidden)
        block_path, blocks = pt.find_blocks(model)
        chunks = pt.build_layout(model, block_path, len(blocks)).n_chunks
        plan = pt.Plan(n_persist=chunks, n_buffer=0) if persistent else pt.Plan(n_persist=0, n_buffer=2)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan, device="cpu",
                         precision=args.precision)
        for _ in range(2):
            engine.backward(engine.module(input_ids=x, labels=x).loss)
            engine.step()
            engine.zero_grad()
        rows.append((name, *measure(engine.module, args.reps)))
        engine.close()
    print(f"LLaMA {args.layers} x {args.hidden} ({n / 1e6:.1f}M parameters), {args.precision}, after 2 steps; "
          f"median of {args.reps} copies\n")
    print("| model | deepcopy s | tensor bytes in the copy |")
    print("|---|---|---|")
    for name, seconds, nbytes in rows:
        print(f"| {name} | {seconds:.3f} | {nbytes / 2**20:.1f} MiB |")
    return rows


if __name__ == "__main__":
    main()
