"""Step time of the ProTrain engine (all-persistent, all-streamed) vs the plain PyTorch loop.

Same model, same batches, one process, one run. Prints a Markdown table.

    python -m benchmarks.bench_engine [--layers 4 --hidden 256 --batch 8 --seq 128 --steps 20 --device cpu]
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line, parser, setup


def timed(step_fn, steps, warmup, sync):
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        step_fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def main(argv=None):
    args = parser(layers=4, steps=20, warmup=3).parse_args(argv)
    device, sync, base, x = setup(args)
    n_params = sum(p.numel() for p in base.parameters())

    rows = []
    plain = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)

    def plain_step():
        plain(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    rows.append(("plain PyTorch + AdamW(fused)", timed(plain_step, args.steps, args.warmup, sync)))
    del plain, opt

    block_path, blocks = pt.find_blocks(base)
    n = pt.build_layout(base, block_path, len(blocks)).n_chunks
    for label, plan in (("ProTrain all-persistent", pt.Plan(n_persist=n, n_buffer=0)),
                        ("ProTrain all-streamed (n_buffer=2)", pt.Plan(n_persist=0, n_buffer=2))):
        model = copy.deepcopy(base)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan, precision=args.precision, device=device)

        def engine_step():
            engine.backward(engine.module(input_ids=x, labels=x).loss)
            engine.step()
            engine.zero_grad()

        rows.append((f"{label} [{n} chunks]", timed(engine_step, args.steps, args.warmup, sync)))
        engine.close()

    base_median = statistics.median(rows[0][1])
    print("\n" + machine_line(device))
    print(f"model: GPT-2 {args.layers} layers x {args.hidden}, {n_params:,} params; batch {args.batch}x{args.seq}; "
          f"precision {args.precision}; {args.steps} steps after {args.warmup} warm-up\n")
    print("| system | median s/step | min | max | vs plain |")
    print("|---|---|---|---|---|")
    for label, times in rows:
        med = statistics.median(times)
        print(f"| {label} | {med:.4f} | {min(times):.4f} | {max(times):.4f} | {med / base_median:.2f}x |")


if __name__ == "__main__":
    main()
