"""gloo's ways to reduce a chunk's gradients to each rank's piece, and to gather the pieces
again, on CPU tensors: 2 processes (one thread each), every way on the same buffers, in turn.

    python -m benchmarks.bench_collectives [--mb 8.6,32,168] [--reps 5] [--rounds 2] [--world 2] [--json out.json]

Reductions (each rank ends with piece ``rank`` of the sum; the buffer holds the gradients
already scaled by 1/W, as the runtime's do):
  all-reduce        ``all_reduce`` of the whole buffer, then the piece copied out
  reduce-scatter    gloo's ``reduce_scatter_tensor``
  all-to-all        ``all_to_all_single`` into a buffer of W pieces, then summed in rank order
  messages          ``Sharding.reduce_scatter_mean`` (what ProTrain runs: each piece sent to its
                    rank, the received ones summed in rank order)
Gathers (every rank ends with the whole buffer):
  all-gather        gloo's ``all_gather_into_tensor``
  broadcasts        ``Sharding.gather_`` (what ProTrain runs: one broadcast per rank's piece)

The figure is rank 0's median time of ``--reps`` calls per round (after one warm-up call), each
call started together on every rank (a barrier); the rounds run every way in turn, so that a
machine whose speed drifts slows every way alike. "same" says whether the way's result equals
the first way's bit for bit (with W = 2 every reduction adds two numbers: all must agree).
"""

from __future__ import annotations

import argparse
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


def _reductions(sharding, full: torch.Tensor):
    world, rank = sharding.world, sharding.rank
    n = full.numel() // world

    def all_reduce():
        whole = full.clone()
        dist.all_reduce(whole)
        return whole[rank * n:(rank + 1) * n].clone()

    def reduce_scatter():
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, full.clone())
        return out

    def all_to_all():
        pieces = torch.empty(world * n)
        dist.all_to_all_single(pieces, full)
        out = pieces[:n].clone()
        for r in range(1, world):
            out.add_(pieces[r * n:(r + 1) * n])
        return out

    def messages():
        out = torch.empty(n)
        sharding.reduce_scatter_mean(out, full, scaled=True)
        return out

    return {"all-reduce": all_reduce, "reduce-scatter": reduce_scatter, "all-to-all": all_to_all,
            "messages": messages}


def _gathers(sharding, full: torch.Tensor):
    world, rank = sharding.world, sharding.rank
    n = full.numel() // world

    def all_gather():
        out = torch.zeros_like(full)
        out[rank * n:(rank + 1) * n] = full[rank * n:(rank + 1) * n]
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
        return out

    def broadcasts():
        out = torch.zeros_like(full)
        out[rank * n:(rank + 1) * n] = full[rank * n:(rank + 1) * n]
        sharding.gather_(out)
        return out

    return {"all-gather": all_gather, "broadcasts": broadcasts}


def _run(rank: int, world: int, port: int, sizes: list[float], reps: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from protrain_core.runtime.sharding import Sharding

    sharding = Sharding.resolve()
    rows = []
    for mb in sizes:
        numel = max(world, int(mb * 1e6 / 4) // world * world)
        full = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) / world
        for kind, ways in (("reduction", _reductions(sharding, full)), ("gather", _gathers(sharding, full))):
            times = {name: [] for name in ways}
            results = {}
            for _ in range(rounds):
                for name, fn in ways.items():
                    per_call = []
                    for _ in range(reps + 1):
                        dist.barrier()
                        t0 = time.perf_counter()
                        results[name] = fn()
                        per_call.append(time.perf_counter() - t0)
                    times[name].append(statistics.median(per_call[1:]))
            first = next(iter(results.values()))
            for name in ways:
                rows.append({"mb": numel * 4 / 1e6, "kind": kind, "way": name,
                             "median_s": statistics.median(times[name]), "rounds_s": times[name],
                             "same": bool(torch.equal(results[name], first))})
    if rank == 0:
        torch.save(rows, os.path.join(out, "rows.pt"))
    dist.barrier()
    dist.destroy_process_group()


def measure(sizes: list[float], *, reps: int = 5, rounds: int = 2, world: int = 2) -> list[dict]:
    from torch.distributed.elastic.utils.distributed import get_free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_run, args=(world, get_free_port(), sizes, reps, rounds, out), nprocs=world, join=True,
                           start_method="spawn")
        return torch.load(os.path.join(out, "rows.pt"), weights_only=False)


def markdown(rows: list[dict]) -> str:
    lines = ["| size | kind | way | median | per round | against the first way | same |", "|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        key = (r["mb"], r["kind"])
        base.setdefault(key, r["median_s"])
        rounds = ", ".join(f"{t * 1e3:.2f}" for t in r["rounds_s"])
        lines.append(f"| {r['mb']:.1f} MB | {r['kind']} | {r['way']} | {r['median_s'] * 1e3:.2f} ms | {rounds} | "
                     f"{r['median_s'] / base[key]:.2f}x | {'yes' if r['same'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="8.6,32,168", help="buffer sizes in MB (fp32), comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = measure([float(x) for x in args.mb.split(",")], reps=args.reps, rounds=args.rounds, world=args.world)
    print(f"{platform.node()} torch {torch.__version__}, {args.world} gloo processes, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
