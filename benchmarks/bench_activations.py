"""Activation layouts: step time and activation memory held in backward, per (n_swap, n_checkpoint).

Same model, same batch, one process, one run; the baselines are plain PyTorch without and with
Hugging Face gradient checkpointing on every block. Steps are timed round robin (one step of
every system per round) so that drift of the machine affects all systems alike. Prints a
Markdown table.

Memory column: bytes of the activation storages made by the forward pass that are still alive
when backward starts -- from ``LiveStorageTracker`` on the CPU (swap host buffers excluded), from
``torch.cuda.memory_allocated`` on CUDA (minus the bytes allocated before the forward). On CUDA
the peak of ``max_memory_allocated`` over a whole step is printed too.

    python -m benchmarks.bench_activations [--layers 8 --hidden 256 --batch 8 --seq 128 --steps 10 --device cpu]
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
import warnings

import torch

import protrain_core as pt
from benchmarks._gpt2 import machine_line, parser, setup
from protrain_core.memtrack import LiveStorageTracker
from protrain_core.plan import describe_modes


def held_in_backward(forward, backward, device, exclude=lambda: ()):
    """(bytes of forward activations alive at backward start, peak bytes of the step or None)."""
    seen = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = forward()
        out.logits.register_hook(lambda g: seen.update(live=torch.cuda.memory_allocated(device) - before) or None)
        backward(out.loss)
        torch.cuda.synchronize(device)
        return seen["live"], torch.cuda.max_memory_allocated(device)
    with LiveStorageTracker() as tracker:
        out = forward()
    out.logits.register_hook(lambda g: seen.update(live=tracker.live_bytes(exclude=exclude())) or None)
    backward(out.loss)
    return seen["live"], None


def main(argv=None):
    args = parser(layers=8, steps=10, warmup=2).parse_args(argv)
    warnings.filterwarnings("ignore", message="ProTrain: a key/value cache")
    device, sync, base, x = setup(args, use_cache=False)
    n_params = sum(p.numel() for p in base.parameters())
    L = args.layers

    systems = []  # (label, forward, backward, host buffer storages, host bytes)
    for label, hf_ckpt in (("plain PyTorch", False), ("plain PyTorch + HF gradient checkpointing (all blocks)", True)):
        plain = copy.deepcopy(base).to(device)
        if hf_ckpt:
            if hasattr(plain, "activation_checkpointing_enable"):  # transformers >= 5
                plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plain.train()
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)

        def plain_backward(loss, opt=opt):
            loss.backward()
            opt.step()
            opt.zero_grad()

        systems.append((label, functools.partial(plain, input_ids=x, labels=x), plain_backward, lambda: (), lambda: 0))

    block_path, blocks = pt.find_blocks(base)
    n = pt.build_layout(base, block_path, len(blocks)).n_chunks
    for swap, ckpt in [(0, 0), (0, L // 2), (0, L), (L // 2, 0), (L, 0), (L // 4, L // 4)]:
        model = copy.deepcopy(base)
        plan = pt.Plan(n_persist=n, n_buffer=0, n_swap=swap, n_checkpoint=ckpt)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan, precision=args.precision, device=device)

        def engine_backward(loss, engine=engine):
            engine.backward(loss)
            engine.step()
            engine.zero_grad()

        label = f"ProTrain n_swap={swap} n_checkpoint={ckpt}: {describe_modes(engine.block_modes).split(' (')[0]}"
        systems.append((label, functools.partial(engine.module, input_ids=x, labels=x), engine_backward,
                        engine.activations.host.storages, lambda engine=engine: engine.activations.host.nbytes))

    # Round robin: one step of every system per round, so drift of the machine hits all alike.
    times = {label: [] for label, *_ in systems}
    for i in range(args.warmup + args.steps):
        for label, forward, backward, _, _ in systems:
            t = time.perf_counter()
            backward(forward().loss)
            sync()
            if i >= args.warmup:
                times[label].append(time.perf_counter() - t)
    rows = []
    for label, forward, backward, storages, host_bytes in systems:
        live, peak = held_in_backward(forward, backward, device, exclude=storages)
        rows.append((label, times[label], live, peak, host_bytes()))

    base_median = statistics.median(rows[0][1])
    mib = 2**20
    print("\n" + machine_line(device))
    print(f"model: GPT-2 {L} layers x {args.hidden}, {n_params:,} params (all chunks persistent); batch "
          f"{args.batch}x{args.seq}; precision {args.precision}; {args.steps} steps after {args.warmup} warm-up\n")
    print("| system | median s/step | min | max | vs plain | activations held at backward start (MiB) | peak (MiB) | swap host buffers (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, times, live, peak, host in rows:
        med = statistics.median(times)
        peak_s = f"{peak / mib:.1f}" if peak is not None else "n/a (CPU)"
        print(f"| {label} | {med:.4f} | {min(times):.4f} | {max(times):.4f} | {med / base_median:.2f}x | "
              f"{live / mib:.2f} | {peak_s} | {host / mib:.2f} |")


if __name__ == "__main__":
    main()
