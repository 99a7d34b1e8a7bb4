"""Two processes on the CPU (gloo): ProTrain sharded over both, all-persistent and all-streamed,
against DDP with AdamW(fused=True), on LLaMA-shaped models of three sizes, in one run.

Each process trains its own batch (the same per-rank data for every system) for ``--warmup`` +
``--steps`` steps, with one thread (two processes share the machine's cores); the figure is
the median step time of rank 0 after the warm-up, and the ratio is DDP's over ProTrain's
(above 1: ProTrain is faster). The losses of the last step are printed beside, so that a run
that trained differently shows.

    python -m benchmarks.bench_ddp [--sizes 8M,31M,80M] [--steps 6] [--warmup 2] [--json out.json] [--profile 3]

``--profile N``: after the timed steps, N more steps of each system under ``torch.profiler`` on
rank 0, and the operators with the most CPU time of their own (summed over the N steps) in a
table per system: where one system's step spends what the other's does not. (The profiled steps
are not timed.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# name -> (layers, hidden, intermediate); vocabulary 1024, 8 heads
SIZES = {"8M": (4, 384, 1024), "31M": (6, 640, 1728), "80M": (8, 896, 2432)}
SYSTEMS = ("ddp", "protrain all-persistent", "protrain all-streamed")
BATCH, SEQ, VOCAB = 4, 128, 1024


def build(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


def trainer(system: str, model):
    """(step function -> loss tensor, close): one training step of ``system`` on ``model`` for a
    batch (the suite's own step functions, ``benchmarks.systems``)."""
    import protrain_core as pt
    from benchmarks.systems import engine_step, torch_step

    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return torch_step(ddp, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), contextlib.nullcontext()), None
    block_path, blocks = pt.find_blocks(model)
    n = pt.build_layout(model, block_path, len(blocks)).n_chunks
    plan = pt.Plan(n_persist=n, n_buffer=0) if system.endswith("all-persistent") else pt.Plan(n_persist=0, n_buffer=2)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan, device="cpu", report=None)
    return engine_step(engine), engine.close


PROFILED_OPS = 12  # operators listed per system with --profile


def _profiled(step, data) -> list[dict]:
    """The operators with the most self CPU time over ``step`` on each of ``data`` (every rank runs
    the steps; rank 0's table is kept)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x in data:
            dist.barrier()
            step(x).item()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:PROFILED_OPS]
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in ops]


def _rank(rank: int, world: int, port: int, sizes: list[str], warmup: int, steps: int, out: str,
          profiled: int = 0) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    try:
        for size in sizes:
            g = torch.Generator().manual_seed(100 + rank)
            data = [torch.randint(VOCAB, (BATCH, SEQ), generator=g) for _ in range(warmup + steps + profiled)]
            params = sum(p.numel() for p in build(size).parameters())
            for system in SYSTEMS:
                step, close = trainer(system, build(size))
                times, losses = [], []
                for i, x in enumerate(data[:warmup + steps]):
                    dist.barrier()
                    t = time.perf_counter()
                    losses.append(step(x).item())
                    if i >= warmup:
                        times.append(time.perf_counter() - t)
                ops = _profiled(step, data[warmup + steps:]) if profiled else []
                if close is not None:
                    close()
                rows.append({"size": size, "params": params, "system": system, "median_s": statistics.median(times),
                             "times_s": times, "last_loss": losses[-1], "profile": ops})
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
        dist.barrier()  # no rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict]) -> str:
    ddp = {r["size"]: r["median_s"] for r in rows if r["system"] == "ddp"}
    lines = [f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
             f"2 gloo processes, batch {BATCH} x {SEQ} tokens per process", "",
             "| model | system | median step | steps (s) | DDP / system | last loss (rank 0) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['system']} | {r['median_s'] * 1e3:.1f} ms | "
                     f"{', '.join(f'{t:.3f}' for t in r['times_s'])} | {ddp[r['size']] / r['median_s']:.2f}x | "
                     f"{r['last_loss']:.4f} |")
    for r in rows:
        if r.get("profile"):
            lines += ["", f"{r['size']}, {r['system']}: operators by self CPU time, rank 0, the profiled steps",
                      "", "| operator | calls | self CPU |", "|---|---|---|"]
            lines += [f"| {o['op']} | {o['calls']} | {o['self_ms']:.1f} ms |" for o in r["profile"]]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="N profiled steps per system after the timed ones")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        ap.error(f"unknown size(s) {', '.join(sorted(unknown))}; choose from {', '.join(SIZES)}")
    from torch.distributed.elastic.utils.distributed import get_free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, args=(2, get_free_port(), sizes, args.warmup, args.steps, out, args.profile),
                           nprocs=2, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
