"""When should the CPU Adam run under gradient-norm clipping or fp16? The cost model's answer on
GPU-sized configurations ([Note: the overlap under clipping and fp16] in protrain_core/update.py).

    python -m benchmarks.bench_clipping [--tflops 500 --pcie-gbps 50 --cpu-adam-gparams 3]

No GPU is needed: the profiles are built by hand from LLaMA shapes and the hardware figures
given (defaults: an H100 at 500 dense bf16 TFLOP/s achieved, PCIe 5 at 50 GB/s each way, a
16-core host whose CPU Adam does 3e9 parameters/s -- this project's 2-core VM measures 1.2e9).
For each configuration the search picks the fastest plan that fits under each schedule, and
the table gives its predicted step time:
  during backward  the CPU Adam overlaps backward: possible only without norm clipping and fp16
                   (the reference: what clipping costs is the distance from it)
  next forward     the chosen mode: gradients finished as they land, Adam after backward,
                   overlapping the next forward
  deferred         Adam after backward, nothing overlapped (what ProTrain did before)
  speculative p    update during backward into a second set of host states, redone after
                   backward in a fraction p of the steps (those that clip, or overflow in fp16);
                   its extra host memory is in the last column
"""

from __future__ import annotations

import argparse

import torch

import protrain_core as pt
from protrain_core.chunk_format import ChunkFormat
from protrain_core.planner.profiles import Hardware, Profile, Segment
from protrain_core.update import UpdateSchedule
from protrain_core.utils import format_bytes, format_seconds

GIB = 2**30
# The speculative schedule (predicted here, never run: [Note: the overlap under clipping and fp16]):
# each streamed chunk is updated during backward into a second set of its host states, kept when
# the step needs no clipping and no skip, dropped (and the update run again, as NEXT_FORWARD) when
# it does. Its extra host memory: fp32 master, two moments and the compute copy again, per
# streamed trainable element (bytes), by compute-dtype bytes (mixed precision; fp32).
SPECULATIVE_EXTRA_HOST_BYTES = {2: 14, 4: 12}


def speculative_step(profile: Profile, plan: pt.Plan, redo_fraction: float) -> float:
    """The speculative schedule's predicted step: DURING_BACKWARD's, or NEXT_FORWARD's in the
    fraction of steps that redo their updates (with copies beside compute, as on a GPU)."""
    assert profile.hardware.async_copies, "without a separate device every schedule's updates add up"
    during, after = (pt.estimate_runtime(profile, plan, schedule=s).total_s
                     for s in (UpdateSchedule.DURING_BACKWARD, UpdateSchedule.NEXT_FORWARD))
    return (1 - redo_fraction) * during + redo_fraction * after


def llama_profile(*, name: str, hidden: int, layers: int, intermediate: int, vocab: int, batch: int, seq: int,
                  tflops: float, pcie: float, cpu_adam: float, device_bytes: int) -> Profile:
    """bf16-mixed LLaMA: one chunk per block (and one each for the embedding and the head);
    compute at ``tflops`` (2 FLOPs per parameter and token forward, twice that backward, plus
    attention), activations of a block as Megatron's count with flash attention (34 s b h bytes
    saved), chunk copies at ``pcie`` bytes/s, CPU Adam at ``cpu_adam`` parameters/s."""
    tokens = batch * seq
    per_block = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    embed = vocab * hidden
    chunk = max(per_block, embed)
    attention = 4 * batch * seq * seq * hidden  # QK^T and AV, forward
    fwd = (2 * per_block * tokens + attention) / tflops
    saved = 34 * tokens * hidden
    out = 2 * tokens * hidden

    def block(i):
        return Segment(name=f"block.{i}", kind="block", chunks=(i + 1,), fwd_s=fwd, bwd_s=2 * fwd, recompute_s=fwd,
                       out_bytes=out, saved_bytes=saved, fwd_peak_bytes=saved + 4 * out,
                       bwd_peak_bytes=saved + 8 * out, recompute_peak_bytes=saved + 4 * out)

    head = 2 * embed * tokens / tflops
    logits = 4 * tokens * vocab  # fp32 logits for the loss
    segments = (Segment(name="pre", kind="pre", chunks=(0,), fwd_s=1e-4, bwd_s=1e-4, recompute_s=0.0, out_bytes=out,
                        saved_bytes=0, fwd_peak_bytes=out, bwd_peak_bytes=out, recompute_peak_bytes=0),
                *(block(i) for i in range(layers)),
                Segment(name="post", kind="post", chunks=(layers + 1,), fwd_s=head, bwd_s=2 * head, recompute_s=0.0,
                        out_bytes=logits, saved_bytes=0, fwd_peak_bytes=3 * logits, bwd_peak_bytes=3 * logits,
                        recompute_peak_bytes=0))
    n = layers + 2
    trainable = (embed, *([per_block] * layers), embed)
    hw = Hardware(device=f"hand-built: {tflops / 1e12:.0f} TFLOP/s, {pcie / 1e9:.0f} GB/s, CPU Adam {cpu_adam:.1e}/s",
                  async_copies=True, h2d_bytes_per_s=pcie, d2h_bytes_per_s=pcie, cpu_adam_params_per_s=cpu_adam,
                  device_adam_params_per_s=50e9, device_memory_bytes=device_bytes)
    # bf16-mixed chunks: persistent, a bf16 compute copy, fp32 master, gradient and two moments
    # (18 B per element); streamed, a bf16 buffer and its gradient on the device ([Note: chunk storage]).
    chunks = tuple(ChunkFormat(numel=chunk, compute_dtype=torch.bfloat16, master_dtype=torch.float32, trainable_numel=t)
                   for t in trainable)
    return Profile(key=name, description=name, precision="bf16-mixed", chunks=chunks,
                   resident_sets=tuple((c,) for c in range(n)), segments=segments, base_bytes=2 * GIB,
                   fragmentation=1.1, hardware=hw, tokens=tokens)


def rows(profile: Profile, budget: int):
    """(schedule label, plan, predicted step seconds, host bytes) for each schedule's best plan."""
    out, plans = [], []
    for schedule in (UpdateSchedule.DURING_BACKWARD, UpdateSchedule.NEXT_FORWARD):
        choice = pt.search(profile, budget, schedule=schedule)
        plans.append(choice.plan)
        host = choice.memory.host_bytes
        label = "during backward (no clipping)" if schedule is UpdateSchedule.DURING_BACKWARD else "next forward (chosen)"
        out.append((label, choice.plan, choice.runtime.total_s, host))
        if schedule is UpdateSchedule.NEXT_FORWARD:
            r = choice.runtime  # the same plan with every update after backward and nothing overlapped
            out.append(("deferred (before)", choice.plan, r.forward_s + r.backward_s + max(r.device_adam_s, r.cpu_adam_s), host))
    extra = SPECULATIVE_EXTRA_HOST_BYTES[profile.chunks[0].compute_dtype.itemsize]
    for p in (0.0, 0.1, 0.5, 1.0):
        timed = [(speculative_step(profile, plan, p), plan) for plan in plans]
        t, plan = min(timed, key=lambda x: x[0])
        streamed = sum(c.updated_numel for c in profile.chunks[plan.n_persist:])
        host = pt.estimate_memory(profile, plan).host_bytes + extra * streamed
        out.append((f"speculative, redo {p:.0%}", plan, t, host))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tflops", type=float, default=500)
    ap.add_argument("--pcie-gbps", type=float, default=50)
    ap.add_argument("--cpu-adam-gparams", type=float, default=3)
    args = ap.parse_args()
    hw = dict(tflops=args.tflops * 1e12, pcie=args.pcie_gbps * 1e9, cpu_adam=args.cpu_adam_gparams * 1e9)
    configs = [
        ("LLaMA 1.1B, 8 x 1024, budget 12 GiB", dict(hidden=2048, layers=22, intermediate=5632, vocab=32000, batch=8), 12),
        ("LLaMA 7B, 4 x 1024, budget 70 GiB (80 GB GPU)", dict(hidden=4096, layers=32, intermediate=11008, vocab=32000, batch=4), 70),
        ("LLaMA 13B, 4 x 1024, budget 130 GiB (141 GB GPU)", dict(hidden=5120, layers=40, intermediate=13824, vocab=32000, batch=4), 130),
    ]
    print(f"hardware (hand-built): {args.tflops:g} TFLOP/s, PCIe {args.pcie_gbps:g} GB/s each way, "
          f"CPU Adam {args.cpu_adam_gparams:g}e9 params/s\n")
    print("| configuration | schedule | plan | predicted step | host memory |")
    print("|---|---|---|---|---|")
    for name, shape, budget_gib in configs:
        profile = llama_profile(name=name, seq=1024, device_bytes=(budget_gib + 10) * GIB, **shape, **hw)
        for label, plan, t, host in rows(profile, budget_gib * GIB):
            print(f"| {name} | {label} | {plan} | {format_seconds(t)} | {format_bytes(host)} |")
    print(f"\n(chunk sizes: one block per chunk; model states per chunk of the 7B: "
          f"{format_bytes(18 * (4 * 4096**2 + 3 * 4096 * 11008))} when persistent)")


if __name__ == "__main__":
    main()
