"""Adam's moments in fp32, bf16 and bitsandbytes' 8 bits (``optimizer_state_format``, [Note:
optimizer-state formats] in protrain_core/runtime/state_formats.py), each with and without the
streamed chunks' fp32 gradient accumulator (``grad_accumulator=False``, [Note: gradients consumed
where they land] in protrain_core/runtime/worker.py): host bytes per trainable parameter, the
largest LLaMA-shaped full fine-tune a host budget holds, and on the CPU the step time and the
loss against fp32 moments, all variants in one run.

    python -m benchmarks.bench_state_formats [--steps 300 --host-gib 128 --no-simulated --json FILE]

1. Host bytes per trainable parameter of a streamed chunk, from the chunk formats the engine
   allocates (``ChunkFormat.streamed_host_bytes``, which tests check against the allocation), for
   LLaMA-7B in bf16-mixed (built on the meta device).
2. The probe ladder: LLaMA shapes from 1.1B to 70B (LLaMA-3-8B and 48-layer 10.7B and 15.7B among them), every chunk streamed, the largest whose
   model states fit ``--host-gib`` of host memory in each format (the bytes the host-budget check
   of ``wrap`` compares).
3. LLaMA-7B full fine-tune (fp32 moments, batch 32 x 2048, 2 buffers, every chunk streamed) on a
   simulated H100, with and without the accumulator (benchmarks/bench_simulator.py's table, and
   the host bytes the cost model plans): the same schedule, 4 bytes per parameter less.
4. The same training run on the CPU (a LLaMA of 4 layers, hidden 256, bf16-mixed,
   every chunk streamed, AdamW lr 1e-3, one fixed stream of batches): median step time and the
   loss of each format against fp32's over ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import protrain_core as pt
from protrain_core.runtime.state_formats import block_aligned
from protrain_core.runtime.storage import chunk_formats

FORMATS = ("fp32", "bf16", "8bit")
# (moments, streamed chunks keep an fp32 gradient accumulator)
VARIANTS = [(fmt, True) for fmt in FORMATS] + [(fmt, False) for fmt in FORMATS]


def label(fmt: str, accumulator: bool) -> str:
    return fmt if accumulator else f"{fmt}, no accumulator"
# (name, hidden, intermediate, layers, heads, kv heads, vocabulary), smallest first
LADDER = [("llama-1.1b", 2048, 5632, 22, 32, 4, 32000), ("llama-3b", 3200, 8640, 26, 32, 32, 32000),
          ("llama-7b", 4096, 11008, 32, 32, 32, 32000), ("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
          ("llama-10.7b", 4096, 14336, 48, 32, 8, 32000), ("llama-13b", 5120, 13824, 40, 40, 40, 32000),
          ("llama-15.7b", 5120, 13824, 48, 40, 40, 32000),
          ("llama-34b", 8192, 22016, 48, 64, 8, 32000), ("llama-70b", 8192, 28672, 80, 64, 8, 32000)]


def _llama(hidden, inter, layers, heads, kv, vocab, device="meta"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def host_bytes(model, fmt: str, accumulator: bool = True, world_size: int = 1) -> tuple[int, int]:
    """(host bytes of every chunk streamed, on one rank of ``world_size``; trainable parameters)
    in bf16-mixed, with the layout ``wrap`` builds for ``fmt``."""
    opt = torch.optim.AdamW(model.parameters())
    layout = pt.build_layout(model, *(lambda path, blocks: (path, len(blocks)))(*pt.find_blocks(model)),
                             block_aligned=block_aligned(fmt))
    config = pt.ProTrainConfig(optimizer_state_format=fmt, grad_accumulator=None if accumulator else False)
    formats = chunk_formats(model, opt, layout, pt.Precision.BF16_MIXED, config, world_size=world_size)
    return sum(f.streamed_host_bytes for f in formats), sum(p.numel() for p in model.parameters())


def bytes_rows() -> list[dict]:
    model = _llama(*LADDER[2][1:])
    rows = []
    for fmt, acc in VARIANTS:
        total, n = host_bytes(model, fmt, acc)
        rows.append({"format": label(fmt, acc), "model": "llama-7b", "params": n, "host_bytes": total,
                     "bytes_per_param": total / n})
    return rows


def ladder_rows(host_gib: float) -> list[dict]:
    budget = host_gib * 2**30
    rows = []
    for name, *shape in LADDER:
        model = _llama(*shape)
        for fmt, acc in VARIANTS:
            total, n = host_bytes(model, fmt, acc)
            rows.append({"model": name, "params": n, "format": label(fmt, acc), "host_bytes": total,
                         "fits": total <= budget})
    return rows


def simulated_rows() -> list[dict]:
    from benchmarks.bench_simulator import row
    from protrain_core import models
    from protrain_core.simulator.device import SimulatedDevice
    from protrain_core.simulator.run import simulate

    config = models.load_config("llama-7b")
    rows = []
    for accumulator in (True, False):
        model = models.build(config, "meta")[0]
        result = simulate(model, torch.optim.AdamW(model.parameters()), models.token_batch(config, 32, 2048, "meta"),
                          device=SimulatedDevice("h100", out_of_memory=False), plan=pt.Plan(n_persist=0, n_buffer=2),
                          config=pt.ProTrainConfig(grad_accumulator=accumulator))
        r = row("streamed-buf2", label("fp32", accumulator), 1, result, 32)
        rows.append(dict(r, host_bytes=result.memory.host_bytes, planned_host_bytes=result.memory.planned_host_bytes))
    return rows


def cpu_model_and_data():
    """The CPU training runs' model (a LLaMA of 4 layers, hidden 256; a fresh copy of the same
    weights at every call) and their fixed stream of batches."""
    torch.manual_seed(0)
    base = _llama(256, 704, 4, 4, 4, 512, device="cpu")
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 512, (4, 64), generator=g) for _ in range(8)]

    def model():
        m = _llama(256, 704, 4, 4, 4, 512, device="cpu")
        m.load_state_dict(base.state_dict())
        return m

    return model, data


def timed_steps(engine, data, steps: int) -> tuple[list[float], float, int]:
    """(losses, median step time without the first step, host bytes) of ``steps`` steps on
    ``data`` (cycled); the engine is closed after."""
    losses, times = [], []
    for i in range(steps):
        x = data[i % len(data)]
        t0 = time.perf_counter()
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    out = losses, statistics.median(times[1:]), engine.memory.host_bytes()
    engine.close()
    return out


def training_rows(steps: int) -> list[dict]:
    make, data = cpu_model_and_data()
    runs = {}
    for fmt, acc in VARIANTS:
        model = make()
        config = pt.ProTrainConfig(optimizer_state_format=fmt, grad_accumulator=acc)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pt.Plan(n_persist=0, n_buffer=2),
                         precision="bf16-mixed", device="cpu", config=config)
        engine.clipping.expect_late(False)  # no step held (as without an accumulator): the same schedule
        runs[label(fmt, acc)] = timed_steps(engine, data, steps)
    return compared_rows(runs, "fp32", steps, window=50)


def compared_rows(runs: dict, baseline: str, steps: int, *, window: int) -> list[dict]:
    """One row per run of ``timed_steps`` (``runs``: name -> its result), against the run named
    ``baseline``: step time, host bytes, the mean loss of the last 10 steps, the largest loss
    difference and the mean one over the last ``window`` steps."""
    base_losses, base_step = runs[baseline][:2]
    return [{"format": name, "steps": steps, "step_s": t, f"vs_{baseline}_step": t / base_step, "host_bytes": hb,
             "final_loss": statistics.fmean(losses[-10:]),
             "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses, base_losses)),
             f"mean_abs_loss_diff_last_{window}": statistics.fmean(
                 abs(a - b) for a, b in zip(losses[-window:], base_losses[-window:]))}
            for name, (losses, t, hb) in runs.items()]


def compared_table(rows: list[dict], baseline: str, *, window: int, what: str, mib_decimals: int) -> list[str]:
    """The markdown lines of ``compared_rows``' rows (``what``: the first column's title)."""
    lines = [f"| {what} | median step (CPU) | vs {baseline} | host bytes | loss, last 10 | max abs loss diff vs "
             f"{baseline} | mean abs diff, last {window} |", "|---|---|---|---|---|---|---|"]
    return lines + [f"| {r['format']} | {r['step_s'] * 1e3:.1f} ms | {r[f'vs_{baseline}_step']:.2f}x | "
                    f"{r['host_bytes'] / 2**20:.{mib_decimals}f} MiB | {r['final_loss']:.4f} | "
                    f"{r['max_abs_loss_diff']:.4f} | {r[f'mean_abs_loss_diff_last_{window}']:.4f} |" for r in rows]


def markdown(result: dict) -> str:
    lines = ["| format | LLaMA-7B host bytes (all streamed) | bytes per trainable parameter |", "|---|---|---|"]
    lines += [f"| {r['format']} | {r['host_bytes'] / 2**30:.1f} GiB | {r['bytes_per_param']:.2f} |" for r in result["bytes"]]
    lines += ["", f"Largest full fine-tune in {result['host_gib']:g} GiB of host memory (every chunk streamed):", "",
              "| format | largest that fits | its host bytes |", "|---|---|---|"]
    for fmt in [label(*v) for v in VARIANTS]:
        fits = [r for r in result["ladder"] if r["format"] == fmt and r["fits"]]
        best = fits[-1] if fits else None
        lines.append(f"| {fmt} | {best['model'] if best else 'none'} | "
                     f"{best['host_bytes'] / 2**30:.1f} GiB |" if best else f"| {fmt} | none | |")
    if result.get("simulated"):
        from benchmarks.bench_simulator import markdown as simulated

        lines += ["", simulated(result["simulated"]), "", "| variant | planned host bytes (chunk states + staging) |",
                  "|---|---|"]
        lines += [f"| {r['variant']} | {r['planned_host_bytes'] / 2**30:.1f} GiB |" for r in result["simulated"]]
    lines += ["", *compared_table(result["training"], "fp32", window=50, what="format", mib_decimals=1)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--host-gib", type=float, default=128.0)
    ap.add_argument("--no-simulated", action="store_true", help="leave out the simulated LLaMA-7B rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"bytes": bytes_rows(), "host_gib": args.host_gib, "ladder": ladder_rows(args.host_gib),
              "simulated": [] if args.no_simulated else simulated_rows(), "training": training_rows(args.steps)}
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
