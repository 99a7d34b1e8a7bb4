"""Set-up shared by the benchmarks that train a GPT-2 built from a config: arguments, model,
batch, device synchronisation and the machine line of the report."""

from __future__ import annotations

import argparse
import platform

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from protrain_core.runtime.device import resolve_device


def parser(*, layers: int, steps: int, warmup: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--device", default=None)
    return ap


def setup(args, **config):
    """(device, sync, model on the CPU, batch on the device); ``config``: extra GPT2Config fields."""
    device = resolve_device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    config = {"vocab_size": 256, **config}
    cfg = GPT2Config(n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                     n_head=max(1, args.hidden // 64), bos_token_id=0, eos_token_id=0, **config)
    base = GPT2LMHeadModel(cfg)
    x = torch.randint(0, config["vocab_size"], (args.batch, args.seq), device=device)
    return device, sync, base, x


def machine_line(device) -> str:
    return (f"machine: {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, device {device}")
