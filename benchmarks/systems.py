"""One benchmark run in its own process: one system trains one model for a fixed number of steps.

    python -m benchmarks.systems '<run spec as JSON>' result.json

Started by ``benchmarks.run`` (never needed by hand). Every system trains the same randomly
initialised LLaMA-architecture model (``transformers.LlamaForCausalLM`` from a config, weights
drawn from the same seed) on the same synthetic token batches, with AdamW at the same
hyper-parameters, for ``warmup`` untimed and ``steps`` timed steps. A LoRA workload wraps the
model with ``peft.get_peft_model`` (adapters drawn from the same seed) and trains the adapters
only; its plain-PyTorch row is plain PEFT with the frozen base in bf16 (bf16-mixed). The result (a JSON object)
holds the step times, losses, peak device memory (CUDA allocator) and peak host RSS; running
out of memory is a result (``status: "oom"``), not a crash. With ``dry_run`` the model is built
on the meta device and each system is constructed as far as that allows (no training, no
device needed): it checks a suite's configurations on a machine without its GPU.

The systems:
  protrain-lightning  ``Trainer(strategy="protrain")``: the plan searched on its first steps
                      (default memory budget)
  protrain-core       ``protrain_core.wrap(model, optimizer, plan=None)``: the same
  pytorch             the model on the device, AdamW (fused); autocast for bf16-mixed -- the
                      ceiling where the model fits
  fsdp2-offload       ``fully_shard`` per block and at the root, ``CPUOffloadPolicy`` (world size 1)
  fsdp2-offload-ac    the same with activation checkpointing of every block
  deepspeed-zero3-offload  ZeRO-3, parameters and optimizer states offloaded to the CPU
  torchao-offload     ``torchao.optim.CPUOffloadOptimizer`` (states and update on the CPU)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback

import torch
from torch import nn

SYSTEMS = ("protrain-lightning", "protrain-core", "pytorch", "fsdp2-offload", "fsdp2-offload-ac",
           "deepspeed-zero3-offload", "torchao-offload")
LR, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 0.1


def unavailable(system: str, device_type: str) -> str | None:
    """Why ``system`` cannot run here (checked before a process is started), or None."""
    if system == "deepspeed-zero3-offload":
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed (optional: pip install deepspeed)"
        if device_type != "cuda":
            return "DeepSpeed ZeRO-3 offload needs a CUDA device"
    if system == "torchao-offload":
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (optional: pip install torchao)"
        if device_type != "cuda":
            return "torchao's CPUOffloadOptimizer needs a CUDA device"
    return None


# ----- model, batches, FLOPs --------------------------------------------------------------------
def llama_config(m: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
        num_key_value_heads=m.get("kv_heads", m["heads"]), max_position_embeddings=m["seq"],
        use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa",
    )


def build_model(m: dict, device: torch.device | str, seed: int = 0) -> nn.Module:
    """The model with every weight drawn from ``seed`` (normal, std 0.02; norms 1) on ``device``
    (built on the meta device first, so a large model is never initialised twice). Every system
    draws on the CPU, so all start from the same weights and their losses are comparable."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(m))
    if str(device) != "meta":
        model.to_empty(device=device)
        init_weights(model, seed)
    if m.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        config = LoraConfig(r=m["lora"]["r"], lora_alpha=2 * m["lora"]["r"], target_modules=m["lora"]["targets"],
                            lora_dropout=0.0)
        model = get_peft_model(model, config)
    return model


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict:
    """Model-state bytes of plain PyTorch: parameters, gradients (of the trainable ones) and the
    optimizer's states, on the training device or elsewhere (the host)."""
    out = {"host": 0, "device": 0}
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for t in tensors:
        out["device" if t.device.type == device.type else "host"] += t.numel() * t.element_size()
    return out


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Normal(0, 0.02) weights, norms 1. Drawn on the GPU when there is one (a 7B model's
    weights take a minute to draw on the CPU, a second on a GPU), one tensor at a time, and
    copied to wherever the parameter lives: the same weights for every system on one machine."""
    draw_on = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.device == draw_on:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.copy_(torch.empty(p.shape, device=draw_on).normal_(0.0, 0.02, generator=gen))
    for module in model.modules():  # buffers (rotary frequencies) as the module computes them
        own = dict(module.named_buffers(recurse=False))
        if own and hasattr(module, "config"):
            fresh = dict(type(module)(module.config).named_buffers(recurse=False))
            for name, b in own.items():
                b.copy_(fresh[name])


def batches(spec: dict, device) -> list[torch.Tensor]:
    """The synthetic token batches, the same for every system (drawn on the CPU; each process
    of a several-process run its own)."""
    gen = torch.Generator().manual_seed(1234 + rank())
    n = spec["warmup"] + spec["steps"]
    return [torch.randint(0, spec["model"]["vocab"], (spec["batch"], spec["seq"]), generator=gen).to(device)
            for _ in range(n)]


def param_counts(m: dict) -> tuple[int, int]:
    """(all parameters, parameters in matmuls: all but the input embedding); LoRA adapters included."""
    h, i, L, v = m["hidden"], m["intermediate"], m["layers"], m["vocab"]
    kv = h // m["heads"] * m.get("kv_heads", m["heads"])
    block = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    if m.get("lora"):  # q, k, v, o: A (r x in) and B (out x r)
        shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
        block += sum(m["lora"]["r"] * (a + b) for t, (a, b) in shapes.items() if t in m["lora"]["targets"])
    total = L * block + 2 * v * h + h
    return total, total - v * h


def flops_per_step(spec: dict) -> float:
    """Model FLOPs of one training step (forward and backward, recomputation not counted):
    6 N per token for the matmul parameters plus 12 L h s per token for attention scores and
    values (the PaLM appendix B formula, causal masking not discounted)."""
    m, tokens = spec["model"], spec["batch"] * spec["seq"]
    _, n_matmul = param_counts(m)
    per_param = 4 if m.get("lora") else 6  # frozen weights: forward and input gradients, no weight gradients
    return per_param * n_matmul * tokens + 12 * m["layers"] * m["hidden"] * spec["seq"] * tokens


# ----- measuring ----------------------------------------------------------------------------------
class Clock:
    """Step end times with a device synchronisation; peak device memory over the timed steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.peak: int | None = None  # peak device bytes over the timed steps (CUDA)
        self.rss: int | None = None  # peak host RSS of the process until the last timed step
        self.steady_rss: int | None = None  # peak host RSS over the timed steps (Linux), as self.peak
        self.steady = False  # the kernel's high-water mark was reset at the first timed step
        self.finished = False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        self.ends = [time.perf_counter()]
        self.rss = peak_rss()  # the run's peak so far (profiling included): the timed steps' is apart
        self.steady = reset_high_water_mark()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_done(self, loss) -> None:
        self.sync()
        self.ends.append(time.perf_counter())
        self.losses.append(float(loss))

    def finish(self) -> None:
        """After the last timed step: the peaks, before the lower bound's probes allocate."""
        if self.finished:
            return
        self.finished = True
        self.steady_rss = high_water_mark() if self.steady else None
        # The run's peak holds the timed steps' (the two counters can differ by a few pages: the
        # kernel batches each thread's count of resident pages).
        self.rss = max(self.rss or 0, peak_rss(), self.steady_rss or 0)
        if self.peak is None and self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def high_water_mark() -> int | None:
    """The kernel's peak resident size of this process since its last reset (``VmHWM``, Linux)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def reset_high_water_mark() -> bool:
    """Start ``VmHWM`` again from the resident size now (``/proc/self/clear_refs``); False where
    the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    """Resident bytes of this process now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss()


def host_memory_facts(engine, device: torch.device, baseline: int, clock: Clock) -> dict:
    """Peak host RSS against the plan (issue 30: at most 1.10x the planned bytes plus the
    baseline). Planned: what the plan allocates on the host (the explanation's host line; on a
    CPU device also its predicted device peak, the same RAM); baseline: the process before
    ``wrap``. ``rss_over_plan``: the peak over the timed steps, which run the plan (as the peak
    device memory); ``rss_over_plan_run``: the whole run's, the profiling steps on the safe plan
    included; ``rss_growth_over_plan``: the timed steps' growth from the baseline over the plan."""
    if engine.choice is None or clock.rss is None:
        return {}
    m = engine.choice.memory
    planned = m.planned_host_bytes + (m.peak_bytes if device.type != "cuda" else 0)
    if not planned:
        return {}
    steady = clock.steady_rss if clock.steady_rss is not None else clock.rss
    return {"rss_baseline_bytes": baseline, "planned_host_bytes": planned, "steady_host_rss_bytes": steady,
            "rss_over_plan": steady / (planned + baseline), "rss_over_plan_run": clock.rss / (planned + baseline),
            "rss_growth_over_plan": (steady - baseline) / planned}


def train_loop(step, data, spec, clock: Clock) -> None:
    """``step(x) -> loss``: ``warmup`` untimed steps, then the timed ones."""
    for x in data[: spec["warmup"]]:
        clock.losses.append(float(step(x)))
    clock.start()
    for x in data[spec["warmup"]:]:
        clock.step_done(step(x))
    clock.finish()


def autocast(spec, device):
    if spec["precision"] == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def torch_step(model, opt, amp, clip=None):
    """One plain training step (forward under ``amp``, backward, ``clip_grad_norm_`` to ``clip``
    over the optimizer's parameters when given, update, zero_grad) -> loss."""
    params = [p for group in opt.param_groups for p in group["params"]]

    def step(x):
        with amp:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def adamw(params, device, **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, **kw)


def reference_optimizer(spec, params, device) -> torch.optim.Optimizer:
    """Plain PyTorch's optimizer for the row's moments: fused AdamW, or bitsandbytes' AdamW8bit
    (what ProTrain's optimizer_state_format="8bit" equals on the unwrapped model)."""
    if spec.get("states", "fp32") == "fp32":
        return adamw(params, device, fused=True)
    from protrain_core.runtime.state_formats import bitsandbytes

    bitsandbytes()  # imported quietly, or the error naming the extra to install
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


# ----- the systems ---------------------------------------------------------------------------------
def states_note(spec) -> str:
    """What plain PyTorch needs for the model states alone (fp32 weights, gradients, 2 moments;
    a LoRA run: the frozen base in bf16, the adapters' full states)."""
    m = spec["model"]
    n = param_counts(m)[0]
    if m.get("lora"):
        adapters = n - param_counts({k: v for k, v in m.items() if k != "lora"})[0]
        gib = (2 * (n - adapters) + 16 * adapters) / 2**30
        return f"{n / 1e9:.2f}B parameters, {adapters / 1e6:.1f}M trainable: {gib:.1f} GiB of model states"
    return f"{n / 1e9:.2f}B parameters: {16 * n / 2**30:.1f} GiB of weights, gradients and AdamW states"


def run_pytorch(spec, device, clock):
    if spec["dry_run"]:
        adamw(trainable(build_model(spec["model"], "meta")), device)
        return {"note": states_note(spec) + " on the device"}
    model = build_model(spec["model"], "cpu").to(device)  # drawn on the CPU: the same weights for every system
    if world() > 1:  # several processes: DDP
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if spec["model"].get("lora") and spec["precision"] == "bf16-mixed":
        for p in model.parameters():  # plain PEFT's usual recipe: the frozen base in bf16
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if spec.get("frozen"):  # ProTrain's frozen_dtype computes with these values
        from protrain_core import dequantised

        dequantised(model, spec["frozen"], torch.bfloat16 if spec["precision"] == "bf16-mixed" else None)
    opt = reference_optimizer(spec, trainable(model), device)
    train_loop(torch_step(model, opt, autocast(spec, device), spec.get("clip")), batches(spec, device), spec, clock)
    return {"states": state_bytes(model, opt, device)}


def run_fsdp2(spec, device, clock, checkpointing: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda" and torch.cuda.is_available()  # a dry run may build a GPU suite on a CPU machine
    own_group = not dist.is_initialized()  # several processes: torchrun's, set up by run()
    if own_group:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world(),))
        # Built and drawn on the CPU like every system's model; fully_shard keeps the shards there.
        model = build_model(spec["model"], "meta" if spec["dry_run"] else "cpu")
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=cuda)}
        if spec["precision"] == "bf16-mixed":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if spec["dry_run"]:
            return {"note": f"fully_shard on the meta model ({'CUDA' if cuda else 'CPU'} mesh)"}
        model.train()
        opt = adamw(model.parameters(), device)  # the update runs on the CPU, where the states are
        # bf16 compute comes from the MixedPrecisionPolicy, not from autocast.
        train_loop(torch_step(model, opt, contextlib.nullcontext(), spec.get("clip")), batches(spec, device), spec, clock)
        return {}
    finally:
        if own_group:
            dist.destroy_process_group()


def run_deepspeed(spec, device, clock):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": spec["precision"] == "bf16-mixed"},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}},
    }
    if spec.get("clip") is not None:
        config["gradient_clipping"] = spec["clip"]
    if spec["dry_run"]:
        return {"note": f"deepspeed {deepspeed.__version__}, config built"}
    if world() == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    model = build_model(spec["model"], "cpu")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    train_loop(step, batches(spec, device), spec, clock)
    return {}


def run_torchao(spec, device, clock):
    from torchao.optim import CPUOffloadOptimizer

    if spec["dry_run"]:
        return {"note": "torchao CPUOffloadOptimizer importable"}
    model = build_model(spec["model"], "cpu").to(device)
    # Gradients offloaded too: the configuration with the least device memory.
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=LR, betas=BETAS,
                              weight_decay=WEIGHT_DECAY, fused=True)
    train_loop(torch_step(model, opt, autocast(spec, device), spec.get("clip")), batches(spec, device), spec, clock)
    return {}


def run_protrain_core(spec, device, clock):
    import protrain_core as pt

    if spec["dry_run"]:
        return dry_protrain(spec)
    model = build_model(spec["model"], "cpu")  # wrap places every parameter itself
    opt = adamw(trainable(model), device)
    data = batches(spec, device)
    clip = spec.get("clip")
    config = pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=spec.get("memory_budget")),
                               clipping=None if clip is None else ("norm", clip),
                               optimizer_state_format=spec.get("states", "fp32"), frozen_dtype=spec.get("frozen"),
                               grad_accumulator=spec.get("accumulator"))
    baseline = current_rss()  # the process before ProTrain: Python, torch, the model built on the CPU, the data
    engine = pt.wrap(model, opt, plan=None, config=config, precision=spec["precision"], device=device, report=_report)
    try:
        step = engine_step(engine)
        train_loop(step, data, spec, clock)
        extra = protrain_facts(engine, spec, device)
        if device.type != "cuda":  # the CPU "device": peak by the live-tensor tracker, one more step
            from benchmarks.bench_fidelity import measure_peak

            extra["peak_device_bytes_tracked"] = measure_peak(engine, data[-1], device)
        extra["memory"] = memory_categories(engine, extra.get("peak_device_bytes_tracked") or clock.peak)
        extra.update(host_memory_facts(engine, device, baseline, clock))
        if engine.choice is not None and world() == 1:
            try:  # the same run on the simulated device (protrain_core/simulator), given this machine's figures
                extra["simulated_step_s"] = simulated_step(spec, engine.plan, engine.choice.profile, device)
            except Exception as exc:  # noqa: BLE001 -- the measured figures stand without it
                extra["simulation_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if spec.get("study"):
            extra.update(study(engine, step, data, spec, device))
        return extra
    finally:
        engine.close()


def engine_step(engine):
    def step(x):
        loss = engine.module(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.detach()

    return step


def run_protrain_lightning(spec, device, clock):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_protrain

    if spec["dry_run"]:
        lightning_protrain.ProTrainStrategy(config={"planning": {"memory_budget": spec.get("memory_budget")}})
        return dry_protrain(spec)
    facts = {}

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(spec["model"], "cpu")

        def training_step(self, x, _):
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):
            return adamw(trainable(self), device)

    class Timing(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx < spec["warmup"]:
                clock.losses.append(float(outputs["loss"]))
                if batch_idx == spec["warmup"] - 1:
                    clock.start()
            else:
                clock.step_done(outputs["loss"])

        def on_train_end(self, trainer, module):
            clock.finish()
            facts.update(protrain_facts(trainer.strategy.engine, spec, device))

    data = batches(spec, "cpu")
    strategy = lightning_protrain.ProTrainStrategy(config={"planning": {"memory_budget": spec.get("memory_budget")}})
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if device.type == "cuda" else "cpu", devices=world(),
                         precision=spec["precision"], max_steps=len(data), logger=False, enable_checkpointing=False,
                         gradient_clip_val=spec.get("clip"),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Timing()])
    if spec["warmup"] == 0:
        clock.start()
    trainer.fit(LM(), DataLoader(data, batch_size=None))
    return facts


_PROFILING: dict = {}


def _report(text: str, **metrics) -> None:
    """ProTrain's reports: printed (the run's log), the profiling figures kept for the result."""
    print(text, flush=True)
    _PROFILING.update({k: v for k, v in metrics.items() if k.startswith("profiling")})


def dry_protrain(spec) -> dict:
    return {"note": meta_layout(json.dumps(spec["model"], sort_keys=True))}


@functools.lru_cache(maxsize=None)
def meta_layout(model_json: str) -> str:
    """Meta device: the execution order and chunk layout ProTrain would use for this model
    (once per model in a dry run's process)."""
    from protrain_core.structure.blocks import find_blocks
    from protrain_core.structure.layout import build_layout

    model = build_model(json.loads(model_json), "meta")
    path, blocks = find_blocks(model)
    layout = build_layout(model, path, len(blocks))
    return f"{len(blocks)} blocks, {layout.n_chunks} chunks of {layout.chunk_size:,} elements (meta trace)"


# ----- ProTrain: plan, fidelity and the lower bound ------------------------------------------------
def measured_matmul_flops(device: torch.device, precision: str) -> float:
    """Best of a few square matmuls in the compute dtype."""
    n = 4096 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if precision.startswith("bf16") and device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * n**3 / best


def host_memory_bandwidth(nbytes: int) -> float:
    """Bytes read plus written per second by a host copy of ``nbytes`` (best of a few; large
    enough not to fit a server's last-level cache)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def protrain_facts(engine, spec, device) -> dict:
    """The plan, the model states' bytes, the prediction (fidelity), and the inputs of the lower
    bound on step time."""
    # Device: the persistent chunks and the chunk buffers of the plan.
    facts = {"plan": str(engine.plan), "states": {"host": engine.memory.host_bytes(), "device": engine.memory.device_bound()},
             "searched": engine.choice is not None, **_PROFILING}
    choice = engine.choice
    if choice is None:
        return facts
    prof, plan = choice.profile, engine.plan
    facts["predicted_step_s"] = choice.runtime.total_s
    facts["predicted_peak_bytes"] = choice.memory.peak_bytes
    facts["bottleneck"] = choice.runtime.bottleneck
    # Lower bound: every streamed chunk goes up once and its gradient comes down once; swapped
    # activations go out and come back; CPU Adam touches each streamed element's master, grad,
    # two moments (read and write) and writes the compute copy.
    streamed = range(plan.n_persist, prof.n_chunks)
    trained = sum(prof.chunks[i].updated_numel for i in streamed)
    swapped = sum(s.saved_bytes for s in prof.blocks[: plan.n_swap]) if plan.n_swap else 0
    hw = prof.hardware
    up = sum(prof.chunks[i].upload_bytes for i in streamed) + swapped
    down = sum(prof.chunks[i].offload_bytes for i in streamed) + swapped
    compute = prof.chunks[0].compute_dtype.itemsize
    adam_bytes = trained * (4 * 7 + (compute if compute != 4 else 0))
    flops = flops_per_step(spec)
    matmul = measured_matmul_flops(device, spec["precision"])
    membw = host_memory_bandwidth(2**30 if device.type == "cuda" else 2**28)
    facts["bound"] = {
        "compute_s": flops / matmul, "matmul_flops_per_s": matmul,
        "transfer_s": max(up / hw.h2d_bytes_per_s, down / hw.d2h_bytes_per_s), "transfer_bytes": up + down,
        "cpu_adam_s": adam_bytes / membw, "cpu_adam_bytes": adam_bytes, "host_bytes_per_s": membw,
    }
    return facts


# ----- the study run: the cost models across plans, memory by category, one step's timeline -----
def memory_categories(engine, measured_peak: int | None) -> dict | None:
    """Device and host memory by category, predicted (the search's estimate of the plan) and
    measured: the engine's persistent chunks and chunk buffers as allocated, the rest of the
    measured device peak (activations, the batch, temporaries), and host memory of the model
    states and of swapped activations (the last step's)."""
    choice = engine.choice
    if choice is None or engine.plan != choice.plan or not measured_peak:
        return None
    import protrain_core as pt

    m = choice.memory
    host_states = pt.CostModel(choice.profile).host_suffix[choice.plan.n_persist]
    persistent = sum(c.storage.fmt.persistent_device_bytes for c in engine.chunks if c.persistent)
    streamed = [c.storage.fmt.buffer_device_bytes for c in engine.chunks if not c.persistent]
    buffers = min(engine.plan.n_buffer, len(streamed)) * max(streamed, default=0)
    swapped = sum(b.host_bytes for b in engine.activations.report())
    return {
        "predicted": {"persistent chunks": m.persistent_bytes, "chunk buffers": m.buffer_bytes,
                      "activations and the rest": m.base_bytes + m.activation_bytes,
                      "host: model states": host_states, "host: swapped activations": m.host_bytes - host_states},
        "measured": {"persistent chunks": persistent, "chunk buffers": buffers,
                     "activations and the rest": max(measured_peak - persistent - buffers, 0),
                     "host: model states": engine.memory.host_bytes(), "host: swapped activations": swapped},
    }


def study(engine, step, data, spec, device) -> dict:
    """The suite's study run, after its timed steps: the cost models' predicted step time and
    peak against the measured ones for the searched plan and the best plan at other numbers of
    persistent chunks that fit the same budgets (``engine.replan`` between them, one untimed
    step each), then one step's timeline on the searched plan."""
    import protrain_core as pt

    choice = engine.choice
    if choice is None:
        return {}
    n = choice.profile.n_chunks
    choices = [choice]
    for k in sorted({0, n // 4, n // 2, 3 * n // 4, n} - {choice.plan.n_persist}):
        try:
            choices.append(pt.search(choice.profile, choice.budget_bytes, host_budget=choice.host_budget_bytes,
                                     schedule=choice.schedule, gradient_passes=choice.gradient_passes, n_persist=k))
        except pt.InfeasibleBudget:
            continue
    plans = []
    for c in choices:
        row = {"plan": str(c.plan), "searched": c is choice, "predicted_step_s": c.runtime.total_s,
               "predicted_peak_bytes": c.memory.peak_bytes}
        try:
            engine.replan(c.plan)
            times, peak = timed_steps(engine, step, data, spec["steps"], device)
            if engine.plan != c.plan:
                raise RuntimeError(f"the engine re-planned to {engine.plan} while {c.plan} was timed")
            row.update(measured_step_s=statistics.median(times), step_s=times, measured_peak_bytes=peak)
        except Exception as exc:  # noqa: BLE001 -- one plan's failure (out of memory) is its result
            row.update(status="oom" if is_oom(exc) else "error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        try:
            row["simulated_step_s"] = simulated_step(spec, c.plan, choice.profile, device)
        except Exception as exc:  # noqa: BLE001 -- the measured figures stand without it
            row["simulation_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        plans.append(row)
    facts = {"plans": plans}
    try:
        engine.replan(choice.plan)
        facts["timeline"] = step_timeline(engine, step, data, spec, device)
    except Exception as exc:  # noqa: BLE001 -- the plans' figures stand without it
        facts["timeline_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return facts


def simulated_step(spec, plan, profile, device) -> float:
    """The plan's step on the simulated device (protrain_core/simulator) given this machine's
    measured figures: on the CPU the CPU device itself (compute as it runs, copies and Adam at
    the profile's rates, on a second model of real tensors); on CUDA this GPU's preset with the
    profile's copy bandwidths and CPU Adam rate, the model on the meta device."""
    import protrain_core as pt
    from protrain_core.simulator.device import SimulatedDevice
    from protrain_core.simulator.hardware import cpu_spec, preset_for, with_measured
    from protrain_core.simulator.run import simulate

    cuda = device.type == "cuda"
    tensors = "meta" if cuda else "cpu"
    hardware = with_measured(preset_for(torch.cuda.get_device_name(device)), profile.hardware, profile.state_format) \
        if cuda else cpu_spec(profile.hardware, profile.state_format)
    model = build_model(spec["model"], tensors)
    x = batches(dict(spec, warmup=1, steps=0), tensors)[0]
    result = simulate(model, adamw(trainable(model), tensors), {"input_ids": x, "labels": x},
                      device=SimulatedDevice(hardware, tensors=tensors), plan=plan, precision=spec["precision"],
                      config=pt.ProTrainConfig(clipping=None if spec.get("clip") is None else ("norm", spec["clip"])))
    return result.step_s


def timed_steps(engine, step, data, steps: int, device) -> tuple[list[float], int]:
    """One untimed step, then ``steps`` timed ones; their times and the peak device bytes."""
    from benchmarks.bench_fidelity import measure_peak

    clock = Clock(device)
    train_loop(step, [data[i % len(data)] for i in range(steps + 1)], {"warmup": 1}, clock)
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return times, clock.peak if device.type == "cuda" else measure_peak(engine, data[0], device)


def step_timeline(engine, step, data, spec, device) -> dict:
    """One step's timeline ([Note: the step timeline] in protrain_core/runtime/timeline.py) on
    the engine's plan. On a CPU device the CPU Adam runs inline by default, so the timeline
    comes from a second engine with the worker thread (``RuntimeConfig.cpu_adam_thread``) and
    the same plan: what the overlap looks like when the device is not the CPU."""
    import protrain_core as pt

    if device.type != "cuda":
        model = build_model(spec["model"], "cpu")
        clipping = None if spec.get("clip") is None else ("norm", spec["clip"])
        engine = pt.wrap(model, adamw(trainable(model), device), plan=engine.plan, precision=spec["precision"],
                         device=device, config=pt.ProTrainConfig(clipping=clipping,
                                                                 runtime=pt.RuntimeConfig(cpu_adam_thread=True)))
        step = engine_step(engine)
    try:
        for x in data[:2]:  # the first step holds its updates for a late clipping request
            step(x)
        with engine.record_timeline() as timeline:
            step(data[2 % len(data)])
        return dict(timeline.to_json(), plan=str(engine.plan), overlap=engine.overlap)
    finally:
        if device.type != "cuda":
            engine.close()


RUNNERS = {
    "protrain-lightning": run_protrain_lightning,
    "protrain-core": run_protrain_core,
    "pytorch": run_pytorch,
    "fsdp2-offload": lambda s, d, c: run_fsdp2(s, d, c, checkpointing=False),
    "fsdp2-offload-ac": lambda s, d, c: run_fsdp2(s, d, c, checkpointing=True),
    "deepspeed-zero3-offload": run_deepspeed,
    "torchao-offload": run_torchao,
}


def is_oom(exc: BaseException) -> bool:
    """Device or host memory ran out (ProTrain: no plan fits, or its host pool does not)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return any(s in text for s in ("out of memory", "No ProTrain plan fits", "DefaultCPUAllocator: can't allocate",
                                   "cudaHostRegister", "CUDA error: out of memory"))


def world() -> int:
    """Processes of this run (torchrun's ``WORLD_SIZE``; 1 when started alone)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if os.environ.get("TORCHELASTIC_RUN_ID") else 1


def rank() -> int:
    return int(os.environ.get("RANK", "0")) if world() > 1 else 0


def run(spec: dict) -> dict:
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if world() > 1 else 0)
    if device.type == "cuda" and not spec["dry_run"]:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    clock = Clock(device)
    result = {"status": "ok"}
    if world() > 1 and device.type == "cuda" and spec["system"] in ("fsdp2-offload", "fsdp2-offload-ac",
                                                                     "deepspeed-zero3-offload"):
        # Their CPU optimizer gets the cores ProTrain's CPU worker gets (torchrun set 1 thread):
        # [Note: CPU Adam threads] in protrain_core/runtime/worker.py.
        from protrain_core.runtime.topology import worker_placement

        placement = worker_placement(world())
        torch.set_num_threads(placement.threads)  # (unbound: this thread also drives the device)
        result["cpu_threads"] = placement.describe()
    # Several processes: one process group for the run (the Lightning Trainer sets up its own).
    group = world() > 1 and spec["system"] != "protrain-lightning" and not spec["dry_run"]
    if group:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        result.update(RUNNERS[spec["system"]](spec, device, clock) or {})
    except Exception as exc:  # noqa: BLE001 -- every failure is a result of the run
        result["status"] = "oom" if is_oom(exc) else "error"
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if group:
            dist.destroy_process_group()
    if spec["dry_run"]:
        result["status"] = "dry-run" if result["status"] == "ok" else result["status"]
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    if result["status"] == "ok" and len(times) != spec["steps"]:
        result.update(status="error", error=f"{len(times)} timed steps instead of {spec['steps']}")
    result["step_s"] = times
    result["losses"] = clock.losses
    result["peak_device_bytes"] = clock.peak
    result["peak_host_rss_bytes"] = clock.rss or peak_rss()
    result["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")  # what the RSS figure ran under
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    specs, out = json.loads(argv[0]), argv[1]
    result = [run(s) for s in specs] if isinstance(specs, list) else run(specs)  # a list: a dry run
    if rank() != 0:
        return 0  # rank 0 writes the result of a several-process run
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
