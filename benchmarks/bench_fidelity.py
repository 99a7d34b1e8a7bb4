"""Fidelity of the cost models: predicted vs measured step time and peak memory, side by side.

    python -m benchmarks.bench_fidelity [--layers 8 --hidden 256 --batch 8 --seq 128 --steps 6]
                                        [--vocab 256] [--lora 0]

Profiles a GPT-2 built from a config, searches the plan for a budget (default: 60 % of the
all-on-device, keep-everything peak), then trains the searched plan and several others for a few
steps each (round robin, so that machine noise hits all alike) and prints, per plan, the
predicted and the measured median step time and peak memory. Chunks differ with a large
vocabulary (``--vocab 8192``: the embedding chunk is larger than the blocks' chunks) and with
LoRA (``--lora 8``: peft adapters of that rank on the attention, every base weight frozen); the
plans then include one that names its persistent chunks (the last two instead of the first).
Peak memory is measured on CUDA by the allocator (max_memory_allocated) and on the CPU as the
engine's device-resident chunk bytes plus the live bytes of every operator-allocated tensor
(LiveStorageTracker), at every operator.
The paper's bar: step time within 5 %, peak memory over-estimated by at most 10 % and never under.
"""

from __future__ import annotations

import statistics
import time

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line, parser, setup
from protrain_core.memtrack import LiveStorageTracker
from protrain_core.utils import format_bytes


def measure_peak(engine, x, device) -> int:
    """Peak device bytes of one training step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(engine, x)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    base = x.untyped_storage().nbytes() + sum(b.untyped_storage().nbytes() for b in engine.module.buffers())
    peak = 0

    def on_op(_f, _before, after, _s):
        nonlocal peak
        peak = max(peak, after + engine.memory.device_bytes() + base)

    with LiveStorageTracker(device, on_op=on_op):
        step(engine, x)
    return peak


def step(engine, x) -> None:
    out = engine.module(input_ids=x, labels=x)
    engine.backward(out.loss)
    del out
    engine.step()
    engine.zero_grad()


def main(argv=None):
    ap = parser(layers=8, steps=6, warmup=2)
    ap.add_argument("--budget", default=None, help="memory budget for the search (default: 60%% of keep-all)")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary size (the embedding chunk's size)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on the attention (peft); 0: full fine-tuning")
    args = ap.parse_args(argv)
    device, sync, base_model, x = setup(args, use_cache=False, vocab_size=args.vocab)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        base_model = get_peft_model(base_model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                                           target_modules=["c_attn"], lora_dropout=0.0))
    state = {k: v.clone() for k, v in base_model.state_dict().items()}

    def fresh():
        base_model.load_state_dict(state)
        model = base_model
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    model, opt = fresh()
    prof = pt.profile(model, opt, {"input_ids": x, "labels": x}, precision=args.precision, device=device, cache=False)
    cm = pt.CostModel(prof)
    N, L = prof.n_chunks, prof.n_blocks
    everything = pt.Plan(n_persist=N, n_buffer=0)
    budget = pt.utils.parse_bytes(args.budget) if args.budget else int(0.6 * cm.memory(everything).peak_bytes)
    choice = pt.search(prof, budget)
    plans = [("searched", choice.plan), ("all persistent, keep", everything),
             ("all persistent, all checkpoint", pt.Plan(n_persist=N, n_buffer=0, n_checkpoint=L)),
             ("stream all, 2 buffers, keep", pt.Plan(n_persist=0, n_buffer=2)),
             ("stream all, 1 buffer, half swap", pt.Plan(n_persist=0, n_buffer=1, n_swap=L // 2)),
             ("half persistent, 2 buffers, 2S 2C", pt.Plan(n_persist=N // 2, n_buffer=2, n_swap=min(2, L), n_checkpoint=min(2, L - min(2, L))))]
    if N >= 3 and (args.vocab != 256 or args.lora):  # chunks differ: a named persistent set
        plans.append(("last two persistent, 2 buffers", pt.Plan(n_persist=2, n_buffer=2, persistent_chunks=(N - 2, N - 1))))

    times = {name: [] for name, _ in plans}
    peaks = {}
    for rnd in range(args.warmup + args.steps):
        for name, plan in plans:
            model, opt = fresh()
            engine = pt.wrap(model, opt, plan, precision=args.precision, device=device)
            step(engine, x)  # the first step of an engine warms its buffers
            if rnd == 0:
                peaks[name] = measure_peak(engine, x, device)
            sync()
            t = time.perf_counter()
            step(engine, x)
            sync()
            if rnd >= args.warmup:
                times[name].append(time.perf_counter() - t)
            engine.close()

    print(f"\n{machine_line(device)}")
    print(f"model: GPT-2 {args.layers} x {args.hidden}, vocabulary {args.vocab}"
          f"{f', LoRA rank {args.lora}' if args.lora else ''}, batch {args.batch} x {args.seq}, precision {args.precision}; "
          f"{N} chunks; profiled in {prof.profile_seconds:.2f} s; search {choice.seconds * 1e3:.2f} ms; "
          f"budget {format_bytes(budget)}; median of {args.steps} steps per plan\n")
    print(choice.explain() + "\n")
    print("| plan | | predicted step s | measured step s | error | predicted peak | measured peak | over-estimate |")
    print("|---|---|---|---|---|---|---|---|")
    for name, plan in plans:
        r, m = cm.runtime(plan), cm.memory(plan)
        t = statistics.median(times[name])
        peak = peaks[name]
        named = "" if plan.persistent_chunks is None else f" {list(plan.persistent_chunks)}"
        print(f"| {name} | {plan.n_persist}/{plan.n_buffer}/{plan.n_swap}/{plan.n_checkpoint}{named} | {r.total_s:.4f} | {t:.4f} | "
              f"{100 * (r.total_s - t) / t:+.1f}% | {m.peak_bytes / 2**20:.2f} MiB | {peak / 2**20:.2f} MiB | "
              f"{100 * (m.peak_bytes - peak) / peak:+.1f}% |")


if __name__ == "__main__":
    main()
