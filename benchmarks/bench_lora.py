"""Model-state bytes of a LoRA fine-tune against the full fine-tune of the same model.

    python -m benchmarks.bench_lora [--hidden 1024 --layers 8 --rank 16 --precision bf16-mixed]

A LLaMA-architecture model built from a config (no download), wrapped twice with every chunk
streamed (``Plan(n_persist=0, n_buffer=1)``): once with PEFT LoRA adapters on the attention
projections (the base frozen), once fully trainable. Reported per run: trainable and frozen
parameters, the model states the engine holds (its host pool, and the persistent chunks on the
device: none in this plan), the chunk buffer it streams through (a transient copy), and the
ideal ``2 B x frozen + 16 B x trainable`` the model states are measured against (bf16-mixed: a
trainable parameter costs 18 B, its bf16 compute copy included). The bytes are deterministic (the storage formula, allocated for real); the wrap time is
not.
"""

from __future__ import annotations

import argparse
import time

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line


def build(args, lora: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_attention_heads=args.hidden // 64, vocab_size=32000, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16 if args.precision.startswith("bf16") else torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                 lora_dropout=0.0))
    return model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--precision", default="bf16-mixed")
    args = ap.parse_args(argv)
    print(machine_line(torch.device("cpu")))
    print(f"LLaMA {args.layers} x {args.hidden}, LoRA rank {args.rank} on q/k/v/o, {args.precision}, "
          "Plan(n_persist=0, n_buffer=1)\n")
    print("| run | trainable | frozen | model states: host pool + persistent chunks | chunk buffer (device) | "
          "ideal 2 B x frozen + 16 B x trainable | states / ideal | wrap |")
    print("|---|---|---|---|---|---|---|---|")
    mib = 2**20
    for name, lora in (("LoRA", True), ("full fine-tune", False)):
        model = build(args, lora)
        params = [p for p in model.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in params)
        frozen = sum(p.numel() for p in model.parameters()) - trainable
        start = time.perf_counter()
        engine = pt.wrap(model, torch.optim.AdamW(params), pt.Plan(n_persist=0, n_buffer=1), precision=args.precision,
                         device="cpu")
        seconds = time.perf_counter() - start
        persistent = engine.memory.device_bytes()  # (between steps: the persistent chunks')
        states = engine.memory.host_bytes() + persistent
        buffers = engine.memory.device_bound() - persistent
        ideal = 2 * frozen + 16 * trainable
        print(f"| {name} | {trainable:,} | {frozen:,} | {states / mib:,.1f} MiB | {buffers / mib:,.1f} MiB | "
              f"{ideal / mib:,.1f} MiB | {states / ideal:.3f} | {seconds:.1f} s |")
        engine.close()
        del engine, model, params


if __name__ == "__main__":
    main()
