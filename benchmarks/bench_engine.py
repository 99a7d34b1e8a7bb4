"""Step time of the ProTrain engine (all-persistent, all-streamed) vs the plain PyTorch loop.

Same model, same batches, one process, one run; the systems take steps in turn (round robin),
so that the machine's noise hits all alike. Prints a Markdown table.

    python -m benchmarks.bench_engine [--layers 4 --hidden 256 --batch 8 --seq 128 --steps 20 --device cpu]
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line, parser, setup


def round_robin(steps_fns, steps, warmup, sync):
    """One step of each system in turn (so that machine noise hits all alike); per system the
    step times after ``warmup``."""
    times = [[] for _ in steps_fns]
    for i in range(warmup + steps):
        for fn, acc in zip(steps_fns, times):
            t = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                acc.append(time.perf_counter() - t)
    return times


def main(argv=None):
    args = parser(layers=4, steps=20, warmup=3).parse_args(argv)
    device, sync, base, x = setup(args)
    n_params = sum(p.numel() for p in base.parameters())

    plain = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)

    def plain_step():
        plain(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    labels, fns, engines = ["plain PyTorch + AdamW(fused)"], [plain_step], []
    block_path, blocks = pt.find_blocks(base)
    n = pt.build_layout(base, block_path, len(blocks)).n_chunks
    for label, plan in (("ProTrain all-persistent", pt.Plan(n_persist=n, n_buffer=0)),
                        ("ProTrain all-streamed (n_buffer=2)", pt.Plan(n_persist=0, n_buffer=2))):
        model = copy.deepcopy(base)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan, precision=args.precision, device=device)
        engines.append(engine)

        def engine_step(engine=engine):
            engine.backward(engine.module(input_ids=x, labels=x).loss)
            engine.step()
            engine.zero_grad()

        labels.append(f"{label} [{n} chunks]")
        fns.append(engine_step)
    rows = list(zip(labels, round_robin(fns, args.steps, args.warmup, sync)))
    for engine in engines:
        engine.close()

    base_median = statistics.median(rows[0][1])
    print("\n" + machine_line(device))
    print(f"model: GPT-2 {args.layers} layers x {args.hidden}, {n_params:,} params; batch {args.batch}x{args.seq}; "
          f"precision {args.precision}; {args.steps} steps after {args.warmup} warm-up, round robin\n")
    print("| system | median s/step | min | max | vs plain |")
    print("|---|---|---|---|---|")
    for label, times in rows:
        med = statistics.median(times)
        print(f"| {label} | {med:.4f} | {min(times):.4f} | {max(times):.4f} | {med / base_median:.2f}x |")


if __name__ == "__main__":
    main()
