"""What planning on the first training steps costs: the profiled steps against the same steps
under the searched plan.

    python -m benchmarks.bench_profiling [--layers 8 --hidden 256 --batch 8 --seq 128 --steps 10 \\
        --precision 32-true --device cpu --budget 64MiB]

A GPT-2 built from a config trains on the same batch in three engines at once, one step of each
in turn (so that the machine's noise hits all alike), from the first step on:
  cold      ``wrap(plan=None, memory_budget=...)``: the safe plan while it profiles its first
            steps (6 on a CPU device, 3 on CUDA), then the plan it searched
  cached    the same with the profile already in the cache: profiling ends after one step
  searched  ``wrap(plan=...)`` with the plan a preliminary run searched, from the first step
The profiling overhead is the time of the profiled steps (hardware probes, search and the switch
included) minus the time of the same steps in the searched run, also in units of the searched
run's median step time. Prints a Markdown table; the raw step times follow it.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line, parser, setup
from protrain_core.utils import format_seconds


def step_fn(engine, x):
    def step():
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()

    return step


def main(argv=None) -> None:
    ap = parser(layers=8, steps=10, warmup=0)
    ap.add_argument("--budget", default=None, help="memory budget (default: free device memory minus a margin)")
    args = ap.parse_args(argv)
    device, sync, base, x = setup(args)
    budget = args.budget or pt.default_memory_budget(device)
    cache = tempfile.mkdtemp(prefix="protrain-bench-")

    def wrap(plan=None, profile_cache=True, report=None):
        model = copy.deepcopy(base)
        # The preliminary run fills the cache directory; "cached" reads it.
        planning = pt.PlanningConfig(plan=plan) if plan is not None else \
            pt.PlanningConfig(memory_budget=budget, profile_cache=profile_cache, cache_dir=cache)
        return pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=pt.ProTrainConfig(planning=planning),
                       precision=args.precision, device=device, report=report or (lambda *a, **k: None))

    preliminary = wrap()
    profiled = 0
    while preliminary.choice is None:
        step_fn(preliminary, x)()
        profiled += 1
    searched_plan = preliminary.plan
    preliminary.close()

    reports = {"cold": [], "cached": []}
    engines = {
        "cold": wrap(profile_cache=False, report=lambda text, **m: reports["cold"].append(m)),
        "cached": wrap(report=lambda text, **m: reports["cached"].append(m)),
        "searched": wrap(plan=searched_plan),
    }
    times = {name: [] for name in engines}
    steps = {name: step_fn(engine, x) for name, engine in engines.items()}
    for _ in range(profiled + args.steps):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - t)

    base_step = statistics.median(times["searched"][profiled:])
    print(machine_line(device))
    n_params = sum(p.numel() for p in base.parameters())
    print(f"GPT-2 {args.layers} x {args.hidden} ({n_params:,} parameters), batch {args.batch} x {args.seq}, "
          f"{args.precision}, budget {budget}; searched plan {searched_plan}; {profiled} profiled steps\n")
    print("| run | steps profiled | reported profiling time (wall: the other runs' steps in between included) | those steps | the same steps, searched plan | "
          "overhead | overhead in steps | plan after | median step after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("cold", "cached"):
        metrics = next(m for m in reports[name] if "profiling_steps" in m)
        k = metrics["profiling_steps"]
        own, ref = sum(times[name][:k]), sum(times["searched"][:k])
        after = statistics.median(times[name][profiled:])
        print(f"| {name} | {k} | {format_seconds(metrics['profiling_s'])} | {format_seconds(own)} | "
              f"{format_seconds(ref)} | {(own - ref) * 1e3:+,.1f} ms | {(own - ref) / base_step:+.2f} | "
              f"{engines[name].plan} | {format_seconds(after)} |")
    print(f"| searched | - | - | - | - | - | - | {searched_plan} | {format_seconds(base_step)} |")
    print("\nraw step times (s):")
    for name, t in times.items():
        print(f"  {name}: " + ", ".join(f"{s:.4f}" for s in t))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
