"""Two processes on the CPU (gloo): ProTrain sharded over both, all-persistent and all-streamed,
against DDP with AdamW(fused=True), on LLaMA-shaped models of three sizes, in one run.

Each process trains its own batch (the same per-rank data for every system) for ``--warmup`` +
``--steps`` steps, with one thread (two processes share the machine's cores); the figure is
the median step time of rank 0 after the warm-up, and the ratio is DDP's over ProTrain's
(above 1: ProTrain is faster). The losses of the last step are printed beside, so that a run
that trained differently shows.

    python -m benchmarks.bench_ddp [--sizes 8M,31M,80M] [--steps 6] [--warmup 2] [--rounds 1] [--json out.json]
                                   [--profile 3]

Each step is also timed by phase (forward, backward, update: the optimizer step and zero_grad),
and the medians of each are tabled after the steps, with the minor page faults of rank 0's
process in each phase (``getrusage``; memory the kernel maps and zeroes on first touch: a
buffer of 32 MB or more is mapped anew at each allocation by torch's CPU allocator).
``--rounds R``: every system is built at once and runs ``--steps`` steps in each of R rounds,
the systems in turn, each on the same batches, instead of all its steps in one stretch; on a
machine whose speed drifts by more than the differences measured (a shared VM), the drift then
falls on every system alike.

``--profile N``: after the timed steps, N more steps of each system under ``torch.profiler`` on
rank 0, and the operators with the most CPU time of their own (summed over the N steps) in a
table per system: where one system's step spends what the other's does not. (The profiled steps
are not timed.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
    """(step, close): ``step(x)`` trains ``system`` on ``model`` for one step on batch ``x`` and
    returns the loss and the seconds of its forward, backward and update (optimizer step and
    zero_grad): the calls of the suite's ``torch_step`` and ``engine_step``
    (``benchmarks.systems``), split where the phases meet."""
    import protrain_core as pt

    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def forward(x):
            return ddp(input_ids=x, labels=x).loss

        def backward(loss):
            loss.backward()

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)

        close = None
    else:
        block_path, blocks = pt.find_blocks(model)
        n = pt.build_layout(model, block_path, len(blocks)).n_chunks
        plan = pt.Plan(n_persist=n, n_buffer=0) if system.endswith("all-persistent") else pt.Plan(n_persist=0, n_buffer=2)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan, device="cpu", report=None)

        def forward(x):
            return engine.module(input_ids=x, labels=x).loss

        def update():
            engine.step()
            engine.zero_grad()

        backward, close = engine.backward, engine.close

    def step(x):
        f0, t0 = _faults(), time.perf_counter()
        loss = forward(x)
        f1, t1 = _faults(), time.perf_counter()
        backward(loss)
        f2, t2 = _faults(), time.perf_counter()
        update()
        t3, f3 = time.perf_counter(), _faults()
        return loss.detach(), (t1 - t0, t2 - t1, t3 - t2), (f1 - f0, f2 - f1, f3 - f2)

    return step, close


PROFILED_OPS = 12  # operators listed per system with --profile


def _faults() -> int:
    """Minor page faults of this process so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _profiled(step, data) -> list[dict]:
    """The operators with the most self CPU time over ``step`` on each of ``data`` (every rank runs
    the steps; rank 0's table is kept)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x in data:
            dist.barrier()
            step(x)[0].item()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:PROFILED_OPS]
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in ops]


def _rank(rank: int, world: int, port: int, sizes: list[str], warmup: int, steps: int, out: str,
          profiled: int = 0, rounds: int = 1) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    try:
        for size in sizes:
            g = torch.Generator().manual_seed(100 + rank)
            data = [torch.randint(VOCAB, (BATCH, SEQ), generator=g) for _ in range(warmup + rounds * steps + profiled)]
            params = sum(p.numel() for p in build(size).parameters())
            # One round: each system alone, one after the other. Several: all of them built, and
            # in each round every system's next ``steps`` steps in turn (the same batches).
            for group in ([[s] for s in SYSTEMS] if rounds == 1 else [list(SYSTEMS)]):
                trainers = {s: trainer(s, build(size)) for s in group}
                timed = {s: ([], [], [], []) for s in group}  # steps, phases, losses, page faults
                for s in group:
                    for x in data[:warmup]:
                        dist.barrier()
                        timed[s][2].append(trainers[s][0](x)[0].item())
                for r in range(rounds):
                    for s in group:
                        for x in data[warmup + r * steps:warmup + (r + 1) * steps]:
                            dist.barrier()
                            t = time.perf_counter()
                            loss, phases, faults = trainers[s][0](x)
                            timed[s][2].append(loss.item())
                            timed[s][0].append(time.perf_counter() - t)
                            timed[s][1].append(phases)
                            timed[s][3].append(faults)
                for s in group:
                    step, close = trainers[s]
                    ops = _profiled(step, data[warmup + rounds * steps:]) if profiled else []
                    if close is not None:
                        close()
                    times, phases, losses, faults = timed[s]
                    rows.append({"size": size, "params": params, "system": s, "median_s": statistics.median(times),
                                 "times_s": times, "phases_s": [statistics.median(p) for p in zip(*phases)],
                                 "faults": [statistics.median(f) for f in zip(*faults)],
                                 "rounds": rounds, "last_loss": losses[-1], "profile": ops})
        rows.sort(key=lambda r: (sizes.index(r["size"]), SYSTEMS.index(r["system"])))
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
    if any(r.get("phases_s") for r in rows):
        rounds = rows[0].get("rounds", 1)
        lines += ["", "Medians of each phase, rank 0" + (f" ({rounds} rounds, the systems in turn)" if rounds > 1 else ""),
                  "", "| model | system | forward | backward | update | page faults (forward / backward / update) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['size']} | {r['system']} | " + " | ".join(f"{t * 1e3:.1f} ms" for t in r["phases_s"]) + " | "
                  + (" / ".join(f"{f:.0f}" for f in r["faults"]) if r.get("faults") else "") + " |"
                  for r in rows if r.get("phases_s")]
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
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="R rounds of --steps steps per system, the systems in turn (a drifting machine "
                         "slows all of them alike); 1: each system's steps at once")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        ap.error(f"unknown size(s) {', '.join(sorted(unknown))}; choose from {', '.join(SIZES)}")
    from torch.distributed.elastic.utils.distributed import get_free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, args=(2, get_free_port(), sizes, args.warmup, args.steps, out, args.profile, args.rounds),
                           nprocs=2, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
