"""CPU Adam throughput (parameters/s): protrain_ops.adam_step on one chunk vs torch.optim.AdamW.

    python -m benchmarks.bench_adam [--numel 16777216 --tensors 16 --iters 20]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="parameters in the chunk")
    ap.add_argument("--tensors", type=int, default=16, help="parameters per chunk")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    per = args.numel // args.tensors
    n = per * args.tensors
    flat = {k: torch.randn(n) if k in ("p", "g") else torch.zeros(n) for k in ("p", "g", "m", "v")}
    views = {k: list(t.split(per)) for k, t in flat.items()}
    steps = [torch.zeros(()) for _ in range(args.tensors)]
    hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    lowp = torch.empty(n, dtype=torch.bfloat16)

    rows = []
    rows.append(("protrain_ops.adam_step (fused kernel, chunk views)",
                 bench(lambda: adam_step(views["p"], views["g"], views["m"], views["v"], [], steps, hp), args.iters)))
    rows.append(("protrain_ops.adam_step + bf16 copy-back",
                 bench(lambda: (adam_step(views["p"], views["g"], views["m"], views["v"], [], steps, hp),
                                copy_to_low_precision(lowp, flat["p"])), args.iters)))
    for label, kw in (("torch.optim.AdamW(fused=True)", dict(fused=True)),
                      ("torch.optim.AdamW(foreach=True)", dict(foreach=True)),
                      ("torch.optim.AdamW(default)", dict())):
        params = [torch.nn.Parameter(t.clone()) for t in views["p"]]
        for p, g in zip(params, views["g"]):
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw)
        rows.append((label, bench(opt.step, args.iters)))

    print(f"\nmachine: {platform.node()} {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"chunk: {n:,} fp32 parameters in {args.tensors} tensors; median of {args.iters} steps\n")
    print("| kernel | median s/step | G params/s |")
    print("|---|---|---|")
    for label, t in rows:
        print(f"| {label} | {t:.4f} | {n / t / 1e9:.3f} |")


if __name__ == "__main__":
    main()
