"""A rung of the largest-model ladder trained for real (issue 57 item 5): the model built on the
meta device and initialised chunk by chunk as ``wrap`` fills its chunks ([Note: weights straight
into chunks]; random weights, no download), a searched plan (the first steps profile it live),
then timed steps on random tokens. Prints one JSON line: the plan, the seconds of ``wrap`` and of
each step, model TFLOPS ((4 N + 2 N_trained) x tokens / step, as ``protrain plan --largest``
counts them), the device's peak memory and the host's peak RSS.

    python -m benchmarks.bench_largest --model llama-13b --device cuda              # full fine-tune
    python -m benchmarks.bench_largest --model llama-70b --lora-rank 16 --frozen-dtype int8 --device cuda

Compare with the simulated rung: ``protrain plan --simulate --hardware h200 --model ... --batch-size
4 --seq-len 2048 --precision bf16-mixed`` (docs/benchmarks.md, "The largest model one H200 box trains").
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

import protrain_core as pt
from protrain_core import models


def run(model: str, *, device: str, batch_size: int, seq_len: int, steps: int, warmup: int,
        lora_rank: int | None = None, frozen_dtype: str | None = None, state_format: str = "fp32",
        precision: str = "bf16-mixed") -> dict:
    config = models.load_config(model)
    net, optimizer = models.build(config, "meta", lora_rank=lora_rank)
    n = sum(p.numel() for p in net.parameters())
    trained = sum(p.numel() for p in optimizer.param_groups[0]["params"])
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    engine = pt.wrap(net, optimizer, precision=precision, device=dev, report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(frozen_dtype=frozen_dtype, optimizer_state_format=state_format))
    wrapped = time.perf_counter() - t0
    times, losses = [], []
    for i in range(warmup + steps):  # (the first steps profile and switch to the searched plan)
        batch = models.token_batch(config, batch_size, seq_len, dev)
        sync()
        t = time.perf_counter()
        loss = engine.module(**batch).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        sync()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    step = sorted(times[warmup:])[len(times[warmup:]) // 2] if steps else float("nan")
    result = {
        "model": model, "parameters": n, "trained": trained, "lora_rank": lora_rank, "frozen_dtype": frozen_dtype,
        "state_format": state_format, "precision": precision, "device": str(dev), "batch": [batch_size, seq_len],
        "plan": str(engine.plan), "wrap_s": round(wrapped, 2), "step_s": [round(t, 4) for t in times],
        "median_step_s": round(step, 4), "losses": losses,
        "model_tflops": round((4 * n + 2 * trained) * batch_size * seq_len / step / 1e12, 1) if steps else None,
        "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-13b", help="a built-in config (protrain_core.models) or a local one")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=4, help="steps first (the live profiling and the plan switch)")
    parser.add_argument("--lora-rank", type=int)
    parser.add_argument("--frozen-dtype", choices=["int8", "fp8"])
    parser.add_argument("--optimizer-state-format", default="fp32", choices=["fp32", "bf16", "8bit"])
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.model, device=args.device, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                 warmup=args.warmup, lora_rank=args.lora_rank, frozen_dtype=args.frozen_dtype,
                 state_format=args.optimizer_state_format, precision=args.precision)
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
