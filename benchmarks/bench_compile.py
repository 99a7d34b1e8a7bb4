"""torch.compile under ProTrain against eager, and plain PyTorch compiled the same way against
eager, in one run ([Note: compiled units] in protrain_core/runtime/compiled.py).

    python -m benchmarks.bench_compile [--layers 4 --hidden 256 --batch 8 --seq 128 --device cuda]
    python -m benchmarks.bench_compile --backend aot_eager --steps 2   # (quick: no code generated)

A GPT-2 from its config; four systems, one after the other in this process: plain PyTorch eager,
plain PyTorch with each block and the stem and head modules compiled (what ProTrain compiles),
ProTrain eager and ProTrain compiled (``ProTrainConfig(compile=...)``), ProTrain on ``--plan``
(default: every chunk streamed through one buffer, so the chunk hooks run around every block).
Each system's first ``--warmup`` steps are timed together (compilation happens there: its share
of a short run) and its next ``--steps`` steps one by one (median). The losses of ProTrain and
plain PyTorch are compared, and their final weights, eager and compiled (in fp32 eager ones are equal bit for bit;
compiled ones with ``--deterministic``). Prints a Markdown table of measured times on this machine.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

import torch

import protrain_core as pt
from benchmarks import _gpt2

PLANS = {"streamed": lambda n: pt.Plan(n_persist=0, n_buffer=1), "persistent": lambda n: pt.Plan(n_persist=n, n_buffer=0)}


def protrain_units(model) -> list:
    """What ProTrain compiles, found without the library's own rule (the reference the tests and
    this benchmark compile): the blocks, then the modules outside them that own parameters and
    have no submodules."""
    _, blocks = pt.find_blocks(model)
    inside = {id(m) for b in blocks for m in b.modules()}
    return list(blocks) + [m for m in model.modules() if id(m) not in inside and next(m.children(), None) is None
                           and next(m.parameters(recurse=False), None) is not None]


def compiled_like_protrain(model, options: dict):
    """Plain PyTorch with the modules ProTrain compiles compiled the same way."""
    for m in protrain_units(model):
        m.forward = torch.compile(m.forward, **options)
    return model


def _run(step, x, sync, warmup: int, steps: int) -> dict:
    t0 = time.perf_counter()
    losses = [step(x) for _ in range(warmup)]
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step(x))
        sync()
        times.append(time.perf_counter() - t)
    return {"first_steps_s": first, "step_s": statistics.median(times), "losses": losses}


def measure(args, weights: dict | None = None) -> list[dict]:
    """The four systems' rows; ``weights`` (when given) gets each system's final state dict."""
    weights = {} if weights is None else weights
    device, sync, base, x = _gpt2.setup(args, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # (same losses)
    options = {"backend": args.backend}
    if args.backend == "inductor":  # each system compiles from nothing (not from the kernels the one before cached)
        torch._inductor.config.force_disable_caches = True
    block_path, blocks = pt.find_blocks(base)
    n_chunks = pt.build_layout(base, block_path, len(blocks)).n_chunks
    rows = []
    for system in ("pytorch", "pytorch compiled", "protrain", "protrain compiled"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        compiled = system.endswith("compiled")
        if system.startswith("pytorch"):
            model = (compiled_like_protrain(model, options) if compiled else model).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")

            def step(x, model=model, opt=opt, autocast=autocast):
                with autocast:
                    loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.item()
        else:
            config = pt.ProTrainConfig(compile=options if compiled else False)
            engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), PLANS[args.plan](n_chunks),
                             precision=args.precision, device=device, config=config, report=lambda *a, **k: None)

            def step(x, engine=engine):
                loss = engine.module(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                return loss.item()
        row = {"system": system, **_run(step, x, sync, args.warmup, args.steps)}
        final = model.state_dict() if system.startswith("pytorch") else engine.state_dict()
        weights[system] = {k: v.detach().to("cpu", copy=True) for k, v in final.items()}
        if not system.startswith("pytorch"):
            engine.close()
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for r in rows:
        r["vs_eager"] = r["step_s"] / by[r["system"].removesuffix(" compiled")]["step_s"]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| system | first steps s (compilation) | step s (median) | vs eager | last loss |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['first_steps_s']:.2f} | {r['step_s']:.4f} | {r['vs_eager']:.2f}x | "
                     f"{r['losses'][-1]:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = _gpt2.parser(layers=4, steps=10, warmup=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend")
    ap.add_argument("--plan", default="streamed", choices=sorted(PLANS))
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True): inductor's CPU embedding backward otherwise adds "
                         "rows with atomics on several threads, in an order that differs run to run")
    args = ap.parse_args(argv)
    torch.use_deterministic_algorithms(args.deterministic)
    device = _gpt2.setup(args)[0]
    setting = (f"{_gpt2.machine_line(device)}\nGPT-2 {args.layers} layers, hidden {args.hidden}, batch {args.batch} x "
               f"{args.seq}, {args.precision}, backend {args.backend}, ProTrain plan: {args.plan}"
               f"{', deterministic algorithms' if args.deterministic else ''}; measured")
    print(setting)
    weights = {}
    rows = measure(args, weights)
    by = {r["system"]: r for r in rows}
    for kind in ("", " compiled"):
        a, b = by["protrain" + kind]["losses"], by["pytorch" + kind]["losses"]
        differ = [abs(x - y) for x, y in zip(a, b) if x != y]
        ours, theirs = weights["protrain" + kind], weights["pytorch" + kind]
        tensors = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
        print(f"ProTrain{kind} against plain PyTorch{kind}: losses " + (
            "equal in every step" if not differ else
            f"differ in {len(differ)} of {len(a)} steps, by at most {max(differ):.3g}") + "; final weights " + (
            "equal" if not tensors else f"differ in {len(tensors)} of {len(theirs)} tensors"))
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
