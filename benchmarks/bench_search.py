"""Search time of the plan search on a 48-block model with 50 chunks (the paper reports 0.06 s).

    python -m benchmarks.bench_search [--blocks 48 --repeat 5]

The profile is synthetic but shaped like a real one (a 48-layer model at 1 chunk per block plus
embedding and head chunks; per-block times and bytes varied by +-10 % so that no two blocks are
equal; H100-like bandwidths and Adam rates). The search runs for budgets from "barely fits" to
"everything fits" and reports the median time per budget and the plans it evaluated, next to the
number of plans a brute force would evaluate.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

import protrain_core as pt
from protrain_core.chunk_format import ChunkFormat
from protrain_core.planner.profiles import Hardware, Profile, Segment


def synthetic_profile(n_blocks: int, seed: int = 0) -> Profile:
    rng = random.Random(seed)
    S = 100_000_000  # elements per chunk, bf16
    n_chunks = n_blocks + 2
    hidden = 8 * 2048 * 8192 * 2  # batch 8 x 2048 tokens x 8192 hidden, bf16

    def vary(x):
        return x * rng.uniform(0.9, 1.1)

    segs = [Segment(name="pre", kind="pre", chunks=(0,), fwd_s=0.002, bwd_s=0.004, recompute_s=0.0,
                    out_bytes=hidden, saved_bytes=0, fwd_peak_bytes=2 * hidden, bwd_peak_bytes=2 * hidden,
                    recompute_peak_bytes=0)]
    for j in range(n_blocks):
        saved = int(vary(16 * hidden))
        segs.append(Segment(name=f"block.{j}", kind="block", chunks=(j + 1,), fwd_s=vary(0.1), bwd_s=vary(0.2),
                            recompute_s=vary(0.07), out_bytes=hidden, saved_bytes=saved,
                            fwd_peak_bytes=int(vary(4 * hidden)), bwd_peak_bytes=saved + int(vary(4 * hidden)),
                            recompute_peak_bytes=saved + int(vary(2 * hidden))))
    segs.append(Segment(name="post", kind="post", chunks=(n_chunks - 1,), fwd_s=0.05, bwd_s=0.1, recompute_s=0.0,
                        out_bytes=8 * hidden, saved_bytes=0, fwd_peak_bytes=8 * hidden, bwd_peak_bytes=16 * hidden,
                        recompute_peak_bytes=0))
    hw = Hardware(device="synthetic H100-like", async_copies=True, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9,
                  cpu_adam_params_per_s=2e9, device_adam_params_per_s=60e9, device_memory_bytes=80 * 2**30)
    chunk = ChunkFormat(numel=S, compute_dtype=torch.bfloat16, master_dtype=torch.float32)
    return Profile(key="synthetic", description=f"synthetic {n_blocks}-block model", precision="bf16-mixed",
                   chunks=(chunk,) * n_chunks, resident_sets=tuple((c,) for c in range(n_chunks)),
                   segments=tuple(segs), base_bytes=2**20, fragmentation=1.05, hardware=hw)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    prof = synthetic_profile(args.blocks)
    cm = pt.CostModel(prof)
    N, L = prof.n_chunks, prof.n_blocks
    smallest = min(cm.memory(pt.Plan(n_persist=0, n_buffer=1, n_swap=s, n_checkpoint=L - s)).peak_bytes for s in range(L + 1))
    everything = cm.memory(pt.Plan(n_persist=N, n_buffer=0)).peak_bytes
    brute = sum((N + 1) * (N + 2) // 2 for _ in range((L + 1) * (L + 2) // 2))
    print(f"\nmachine: {platform.node()} {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"profile: {L} blocks, {N} chunks; brute force would evaluate ~{brute:,} plans; median of {args.repeat} runs\n")
    print("| budget | plan | predicted step s | plans evaluated | search s |")
    print("|---|---|---|---|---|")
    for frac in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        budget = int(smallest + frac * (everything - smallest))
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            choice = pt.search(prof, budget)
            times.append(time.perf_counter() - t)
        p = choice.plan
        print(f"| {budget / 2**30:.1f} GiB | {p.n_persist}/{p.n_buffer}/{p.n_swap}/{p.n_checkpoint} | "
              f"{choice.runtime.total_s:.3f} | {choice.evaluated:,} | {statistics.median(times):.4f} |")


if __name__ == "__main__":
    main()
