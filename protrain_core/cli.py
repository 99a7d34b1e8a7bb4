"""``protrain plan``: profile a model, print the chosen plan and a what-if table -- no training.

    protrain plan --model tiny-llama --batch-size 8 --seq-len 256 --budget 64MiB
    protrain plan --model /path/to/hf-model-or-config.json --precision bf16-mixed --budget 20GiB \\
        --batch-sizes 1,2,4,8
    protrain plan --largest --simulate --hardware h200 --batch-size 4 --seq-len 2048 --precision bf16-mixed \\
        [--lora-rank 16 --frozen-dtype int8] [--device-memory 80GB --host-memory 256GiB]
    protrain plan --largest --batch-size 4 --seq-len 2048 --precision bf16-mixed      (on this machine's GPU)
    python -m protrain_core.cli plan ...            (the same, without the console script)

The model is built from its Hugging Face config with random weights (the step time and memory
of a plan do not depend on the weights' values), on the CPU, and profiled on a random batch of
token ids of the given shape on the chosen device. Then (``--check-steps``, default 5) a few
training steps on random data run with the chosen plan and their measured time is compared
with the prediction, as a training run does: a stale cached profile is reported and removed
from the cache. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import protrain_core as pt
from protrain_core import models, utils
from protrain_core.api import default_host_budget, default_memory_budget, device_budget, host_budget as host_budget_of
from protrain_core.autoplan import WARMUP_STEPS, AutoPlanner, PredictionCheck
from protrain_core.models import BUILTIN, LADDER
from protrain_core.planner.cost import estimate_memory
from protrain_core.precision import Precision, parse_precision
from protrain_core.profiler.profiler import for_world_size
from protrain_core.runtime.device import resolve_device
from protrain_core.simulator.device import SimulatedDevice
from protrain_core.simulator.hardware import load_spec
from protrain_core.simulator.run import simulate, simulate_plain
from protrain_core.update import Overlap
from protrain_core.utils import format_bytes, format_seconds, parse_bytes


def progress(text: str) -> None:
    print(f"protrain plan: {text}", file=sys.stderr, flush=True)


def _profile(args, config, batch_size: int):
    """The profile of ``config`` on a batch of ``batch_size`` x ``--seq-len``; with ``--world-size``,
    the what-if of its chunks sharded over that many processes, collectives at
    ``--collective-bandwidth`` (one process cannot measure them)."""
    model, opt = _build(args, config)
    progress(f"profiling {_what(args)} ({_counts(model)}) on a "
             f"batch of {batch_size} x {args.seq_len} tokens on {args.device} ...")
    start = time.perf_counter()
    prof = pt.profile(model, opt, models.token_batch(config, batch_size, args.seq_len), precision=args.precision,
                      device=args.device, cache=not args.no_cache, reprofile=args.reprofile, config=_config(args))
    progress(f"profile ready after {format_seconds(time.perf_counter() - start)}")
    if args.world_size == 1:
        return prof
    model, opt = _build(args, config)
    progress(f"what if the chunks are sharded over {args.world_size} processes (batch {batch_size} x "
             f"{args.seq_len} each; all-gather and reduce-scatter assumed at {args.collective_bandwidth:g} GB/s: a "
             "training run measures them) ...")
    return for_world_size(prof, model, opt, parse_precision(args.precision), args.world_size,
                          args.collective_bandwidth * 1e9)


def _parameters(model) -> tuple[int, int]:
    """(the model's parameters, those trained)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _counts(model) -> str:
    n, trained = _parameters(model)
    return f"{type(model).__name__}, {n:,} parameters" + ("" if trained == n else f", {trained:,} trained")


def _config(args):
    return pt.ProTrainConfig(optimizer_state_format=args.optimizer_state_format or "fp32", frozen_dtype=args.frozen_dtype)


def _what(args, name: str | None = None) -> str:
    """The run sized: the model (``name``, else ``--model``) and its LoRA adapters if any."""
    return (name or args.model) + (f" with {_adapters(args)}" if args.lora_rank else "")


def _adapters(args) -> str:
    """``--lora-rank``'s adapters and the frozen base's format ("" for a full fine-tune)."""
    if args.lora_rank is None:
        return ""
    return f"LoRA rank {args.lora_rank} on {args.lora_targets}" + (f", the base in {args.frozen_dtype}"
                                                                   if args.frozen_dtype else "")


def _build(args, config=None, device: str = "cpu"):
    """The model of ``--model`` (or ``config``: another batch's) with ``--lora-rank``'s adapters."""
    try:
        return models.build(config or args.config, device, lora_rank=args.lora_rank, lora_targets=args.lora_targets)
    except ValueError as e:  # (a config no causal or seq2seq LM class takes; --lora-targets matching no module)
        raise SystemExit(f"protrain plan: cannot build {args.model or 'the model'}: {e}") from None


def check_prediction(args, config, prof, choice) -> None:
    """A few training steps on random data with the chosen plan, timed against the prediction
    (the check a training run makes after its first steps; a stale cached profile is removed)."""
    model, opt = _build(args, config)
    engine = pt.wrap(model, opt, choice.plan, precision=args.precision, device=args.device, config=_config(args))
    planner = AutoPlanner(engine, prof, budget=choice.budget_bytes, host_budget=choice.host_budget_bytes,
                          overlap=Overlap(choice.schedule, gradient_passes=choice.gradient_passes))
    PredictionCheck(engine, planner, hint="--reprofile", checked_steps=args.check_steps)
    batch = models.token_batch(config, args.batch_size, args.seq_len, args.device)
    steps = WARMUP_STEPS + args.check_steps + 1
    progress(f"checking the prediction: {steps} training steps on random data ...")
    try:
        for _ in range(steps):
            engine.backward(engine.module(**batch).loss)
            engine.step()
            engine.zero_grad()
    finally:
        engine.close()


def _what_if(column: str, rows) -> None:
    """A what-if table, a line per (label, profile, budget, tokens) of ``rows``: the plan searched."""
    print(f"| {column} | plan (persist/buffer/swap/checkpoint) | predicted step | tokens/s | predicted peak "
          "| bottleneck |\n|---|---|---|---|---|---|")
    for label, prof, budget, tokens in rows:
        try:
            c = pt.search(prof, budget)
        except pt.InfeasibleBudget as e:
            what = (f"{format_bytes(e.needed_bytes - budget)} of device memory missing" if e.needed_bytes > budget
                    else "host memory too small")
            print(f"| {label} | does not fit ({what}) | | | | |")
            continue
        p, r = c.plan, c.runtime
        print(f"| {label} | {p.n_persist}/{p.n_buffer}/{p.n_swap}/{p.n_checkpoint} | {format_seconds(r.total_s)} | "
              f"{tokens / r.total_s:,.0f} | {format_bytes(c.memory.peak_bytes)} | {r.bottleneck} |")


def _budget_rows(args, prof, budget: int) -> list:
    """Rows over ``--budgets`` (default 25 % to 200 % of ``budget``), tokens/s of all the processes."""
    budgets = args.budgets or [int(budget * f) for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)]
    return [(format_bytes(b), prof, b, args.batch_size * args.seq_len * args.world_size) for b in budgets]


def _budgets(args) -> tuple[int, int | None]:
    """(device budget, host budget) of a run on ``--device`` (each process's, with ``--world-size``)."""
    budget = args.budget if args.budget is not None else device_budget(args.device_memory, args.device_memory) \
        if args.device_memory else pt.default_memory_budget(args.device)
    host_budget = host_budget_of(args.host_memory) if args.host_memory else default_host_budget(args.device)
    if host_budget is not None and args.world_size > 1:
        host_budget //= min(args.world_size, max(1, torch.cuda.device_count()))  # the node's ranks share its host
    return budget, host_budget


def plan_command(args) -> int:
    budget, host_budget = _budgets(args)
    batch_sizes, config = args.batch_sizes, args.config
    short = _host_shortfall(args)
    if short:
        raise SystemExit(f"protrain plan: {short}. To size a run for a GPU, simulate one: add --simulate (--hardware "
                         "h100, h200 or a JSON file; the model on the meta device, no memory). Or run this on the GPU "
                         "machine.")
    prof = _profile(args, config, args.batch_size)
    fits = True
    try:
        choice = pt.search(prof, budget, host_budget=host_budget)
        print(choice.explain(), flush=True)
        if args.check_steps and args.world_size == 1:
            check_prediction(args, config, prof, choice)
    except pt.InfeasibleBudget as e:
        print(f"protrain plan: {e}")
        fits = False
    print()
    if batch_sizes:
        print(f"What if the batch size changes (budget {format_bytes(budget)}, sequence {args.seq_len}):\n")
        _what_if("batch size", ((str(b), prof if b == args.batch_size else _profile(args, config, b), budget,
                                 b * args.seq_len * args.world_size) for b in batch_sizes))
    else:
        ranks = f", on each of {args.world_size} processes; tokens/s of all" if args.world_size > 1 else ""
        print(f"What if the memory budget changes (batch {args.batch_size} x {args.seq_len}{ranks}):\n")
        _what_if("budget", _budget_rows(args, prof, budget))
    return 0 if fits else 1  # (no plan fits the budget: the table shows what would)


def _plain_pytorch(args, result, budget: int) -> str:
    """Where the whole model fits the device (its all-persistent plan within the budget, one
    process): plain PyTorch's simulated step on the same device next to the plan's; else ""."""
    whole = pt.Plan(n_persist=result.profile.n_chunks, n_buffer=0)
    if args.world_size > 1 or estimate_memory(result.profile, whole).peak_bytes > budget:
        return ""
    model, _ = _build(args, device="meta")
    batch = models.token_batch(args.config, args.batch_size, args.seq_len, "meta")
    try:
        seconds = simulate_plain(model, batch, device=SimulatedDevice(args.hardware), precision=args.precision)
    except torch.OutOfMemoryError as e:
        return f"plain PyTorch on the same simulated device: {e}"
    return (f"plain PyTorch on the same simulated device (the model fits it; torch.autocast, AdamW(fused=True)): step "
            f"{format_seconds(seconds)}; this plan's {format_seconds(result.step_s)} is {result.step_s / seconds:.2f}x it")


def _simulated_budget(args) -> int:
    return args.budget if args.budget is not None else default_memory_budget(SimulatedDevice(args.hardware))


def _simulated(args, config, name: str):
    """(the simulation of model ``config`` (called ``name``) as the arguments describe the run,
    the model's parameters and those trained)."""
    sim = SimulatedDevice(args.hardware)  # a DeviceSpec: check_arguments read it
    model, opt = _build(args, config, "meta")
    batch = models.token_batch(config, args.batch_size, args.seq_len, "meta")
    what = _what(args, name)
    ranks = f", {args.world_size} simulated ranks" if args.world_size > 1 else ""
    progress(f"simulating {what} ({_counts(model)}) on a batch of {args.batch_size} x {args.seq_len} tokens on the "
             f"{sim.spec.name}{ranks}: profile, plan, two training steps ...")
    counts = _parameters(model)
    config = _config(args).replace(clipping=("norm", args.clip_norm) if args.clip_norm else None)
    try:
        result = simulate(model, opt, batch, device=sim, plan=args.plan, budget=_simulated_budget(args),
                          precision=args.precision, config=config, world_size=args.world_size,
                          description=f"{what}, batch {args.batch_size} x {args.seq_len}")
    except ValueError as e:
        if args.plan is None:
            raise
        raise SystemExit(f"protrain plan: --plan {'/'.join(map(str, args.plan.values()))}: {e}") from None
    return result, counts


def _simulated_rung(args, name: str, budgets=None):
    """Rung ``name`` simulated: (plan, step seconds, device peak, host bytes, (parameters, trained))."""
    result, counts = _simulated(args, models.load_config(name), name)
    return result.plan, result.step_s, result.device_peak_bytes, result.memory.planned_host_bytes, counts


def _profiled_rung(args, name: str, budgets: tuple[int, int | None]):
    """Rung ``name`` profiled on ``--device`` (sharded over ``--world-size`` processes, as
    ``plan`` does) and planned for ``budgets`` (``_budgets``, measured once before the ladder):
    (plan, predicted step, predicted peak, planned host bytes, (parameters, trained)); or, on
    the CPU, why this machine cannot hold the rung's states (checked before it is built)."""
    rung = argparse.Namespace(**{**vars(args), "model": name, "config": models.load_config(name)})
    short = _host_shortfall(rung)
    if short:
        return short
    budget, host_budget = budgets
    prof = _profile(rung, rung.config, rung.batch_size)
    choice = pt.search(prof, budget, host_budget=host_budget)
    counts = _parameters(_build(rung, device="meta")[0])
    return choice.plan, choice.runtime.total_s, choice.memory.peak_bytes, choice.memory.host_bytes, counts


def largest_command(args) -> int:
    """``--largest``: the run the arguments describe (a full fine-tune, or LoRA) on each rung of
    ``models.LADDER`` in turn until one does not fit the box -- simulated (``--simulate``), or
    profiled on ``--device`` and predicted by the cost model; a row per rung."""
    tokens = args.batch_size * args.seq_len * args.world_size
    rows, largest, rung = [], None, _simulated_rung if args.simulate else _profiled_rung
    budgets = None if args.simulate else _budgets(args)
    for name in models.LADDER:
        try:
            got = rung(args, name, budgets)
        except (pt.InfeasibleBudget, torch.OutOfMemoryError) as e:
            got = str(e).splitlines()[0]
        if isinstance(got, str):  # why the rung does not fit
            rows.append(f"| {name} | does not fit: {got} | | | | | |")
            break
        plan, step_s, peak, host, (n, trained) = got
        # Model FLOPs: 2 per parameter and token forward, 2 more for the activations' gradients, and 2
        # more for the weights' gradients of the trained parameters (attention's own left out).
        flops = (4 * n + 2 * trained) * tokens
        rows.append(f"| {name} | {n / 1e9:.1f}B | {plan.n_persist}/{plan.n_buffer}/{plan.n_swap}/{plan.n_checkpoint} | "
                    f"{format_seconds(step_s)} | {flops / step_s / 1e12:.0f} | {format_bytes(peak)} | {format_bytes(host)} |")
        largest = name
    moments = "" if (args.optimizer_state_format or "fp32") == "fp32" else f", Adam moments {args.optimizer_state_format}"
    if args.simulate:
        spec, kind = args.hardware, "simulated"
        box = (f"the {spec.name} with {format_bytes(spec.device_memory_bytes)} of device and "
               f"{format_bytes(spec.host_memory_bytes)} of host memory")
    else:
        (budget, host_budget), kind = budgets, "predicted by the cost model from a profile on this machine"
        box = f"{args.device} with a budget of {format_bytes(budget)}" + (
            "" if host_budget is None else f" and {format_bytes(host_budget)} of host memory")
    print(f"The largest model of the ladder whose {_adapters(args) or 'full fine-tune'}{moments} (batch {args.batch_size} x "
          f"{args.seq_len}, {args.precision}) fits {box}: {largest or 'none'} ({kind})\n")
    what = "simulated" if args.simulate else "predicted"
    print(f"| model | parameters | plan | {what} step | {what} model TFLOPS | {what} device peak | planned host bytes |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if largest else 1


def _host_shortfall(args) -> str | None:
    """Profiling on the CPU builds the model and its training states in host memory: why this
    machine cannot hold them (a 7B config on a laptop; checked before anything is built), or
    None (also on a GPU, whose budgets the search checks)."""
    if args.device.type != "cpu":
        return None
    model, _ = _build(args, device="meta")
    n, trained = _parameters(model)
    # the model as built (fp32), then the trained parameters' masters, gradients and two moments
    # (bf16-true: in bf16)
    needed = 4 * n + trained * (8 if parse_precision(args.precision) is Precision.BF16_TRUE else 16)
    available = utils.available_host_bytes()  # (looked up when called: tests replace it)
    if available is None or needed <= available:
        return None
    return (f"profiling {args.model} ({n / 1e9:.2f}B parameters) on the CPU needs about {format_bytes(needed)} of host "
            f"memory for the model and its training states; this machine has {format_bytes(available)} available")


def simulate_command(args) -> int:
    """``--simulate``: profile, plan and train on a simulated device (protrain_core/simulator),
    the model on the meta device: no memory, no GPU. Prints the search's explanation, the
    simulated step next to the cost model's prediction (idle time by cause, host waits, copies,
    CPU Adam), and the what-if table of the simulated profile."""
    budget = _simulated_budget(args)
    start = time.perf_counter()
    try:
        result, _ = _simulated(args, args.config, args.model)
    except (pt.InfeasibleBudget, torch.OutOfMemoryError, MemoryError) as e:  # (MemoryError: host states)
        print(f"protrain plan: {e}")
        return 1
    progress(f"simulated in {format_seconds(time.perf_counter() - start)} of real time")
    if result.choice is not None:
        print(result.choice.explain(), end="\n\n")
    print(result.text(), flush=True)
    plain = _plain_pytorch(args, result, budget)
    if plain:
        print(plain, flush=True)
    if args.timeline:
        from protrain_core import timeline_figure

        title = (f"{result.hardware}: {result.description}, plan {result.timeline['plan']}\n"
                 f"{result.overlap}; simulated step {format_seconds(result.step_s)}, cost model "
                 f"{format_seconds(result.predicted.total_s)}")
        print(f"timeline: {timeline_figure.save(timeline_figure.draw(result.timeline, title), args.timeline)}")
    print(f"\nWhat if the memory budget changes (the simulated profile; batch {args.batch_size} x {args.seq_len}):\n")
    _what_if("budget", _budget_rows(args, result.profile, budget))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="protrain", description="ProTrain tools")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="profile a model and print the plan ProTrain would choose, without training")
    p.add_argument("--model", default=None,
                   help=f"a local Hugging Face model directory or config.json, or a built-in config: {', '.join(BUILTIN)}")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed or bf16-true")
    p.add_argument("--budget", default=None, help="device memory budget, e.g. 20GiB (default: free memory minus a margin)")
    p.add_argument("--budgets", default=None, help="what-if budgets, comma-separated (default: 25%%..200%% of --budget)")
    p.add_argument("--batch-sizes", default=None, help="what-if batch sizes instead of budgets, e.g. 1,2,4,8")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--reprofile", action="store_true", help="profile again even if a cached profile exists")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the profile cache")
    p.add_argument("--check-steps", type=int, default=5,
                   help="training steps timed against the prediction after the plan is chosen (0: none; "
                        "not with --world-size)")
    p.add_argument("--world-size", type=int, default=1,
                   help="what if the chunks are sharded over this many processes (data parallel; the batch is each "
                        "process's)")
    p.add_argument("--collective-bandwidth", type=float, default=None,
                   help="with --world-size, without --simulate: all-gather / reduce-scatter bandwidth to assume, GB/s "
                        "(default 25: PCIe or InfiniBand; NVLink is several times more)")
    p.add_argument("--simulate", action="store_true",
                   help="plan and train on a simulated device instead of this machine's: the model on the meta device, "
                        "any size, no GPU (prints the simulated step next to the cost model's prediction)")
    p.add_argument("--hardware", default=None,
                   help="with --simulate: h100, h200, or a JSON file of DeviceSpec fields (protrain_core/simulator/hardware.py)")
    p.add_argument("--plan", default=None, help="with --simulate: simulate this plan, persist/buffer/swap/checkpoint, e.g. 0/2/0/8 "
                                                "(default: the one the search chooses)")
    p.add_argument("--clip-norm", type=float, default=None, help="with --simulate: clip the gradient norm at this value")
    p.add_argument("--timeline", default=None, help="with --simulate: write the simulated steps' timeline figure here (PNG)")
    p.add_argument("--optimizer-state-format", default=None, choices=("fp32", "bf16", "8bit"),
                   help="Adam's moments in this format (ProTrainConfig.optimizer_state_format; default fp32): their "
                        "bytes and the CPU update's rate for it")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="a LoRA fine-tune: adapters of this rank (peft, alpha twice the rank), the base frozen")
    p.add_argument("--lora-targets", default=None,
                   help="with --lora-rank: the modules adapted, comma-separated, e.g. q_proj,v_proj (default all-linear: "
                        "every linear layer but the output head)")
    p.add_argument("--frozen-dtype", default=None, choices=("int8", "fp8"),
                   help="with --lora-rank: the frozen base kept in this format (ProTrainConfig.frozen_dtype)")
    p.add_argument("--device-memory", default=None,
                   help="size the run for a device with this much memory, e.g. 141GB (with --simulate: the simulated "
                        "device's; default: this device's, or the preset's)")
    p.add_argument("--host-memory", default=None,
                   help="size the run for a host with this much memory, e.g. 128GiB (with --simulate: the simulated "
                        "host's)")
    p.add_argument("--largest", action="store_true",
                   help="instead of --model: the largest LLaMA-shaped model of a ladder ("
                        f"{', '.join(LADDER)}) whose run fits the box (this machine's device, or with --simulate a "
                        "simulated one), each rung's plan, step and bytes")
    args = ap.parse_args(argv)
    check_arguments(ap, args)
    if args.largest:
        return largest_command(args)
    return simulate_command(args) if args.simulate else plan_command(args)


def check_arguments(ap: argparse.ArgumentParser, args) -> None:
    """Every argument, before anything is built or profiled (``ap.error`` exits with usage)."""
    for name in ("batch_size", "seq_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.check_steps < 0:
        ap.error("--check-steps must be >= 0")
    if args.world_size < 1 or args.collective_bandwidth is not None and args.collective_bandwidth <= 0:
        ap.error("--world-size must be >= 1 and --collective-bandwidth > 0")
    if args.collective_bandwidth is not None and (args.world_size == 1 or args.simulate):
        ap.error("--collective-bandwidth is what a profile on this machine assumes for --world-size > 1 (a simulated "
                 "device's is its --hardware's): give it with --world-size, without --simulate")
    args.collective_bandwidth = args.collective_bandwidth or 25.0
    _check_lora_arguments(ap, args)
    try:
        args.device_memory, args.host_memory = (None if v is None else parse_bytes(v, name) for v, name in
                                                ((args.device_memory, "--device-memory"), (args.host_memory, "--host-memory")))
        args.budget = parse_bytes(args.budget, "--budget") if args.budget else None
        args.budgets = [parse_bytes(b, "--budgets") for b in args.budgets.split(",")] if args.budgets else None
    except ValueError as e:
        ap.error(str(e))
    if args.batch_sizes:
        items = [b.strip() for b in args.batch_sizes.split(",")]
        if not all(b.isdigit() and int(b) >= 1 for b in items):
            ap.error(f"--batch-sizes {args.batch_sizes!r}: give positive integers separated by commas, e.g. 1,2,4,8")
        args.batch_sizes = [int(b) for b in items]
        if args.budgets:
            ap.error("--batch-sizes tabulates batch sizes at one budget and --budgets budgets at one batch size: "
                     "give one of them (with --budget for --batch-sizes)")
    try:
        parse_precision(args.precision)
        if not args.simulate:
            args.device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:  # (torch.device of an unknown type raises RuntimeError)
        ap.error(str(e).replace("precision=", "--precision ").replace("device=", "--device "))
    if not args.simulate and args.device.type == "cpu" and (args.device_memory or args.host_memory):
        ap.error("--device-memory and --host-memory size a GPU box: use them with --simulate or --device cuda (the CPU "
                 "device's memory is the host's: give it with --budget)")
    _check_simulation_arguments(ap, args)
    if args.largest:
        args.config = None
        return
    if args.model is None:
        ap.error("--model is required (or --largest)")
    try:
        args.config = models.load_config(args.model)
    except ValueError as e:
        raise SystemExit(f"protrain plan: {e}") from None
    positions = next((getattr(args.config, a) for a in ("max_position_embeddings", "n_positions", "n_ctx")
                      if isinstance(getattr(args.config, a, None), int)), None)
    if positions is not None and args.seq_len > positions:
        ap.error(f"--seq-len {args.seq_len} is longer than the {positions} positions of {args.model}: "
                 f"use --seq-len {positions} or less.")


def _check_lora_arguments(ap: argparse.ArgumentParser, args) -> None:
    if args.lora_rank is None:
        given = [n for n, v in (("--lora-targets", args.lora_targets), ("--frozen-dtype", args.frozen_dtype)) if v]
        if given:
            ap.error(f"{', '.join(given)} describe a LoRA fine-tune: give its --lora-rank too")
    elif args.lora_rank < 1:
        ap.error("--lora-rank must be >= 1")
    args.lora_targets = args.lora_targets or "all-linear"


def _check_simulation_arguments(ap: argparse.ArgumentParser, args) -> None:
    only = [name for name, given in (("--plan", args.plan), ("--clip-norm", args.clip_norm), ("--timeline", args.timeline),
                                     ("--hardware", args.hardware)) if given is not None]
    if args.largest and (args.model is not None or args.plan is not None or args.timeline is not None or args.batch_sizes):
        ap.error("--largest climbs a ladder of models and plans each: leave out --model, --plan, --timeline and "
                 "--batch-sizes")
    if not args.simulate:
        if only:
            ap.error(f"{', '.join(only)} need --simulate")
        return
    if args.device is not None or args.batch_sizes:
        ap.error("--simulate replaces the device and simulates one batch size: leave out --device and --batch-sizes")
    try:
        args.hardware = load_spec(args.hardware or "h100")
    except ValueError as e:
        ap.error(str(e))
    memory = {k: v for k, v in (("device_memory_bytes", args.device_memory), ("host_memory_bytes", args.host_memory)) if v}
    args.hardware = dataclasses.replace(args.hardware, **memory)
    if args.plan is not None:
        parts = args.plan.split("/")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            ap.error(f"--plan {args.plan!r}: give persist/buffer/swap/checkpoint, e.g. 0/2/0/8")
        args.plan = dict(zip(("n_persist", "n_buffer", "n_swap", "n_checkpoint"), map(int, parts)))
    if args.clip_norm is not None and not args.clip_norm > 0:
        ap.error("--clip-norm must be > 0")
    if args.timeline is not None:
        from protrain_core import timeline_figure

        if not timeline_figure.available():
            ap.error('--timeline draws with matplotlib, which is not installed: pip install matplotlib')


if __name__ == "__main__":
    sys.exit(main())
