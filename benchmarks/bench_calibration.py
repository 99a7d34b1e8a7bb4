"""A plain-PyTorch training step traced, for calibrating the simulated device (issue 55, items 1
and 6): where a real device's time goes, by operator class, against the preset's roofline.

    python -m benchmarks.bench_calibration [--device cuda] [--batch 8 --seq 1024] [--json FILE]
    python -m benchmarks.bench_calibration --fit FILE [--hardware h200]   # a trace's class factors

The model is TinyLlama-1.1B's shape (the first GPU session's plain-PyTorch row, 173.05 ms on the
lent H200) with random weights, trained as plain PyTorch does: ``torch.autocast`` in bf16 on a
GPU, ``AdamW(fused=True)``. Two warm-up steps, then ``--steps`` steps under ``torch.profiler``:
per operator class (matmul, attention, elementwise, normalisation, copies, optimizer, other) the
calls and the device time (the CPU time on a CPU), each matmul shape's achieved FLOP/s, the
step's kernels and the idle gaps between them on the device (launch gaps), and the host time
per operator. Only plain PyTorch is traced: ProTrain's measured rows stay the simulator's
hold-out (benchmarks/bench_holdout.py). ``--tiny`` (the CPU check): a 2-layer model.

``--fit`` replays the traced step (its model, batch and sequence) on the simulated device with
the preset's class factors left out, and prints each class's factor: the traced device time
over the simulated roofline time, the ``kernel_s`` of each simulated operator kept apart. A
preset's ``op_class_factor`` is this output (tests/test_simulator.py checks the H200's against
the committed trace).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from protrain_core.simulator.hardware import op_class

TINYLLAMA = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "intermediate": 5632, "vocab": 32000}
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 172, "vocab": 256}
def _matmul_flops(name: str, shapes: list) -> float:
    """FLOPs of an mm/addmm/bmm call from its input shapes (0 when the shapes do not say)."""
    dims = [s for s in shapes if s]
    try:
        if name.endswith(("::mm", "::matmul")) and len(dims) >= 2:
            (m, k), (_, n) = dims[0][-2:], dims[1][-2:]
            return 2.0 * m * k * n
        if name.endswith("::addmm") and len(dims) >= 3:
            (m, k), (_, n) = dims[1][-2:], dims[2][-2:]
            return 2.0 * m * k * n
        if name.endswith("::bmm") and len(dims) >= 2:
            b, m, k = dims[0][-3:]
            return 2.0 * b * m * k * dims[1][-1]
    except ValueError:
        return 0.0
    return 0.0


def trace(device: str, shape: dict, batch: int, seq: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.systems import build_model

    cuda = device.startswith("cuda")
    model = build_model(dict(shape, seq=seq), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, shape["vocab"], (batch, seq), device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def step():
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync()
    step_s = (time.perf_counter() - t) / steps
    return summarise(prof, cuda, steps) | {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                                           "torch": torch.__version__, "batch": batch, "seq": seq, "model": shape,
                                           "steps": steps, "step_s": step_s}


def summarise(prof, cuda: bool, steps: int) -> dict:
    """Per class and per matmul shape, per step; the device's kernels and their gaps."""
    classes = defaultdict(lambda: {"calls": 0, "device_s": 0.0, "host_s": 0.0})
    matmuls = []
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith("aten::"):
            continue
        device_s = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 / steps
        c = classes[op_class(e.key)]
        c["calls"] += e.count // steps
        c["device_s"] += device_s
        c["host_s"] += e.self_cpu_time_total / 1e6 / steps
        flops = _matmul_flops(e.key, list(e.input_shapes or []))
        if flops and device_s > 0:
            matmuls.append({"op": e.key, "shapes": [list(s) for s in e.input_shapes if s], "calls": e.count // steps,
                            "flops_per_s": flops * (e.count // steps) / device_s})
    kernels = sorted(((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                      if cuda and ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda r: r[0])
    gaps = [max(0, b[0] - a[1]) for a, b in zip(kernels, kernels[1:])]
    ops = sum(c["calls"] for c in classes.values())
    return {"classes": dict(classes), "matmuls": sorted(matmuls, key=lambda m: -m["calls"]),
            "kernels_per_step": len(kernels) // steps, "kernel_gaps_s_per_step": sum(gaps) / 1e6 / steps,
            "host_s_per_op": sum(c["host_s"] for c in classes.values()) / max(ops, 1)}


def fit(calibration: dict, hardware: str = "h200") -> dict[str, float]:
    """Each operator class's factor (``DeviceSpec.op_class_factor``, two decimals) from a
    trace's ``calibration`` (``trace``'s result): its device time over the roofline time of
    the same plain-PyTorch step simulated on ``hardware`` without factors."""
    import dataclasses

    from benchmarks.systems import build_model
    from protrain_core import models
    from protrain_core.simulator.device import SimulatedDevice
    from protrain_core.simulator.hardware import load_spec
    from protrain_core.simulator.run import simulate_plain

    spec = dataclasses.replace(load_spec(hardware), op_class_factor={})
    model = build_model(dict(calibration["model"], seq=calibration["seq"]), "meta")
    batch = models.token_batch(model.config, calibration["batch"], calibration["seq"], "meta")
    sim = SimulatedDevice(spec)
    step_s = simulate_plain(model, batch, device=sim, precision="bf16-mixed")
    since = sim.main.t - step_s  # the last step's operators
    roofline, calls = defaultdict(float), defaultdict(int)
    for w in sim.records.work:
        if w.lane == "compute" and w.kind == "compute" and w.start >= since:
            c = op_class(w.label)
            roofline[c] += w.end - w.start - spec.kernel_s
            calls[c] += 1
    measured = calibration["classes"]
    missing = sorted(set(measured) ^ {c for c in roofline if roofline[c] > 0})
    if missing:
        raise ValueError(f"operator classes {missing} are in only one of the trace and its simulation: no factor")
    factors = {c: round((measured[c]["device_s"] - calls[c] * spec.kernel_s) / roofline[c], 2) for c in sorted(roofline)}
    if not all(f > 0 for f in factors.values()):
        raise ValueError(f"factors {factors}: a class's traced time is below its simulated kernels' kernel_s")
    return factors


def markdown(r: dict) -> str:
    lines = [f"plain PyTorch step on {r['device']} (torch {r['torch']}), batch {r['batch']} x {r['seq']}: "
             f"{r['step_s'] * 1e3:.2f} ms; {r['kernels_per_step']} kernels, gaps between them "
             f"{r['kernel_gaps_s_per_step'] * 1e3:.2f} ms; host {r['host_s_per_op'] * 1e6:.1f} us per operator", "",
             "| class | calls | device ms | host ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['calls']} | {v['device_s'] * 1e3:.2f} | {v['host_s'] * 1e3:.2f} |"
              for k, v in sorted(r["classes"].items(), key=lambda kv: -kv[1]["device_s"])]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (the CPU check)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fit", default=None, help="a trace's JSON: print its operator classes' factors")
    ap.add_argument("--hardware", default="h200", help="the preset --fit simulates (default h200)")
    args = ap.parse_args(argv)
    if args.fit:
        print(json.dumps(fit(json.loads(Path(args.fit).read_text()), args.hardware)))
        return
    result = trace(args.device, TINY if args.tiny else TINYLLAMA, args.batch, args.seq, args.steps)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
