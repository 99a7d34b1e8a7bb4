"""LoRA over a base kept in 8 bits (``frozen_dtype``, [Note: quantised frozen chunks] in
protrain_core/runtime/frozen_formats.py): bytes per frozen parameter, and on the CPU the step time
and the loss against the bf16 base, every format in one run.

    python -m benchmarks.bench_frozen_dtypes [--steps 100 --json FILE]

1. Upload and host bytes per frozen parameter, every chunk streamed, for LLaMA-7B and LLaMA-13B
   with LoRA (r 16 on q, k, v, o), bf16-mixed, from the chunk formats the engine allocates
   (``ChunkFormat.frozen_upload_bytes``: the frozen spans' share of an upload; chunk padding,
   scales and the norms included), built on the meta device.
2. LoRA-7B (r 16 on q, k, v, o) on a simulated H100 (benchmarks/bench_simulator.py's table),
   bf16-mixed, every chunk streamed through 2 buffers, sequences of 2048 in batches of 2 (the
   host link is the bottleneck) and 8: the bf16 base against int8.
3. The same LoRA run once per format on the CPU (a LLaMA of 4 layers, hidden 256, r 8 on q, k,
   v, o, bf16-mixed, every chunk streamed, AdamW lr 1e-3, one fixed stream of batches): median
   step time and each format's loss against the bf16 base's over ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import protrain_core as pt
from benchmarks.bench_state_formats import _llama, compared_rows, compared_table, cpu_model_and_data, timed_steps
from protrain_core.runtime.storage import chunk_formats

FORMATS = (None, "int8", "fp8")
SHAPES = [("llama-7b", 4096, 11008, 32, 32, 32, 32000), ("llama-13b", 5120, 13824, 40, 40, 40, 32000)]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lora(model, r: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0))


def bytes_rows() -> list[dict]:
    rows = []
    for name, *shape in SHAPES:
        model = _lora(_llama(*shape), r=16)
        path, blocks = pt.find_blocks(model)
        layout = pt.build_layout(model, path, len(blocks))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        for world in (1, 2):  # per rank: each keeps and uploads its piece of every frozen span
            for fmt in FORMATS:
                formats = chunk_formats(model, opt, layout, pt.Precision.BF16_MIXED, pt.ProTrainConfig(frozen_dtype=fmt),
                                        world_size=world)
                upload = sum(f.frozen_upload_bytes for f in formats)
                rows.append({"model": name, "format": fmt or "bf16", "ranks": world, "frozen_params": frozen,
                             "upload_bytes_per_frozen": upload / frozen, "upload_bytes_per_step": 2 * upload,
                             "host_bytes": sum(f.streamed_host_bytes for f in formats)})
    return rows


def simulated_rows() -> list[dict]:
    from benchmarks.bench_simulator import row
    from protrain_core import models
    from protrain_core.simulator.device import SimulatedDevice
    from protrain_core.simulator.run import simulate

    config = models.load_config("llama-7b")
    rows = []
    for batch, world in ((2, 1), (8, 1), (2, 2)):  # 2 ranks: each keeps and uploads its piece of the base
        for fmt in (None, "int8"):
            model = _lora(models.build(config, "meta")[0], r=16)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            result = simulate(model, opt, models.token_batch(config, batch, 2048, "meta"),
                              device=SimulatedDevice("h100", out_of_memory=False),
                              plan=pt.Plan(n_persist=0, n_buffer=2), config=pt.ProTrainConfig(frozen_dtype=fmt),
                              world_size=world)
            rows.append(row("streamed-buf2", f"lora-7b {fmt or 'bf16'}", world, result, batch))
    return rows


def training_rows(steps: int) -> list[dict]:
    make, data = cpu_model_and_data()
    runs = {}
    for fmt in FORMATS:
        model = make()
        torch.manual_seed(2)
        model = _lora(model, r=8)
        engine = pt.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
                         pt.Plan(n_persist=0, n_buffer=2), precision="bf16-mixed", device="cpu",
                         config=pt.ProTrainConfig(frozen_dtype=fmt))
        runs[fmt or "bf16"] = timed_steps(engine, data, steps)
    return compared_rows(runs, "bf16", steps, window=20)


def markdown(result: dict) -> str:
    lines = ["| model (LoRA r 16, all streamed) | frozen base | ranks | frozen parameters | upload B per frozen "
             "parameter (per rank) | uploads per step per rank (forward + backward) | host bytes per rank |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['format']} | {r.get('ranks', 1)} | {r['frozen_params'] / 1e9:.2f} B | "
              f"{r['upload_bytes_per_frozen']:.3f} | "
              f"{r['upload_bytes_per_step'] / 2**30:.1f} GiB | {r['host_bytes'] / 2**30:.1f} GiB |" for r in result["bytes"]]
    from benchmarks.bench_simulator import markdown as simulated

    lines += ["", simulated(result["simulated"])]
    lines += ["", *compared_table(result["training"], "bf16", window=20, what="frozen base", mib_decimals=2)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"bytes": bytes_rows(), "simulated": simulated_rows(), "training": training_rows(args.steps)}
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
