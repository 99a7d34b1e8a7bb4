"""Offloading a whole training state to the host and back (``engine.offload_states()`` /
``onload_states()``, [Note: parking] in protrain_core/runtime/parking.py): bytes and time per
direction, against the copy bandwidth the profiler's probe measures on the same device.

    python -m benchmarks.bench_offload [--layers 8 --hidden 512 --precision bf16-mixed --device cuda]
    python -m benchmarks.bench_offload --simulate h100 [--model llama-7b]

A GPT-2 from its config, every chunk persistent (the most bytes a round trip moves), one
training step first so that the optimizer states exist; then ``--trips`` round trips, each
followed by a training step (the round trip must leave a trainable engine). The first offload
allocates (and on CUDA page-locks) the host buffers; later ones reuse them. On CUDA the device
memory allocated and reserved is printed before and after each offload. ``--simulate``: the
same on the simulated GPU at a real model's size (meta tensors), in simulated seconds. On a CPU
device both "directions" are host memory copies. Prints a Markdown table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import protrain_core as pt
from benchmarks import _gpt2
from protrain_core.profiler.hardware import probe_hardware
from protrain_core.precision import parse_precision


def _step(engine, x) -> float:
    loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss.item()


def _device_memory(device) -> str:
    if device.type != "cuda":
        return ""
    return f"{torch.cuda.memory_allocated(device) / 2**20:.1f} / {torch.cuda.memory_reserved(device) / 2**20:.1f} MiB"


def measured(args) -> list[dict]:
    device, sync, model, x = _gpt2.setup(args)
    precision = parse_precision(args.precision)
    n = pt.build_layout(model, *_blocks(model)).n_chunks
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), pt.Plan(n_persist=n, n_buffer=0),
                     precision=args.precision, device=device)
    probe = probe_hardware(device, engine.layout.chunk_size, precision)
    _step(engine, x)
    sync()
    rows = []
    for trip in range(args.trips):
        before = _device_memory(device)
        t0 = time.perf_counter()
        handle = engine.offload_states()
        t1 = time.perf_counter()
        offloaded = _device_memory(device)
        engine.onload_states()
        sync()
        t2 = time.perf_counter()
        loss = _step(engine, x)
        nbytes = handle.copied_bytes
        rows.append({"trip": trip + 1, "bytes": nbytes, "offload_s": t1 - t0, "onload_s": t2 - t1,
                     "d2h": nbytes / (t1 - t0), "h2d": nbytes / (t2 - t1),
                     "probe_d2h": probe.d2h_bytes_per_s, "probe_h2d": probe.h2d_bytes_per_s,
                     "memory": f"{before} -> {offloaded}" if before else "", "loss": loss})
    engine.close()
    return rows


def simulated(args) -> list[dict]:
    from protrain_core import models
    from protrain_core.simulator import SimulatedDevice

    config = models.load_config(args.model)
    model, optimizer = models.build(config, "meta")
    sim = SimulatedDevice(args.simulate)
    rows = []
    with sim:
        n = pt.build_layout(model, *_blocks(model)).n_chunks
        engine = pt.wrap(model, optimizer, pt.Plan(n_persist=n, n_buffer=0), precision=args.precision, device=sim)
        for trip in range(args.trips):
            sim.synchronize_device()
            t0 = sim.main.t
            handle = engine.offload_states()
            t1 = sim.main.t
            engine.onload_states()
            sim.synchronize_device()
            t2 = sim.main.t
            nbytes = handle.copied_bytes
            rows.append({"trip": trip + 1, "bytes": nbytes, "offload_s": t1 - t0, "onload_s": t2 - t1,
                         "d2h": nbytes / (t1 - t0), "h2d": nbytes / (t2 - t1),
                         "probe_d2h": sim.spec.d2h_bytes_per_s, "probe_h2d": sim.spec.h2d_bytes_per_s,
                         "memory": "", "loss": float("nan")})
        engine.close()
    return rows


def _blocks(model):
    block_path, blocks = pt.find_blocks(model)
    return block_path, len(blocks)


def markdown(rows: list[dict]) -> str:
    lines = ["| trip | bytes each way | offload s | onload s | d2h GB/s (of probe) | h2d GB/s (of probe) | device memory before -> offloaded | loss after |",
             "|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['trip']} | {r['bytes']:,} | {r['offload_s']:.4f} | {r['onload_s']:.4f} | "
                     f"{r['d2h'] / 1e9:.2f} ({r['d2h'] / r['probe_d2h']:.0%}) | {r['h2d'] / 1e9:.2f} ({r['h2d'] / r['probe_h2d']:.0%}) | "
                     f"{r['memory']} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = _gpt2.parser(layers=8, steps=0, warmup=0)
    ap.add_argument("--trips", type=int, default=3)
    ap.add_argument("--simulate", default=None, help="a simulated GPU (h100, h200): a real model's size, meta tensors")
    ap.add_argument("--model", default="llama-7b", help="with --simulate: a config of protrain_core.models")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.set_defaults(hidden=512, precision="bf16-mixed")
    args = ap.parse_args(argv)
    if args.simulate:
        setting = f"simulated {args.simulate}, {args.model}, {args.precision}, every chunk persistent"
        print(setting)
        rows = simulated(args)
    else:
        device = _gpt2.setup(args)[0]
        setting = (f"{_gpt2.machine_line(device)}\nGPT-2 {args.layers} layers, hidden {args.hidden}, {args.precision}, "
                   "every chunk persistent")
        print(setting)
        rows = measured(args)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
