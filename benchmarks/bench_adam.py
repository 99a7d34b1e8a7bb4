"""CPU Adam throughput (parameters/s): protrain_ops.adam_step on one chunk vs torch.optim.AdamW.

    python -m benchmarks.bench_adam [--numel 16777216 --tensors 16 --iters 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision


def bench(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(numel: int = 16 * 2**20, tensors: int = 16, iters: int = 20) -> list[dict]:
    """Rows of {kernel, seconds, params_per_s}: one chunk of ``numel`` fp32 parameters in
    ``tensors`` tensors, on the host's threads (``torch.get_num_threads()``)."""
    per = numel // tensors
    n = per * tensors
    flat = {k: torch.randn(n) if k in ("p", "g") else torch.zeros(n) for k in ("p", "g", "m", "v")}
    views = {k: list(t.split(per)) for k, t in flat.items()}
    steps = [torch.zeros(()) for _ in range(tensors)]
    hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    lowp = torch.empty(n, dtype=torch.bfloat16)

    rows = [("protrain_ops.adam_step (fused kernel, chunk views)",
             bench(lambda: adam_step(views["p"], views["g"], views["m"], views["v"], [], steps, hp), iters)),
            ("protrain_ops.adam_step + bf16 copy-back",
             bench(lambda: (adam_step(views["p"], views["g"], views["m"], views["v"], [], steps, hp),
                            copy_to_low_precision(lowp, flat["p"])), iters))]
    for label, kw in (("torch.optim.AdamW(fused=True)", dict(fused=True)),
                      ("torch.optim.AdamW(foreach=True)", dict(foreach=True)),
                      ("torch.optim.AdamW(default)", dict())):
        params = [torch.nn.Parameter(t.clone()) for t in views["p"]]
        for p, g in zip(params, views["g"]):
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw)
        rows.append((label, bench(opt.step, iters)))
    return [{"kernel": label, "numel": n, "seconds": t, "params_per_s": n / t} for label, t in rows]


def markdown(rows: list[dict], iters: int) -> str:
    lines = [f"machine: {platform.node()} {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}",
             f"chunk: {rows[0]['numel']:,} fp32 parameters; median of {iters} steps", "",
             "| kernel | median s/step | G params/s |", "|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['seconds']:.4f} | {r['params_per_s'] / 1e9:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="parameters in the chunk")
    ap.add_argument("--tensors", type=int, default=16, help="parameters per chunk")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    rows = measure(args.numel, args.tensors, args.iters)
    print("\n" + markdown(rows, args.iters))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
