"""The benchmark suite: ProTrain and the systems users would pick instead, side by side, in one run.

    python -m benchmarks.run --suite cpu-smoke            # seconds; what CI runs
    python -m benchmarks.run --suite cpu-small            # minutes; a CPU comparison less dominated by overheads
    python -m benchmarks.run --suite gpu-80g              # one 80 GB GPU, 128 GB host RAM (H100)
    python -m benchmarks.run --suite gpu-141g             # one 141 GB GPU, 128 GB host RAM (H200)
    python -m benchmarks.run --suite gpu-80g --dry-run    # build every system and configuration, train nothing
    options: --out DIR  --systems protrain-core,pytorch  --no-probes  --timeout SECONDS  --memory-budget 40GiB

Every system trains the same randomly initialised LLaMA-architecture model on the same synthetic
batches (``benchmarks/systems.py``), each run in its own process, for ``warmup`` untimed and
``steps`` timed steps. The ProTrain systems plan on their first training steps (3 on CUDA, 6 on
a CPU device): the warm-up covers them and a step on the searched plan, for every system alike. Per run: tokens/s, achieved TFLOPS (model FLOPs: 6 N per token plus
attention), step time median and spread, peak device memory (CUDA allocator), peak host RSS,
final loss (on a CPU device every system runs with ``MALLOC_MMAP_THRESHOLD_=131072``,
``CPU_MMAP_THRESHOLD``, unless the environment sets it); out-of-memory (device, host, or no ProTrain plan fitting) is a result. For each
ProTrain run also: the plan, predicted vs measured step time and peak memory (the cost models'
fidelity), and the lower bound on step time -- max(compute at the measured matmul rate,
host<->device bytes / measured copy bandwidth, CPU-Adam bytes / measured host memory
bandwidth) -- with the measured time as a multiple of it. The probes find, per system, the
largest model of a ladder and the largest batch that train (ascending, stopping at the first
failure). The study run (ProTrain core on the suite's study workload, after its timed steps)
measures the cost models across the plans that fit its budget and records one step's timeline
(protrain_core Engine.record_timeline).

Output in --out (default benchmarks/results/<suite>/): results.json (everything, raw step
times and the timeline included), results.md (the tables, also printed) and the figures
(benchmarks/figures.py: throughput.png, memory.png, fidelity.png, timeline.png, probes.png;
they need matplotlib, the ``bench`` extra, and without it the runner says so and writes the
rest). Systems that cannot run here (deepspeed or torchao not installed, no CUDA) are listed
with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import systems as S
from protrain_core.utils import format_bytes, format_seconds, new_file_mode, total_host_bytes

ROOT = Path(__file__).resolve().parent.parent


def llama(hidden, layers, heads, intermediate, vocab=32000, kv_heads=None) -> dict:
    return {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads or heads,
            "intermediate": intermediate, "vocab": vocab}


@dataclasses.dataclass(frozen=True)
class Workload:
    label: str
    model: dict  # llama(...) fields; "lora": {"r": ..., "targets": [...]} fine-tunes PEFT LoRA adapters only
    batch: int
    seq: int
    systems: tuple[str, ...] | None = None  # None: every system
    clip: float | None = None  # clip_grad_norm_(max_norm=clip) before every update (each system's own way)
    devices: int = 1  # processes (data parallel, one device each; started by torchrun); 0: every GPU there is
    # Adam's moments: "fp32", or ProTrain's optimizer_state_format "8bit" against plain PyTorch with
    # bitsandbytes' AdamW8bit (the same arithmetic; the offload systems have no such format)
    states: str = "fp32"
    # LoRA's frozen base: None in the compute dtype, or ProTrain's frozen_dtype "int8"/"fp8" against
    # plain PEFT on the dequantised base (pt.dequantised: the same arithmetic, held in bf16 on the device)
    frozen: str | None = None
    # ProTrain's grad_accumulator (None: the configuration's default); False with "8bit" is the
    # 8.03 bytes per streamed trainable parameter of issue 31
    accumulator: bool | None = None


def lora(m: dict, r: int = 16) -> dict:
    """``m`` fine-tuned with PEFT LoRA adapters (rank ``r``) on every attention projection."""
    return dict(m, lora={"r": r, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]})


# LoRA runs: ProTrain against plain PEFT (bf16 base, fp32 adapters, autocast); offload systems
# are for full fine-tuning.
LORA_SYSTEMS = ("protrain-lightning", "protrain-core", "pytorch")
# Clipping rows: the same workload with gradient-norm clipping at 1.0, against its unclipped row.
CLIP_SYSTEMS = ("protrain-lightning", "protrain-core", "pytorch")


def clipped(w: Workload, systems: tuple[str, ...] = CLIP_SYSTEMS) -> Workload:
    return dataclasses.replace(w, label=f"{w.label} clip1", clip=1.0, systems=systems)


# 8-bit moments: ProTrain against plain PyTorch with bitsandbytes' AdamW8bit on the device.
STATES_SYSTEMS = ("protrain-core", "pytorch")


def eight_bit(w: Workload, *, accumulator: bool | None = None) -> Workload:
    """``w`` with 8-bit moments; ``accumulator`` False: ProTrain's streamed chunks also keep no
    fp32 gradient accumulator (bf16-mixed only)."""
    label = f"{w.label} adam8bit" + (" no-accumulator" if accumulator is False else "")
    return dataclasses.replace(w, label=label, states="8bit", accumulator=accumulator, systems=STATES_SYSTEMS)


def quantised_base(w: Workload, fmt: str = "int8") -> Workload:
    """A LoRA row with the frozen base kept and uploaded in 8 bits by ProTrain."""
    return dataclasses.replace(w, label=f"{w.label} {fmt}", frozen=fmt, systems=STATES_SYSTEMS)


@dataclasses.dataclass(frozen=True)
class Suite:
    description: str
    device: str  # "cpu" or "cuda"
    precision: str
    workloads: tuple[Workload, ...]  # the throughput table: every system on each
    warmup: int  # untimed steps: ProTrain profiles in them (3 on CUDA, 6 on a CPU) and switches plan
    steps: int
    model_ladder: tuple[Workload, ...] = ()  # max-model-size probe, ascending
    batch_ladder: tuple[Workload, ...] = ()  # max-batch-size probe, ascending
    probe_systems: tuple[str, ...] | None = None  # None: every system
    # ProTrain's memory budget in the probes (None: the device's): on a CPU, where nothing else
    # runs out of memory, it stands for a device's memory and the ladders end at a plan that no longer fits.
    probe_budget: str | None = None
    timeout_s: int = 600
    # Several processes, data parallel: ProTrain's chunks sharded over them (ZeRO-3 style), FSDP2
    # and DeepSpeed at the same number; on a GPU suite they run when the machine has 2+ GPUs.
    multi: tuple[Workload, ...] = ()
    # The study run (ProTrain core on this workload, at ``study_budget``; None: the default
    # budget): after its timed steps the cost models across plans that fit, memory by category,
    # and one step's timeline (benchmarks/systems.py: study).
    study: Workload | None = None
    study_budget: str | None = None


# Systems of the several-process rows: ProTrain and the sharded offload systems; DDP (pytorch)
# where the model fits.
MULTI_SYSTEMS = ("protrain-core", "pytorch", "fsdp2-offload", "deepspeed-zero3-offload")


TINY = llama(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=172, vocab=256)
# LLaMA shapes: TinyLlama-1.1B; LLaMA-2-7B; the same width deeper for the larger ones.
L1B = llama(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632)
L7B = llama(hidden=4096, layers=32, heads=32, intermediate=11008)
L13B = llama(hidden=5120, layers=40, heads=40, intermediate=13824)
SMALL = llama(hidden=256, layers=8, heads=4, intermediate=688, vocab=256)


def deeper(layers: int) -> dict:
    return dict(L7B, layers=layers)


def billions(m: dict) -> str:
    return f"{S.param_counts(m)[0] / 1e9:.1f}B"


SUITES = {
    "cpu-smoke": Suite(
        "tiny LLaMA on the CPU: checks that every system, the report and the figures still work (seconds)",
        device="cpu", precision="32-true", warmup=7, steps=3,
        workloads=(Workload("tiny-4L", TINY, batch=4, seq=64),),
        multi=(Workload("tiny-4L x2", TINY, batch=4, seq=64, systems=("protrain-core", "pytorch"), devices=2),),
        model_ladder=(Workload("tiny-2L", dict(TINY, layers=2), 4, 64), Workload("tiny-4L", TINY, 4, 64)),
        batch_ladder=(Workload("tiny-4L b2", TINY, 2, 64), Workload("tiny-4L b4", TINY, 4, 64)),
        probe_systems=("protrain-core",), timeout_s=300,
        study=Workload("tiny-4L", TINY, batch=4, seq=64), study_budget="5MiB",
    ),
    "cpu-small": Suite(
        "small LLaMA (8 x 256) on the CPU: steps long enough that per-step overheads do not dominate (minutes)",
        device="cpu", precision="32-true", warmup=7, steps=8,
        workloads=(Workload("small-8L", SMALL, 8, 256), clipped(Workload("small-8L", SMALL, 8, 256)),
                   Workload("small-8L lora", lora(SMALL, r=8), 8, 256, systems=LORA_SYSTEMS),
                   quantised_base(Workload("small-8L lora", lora(SMALL, r=8), 8, 256)),
                   eight_bit(Workload("small-8L", SMALL, 8, 256))),
        multi=(Workload("small-8L x2", SMALL, 8, 256, systems=("protrain-core", "pytorch"), devices=2),),
        # A budget under the all-persistent plan's peak: the study streams chunks (CPU Adam).
        study=Workload("small-8L", SMALL, 8, 256), study_budget="200MiB",
        model_ladder=tuple(Workload(f"small-{n}L", dict(SMALL, layers=n), 8, 256) for n in (8, 16, 32, 64)),
        batch_ladder=tuple(Workload(f"small-8L b{b}", SMALL, b, 256) for b in (8, 16, 32, 64)),
        probe_systems=("protrain-core",), probe_budget="160MiB",
    ),
    # One 80 GB GPU, 128 GB host RAM: 1.1B fits the device with plain PyTorch (16 B/param of
    # weights, gradients and AdamW states: 18 GB); 6.7B and 8.4B do not (108 / 134 GB) and need
    # offload; ProTrain's host side (fp32 master and moments, ~12-16 B/param of the streamed
    # part) caps it near 8B. Every run is one process of a few minutes at most (timeout_s); the
    # device tool's 10-minute commands run the suite in pieces: --systems ... --resume.
    "gpu-80g": Suite(
        "one 80 GB GPU (H100), 128 GB host RAM; bf16-mixed, sequence 1024",
        device="cuda", precision="bf16-mixed", warmup=4, steps=4, timeout_s=300,
        workloads=(Workload(f"llama-{billions(L1B)}", L1B, 8, 1024), Workload(f"llama-{billions(L7B)}", L7B, 4, 1024),
                   Workload(f"llama-{billions(deeper(40))}", deeper(40), 4, 1024),
                   clipped(Workload(f"llama-{billions(L1B)}", L1B, 8, 1024)),
                   clipped(Workload(f"llama-{billions(L7B)}", L7B, 4, 1024), ("protrain-core", "fsdp2-offload")),
                   eight_bit(Workload(f"llama-{billions(L7B)}", L7B, 4, 1024), accumulator=False),
                   Workload(f"llama-{billions(L7B)} lora", lora(L7B), 4, 1024, systems=LORA_SYSTEMS),
                   Workload(f"llama-{billions(L13B)} lora", lora(L13B), 4, 1024, systems=LORA_SYSTEMS),
                   quantised_base(Workload(f"llama-{billions(L13B)} lora", lora(L13B), 4, 1024))),
        model_ladder=tuple(Workload(f"llama-{billions(deeper(n))}", deeper(n), 2, 1024) for n in (24, 32, 40, 48)),
        batch_ladder=tuple(Workload(f"llama-{billions(L7B)} b{b}", L7B, b, 1024) for b in (2, 4, 8, 16, 32)),
        multi=(Workload(f"llama-{billions(L7B)} all GPUs", L7B, 4, 1024, systems=MULTI_SYSTEMS, devices=0),
               Workload(f"llama-{billions(L13B)} all GPUs", L13B, 4, 1024, systems=MULTI_SYSTEMS, devices=0)),
        study=Workload(f"llama-{billions(L7B)}", L7B, 4, 1024),
    ),
    # One 141 GB GPU, 128 GB host RAM: more persistent chunks; the ladder goes further.
    "gpu-141g": Suite(
        "one 141 GB GPU (H200), 128 GB host RAM; bf16-mixed, sequence 1024",
        device="cuda", precision="bf16-mixed", warmup=4, steps=4, timeout_s=300,
        workloads=(Workload(f"llama-{billions(L1B)}", L1B, 8, 1024), Workload(f"llama-{billions(L7B)}", L7B, 8, 1024),
                   Workload(f"llama-{billions(deeper(48))}", deeper(48), 4, 1024),
                   clipped(Workload(f"llama-{billions(L1B)}", L1B, 8, 1024)),
                   clipped(Workload(f"llama-{billions(L7B)}", L7B, 8, 1024), ("protrain-core", "fsdp2-offload")),
                   eight_bit(Workload(f"llama-{billions(L7B)}", L7B, 8, 1024), accumulator=False),
                   Workload(f"llama-{billions(L7B)} lora", lora(L7B), 8, 1024, systems=LORA_SYSTEMS),
                   Workload(f"llama-{billions(L13B)} lora", lora(L13B), 4, 1024, systems=LORA_SYSTEMS),
                   quantised_base(Workload(f"llama-{billions(L13B)} lora", lora(L13B), 4, 1024))),
        model_ladder=tuple(Workload(f"llama-{billions(deeper(n))}", deeper(n), 2, 1024) for n in (32, 40, 48, 56, 64)),
        batch_ladder=tuple(Workload(f"llama-{billions(L7B)} b{b}", L7B, b, 1024) for b in (4, 8, 16, 32, 64)),
        multi=(Workload(f"llama-{billions(L7B)} all GPUs", L7B, 8, 1024, systems=MULTI_SYSTEMS, devices=0),
               Workload(f"llama-{billions(L13B)} all GPUs", L13B, 4, 1024, systems=MULTI_SYSTEMS, devices=0)),
        study=Workload(f"llama-{billions(L7B)}", L7B, 8, 1024),
    ),
}


# ----- running ---------------------------------------------------------------------------------
def spec_of(suite: Suite, system: str, w: Workload, *, dry_run: bool, steps=None, warmup=None,
            memory_budget=None, study: bool = False) -> dict:
    m = dict(w.model, seq=w.seq)
    return {"system": system, "label": w.label, "model": m, "batch": w.batch, "seq": w.seq,
            "device": suite.device, "precision": suite.precision, "dry_run": dry_run, "memory_budget": memory_budget,
            "clip": w.clip, "devices": w.devices, "study": study, "states": w.states, "frozen": w.frozen,
            "accumulator": w.accumulator,
            "warmup": suite.warmup if warmup is None else warmup, "steps": suite.steps if steps is None else steps}


_port = [29400]


class _Stopping:
    """The runner's SIGTERM: it exits (143), and ``launch`` kills the run in flight on the way.
    While a run is being started the signal is held until its pid is known: raised inside
    ``Popen``, it would leave the new run going with nothing left to stop it."""

    def __init__(self):
        self.holding = self.pending = False

    def __call__(self, *_):
        if self.holding:
            self.pending = True
        else:
            sys.exit(143)

    @contextlib.contextmanager
    def held(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False

    def release(self):
        """Exit now if the signal came while it was held."""
        if self.pending:
            sys.exit(143)


_stopping = _Stopping()


# On a CPU device the activations are host memory too. With glibc's default (dynamic) mmap
# threshold, freed activation blocks stay resident for reuse, and peak RSS measures the
# allocator's cache rather than what a plan holds (benchmarks/HISTORY.md, "Peak resident memory
# against the plan"). Every system of a CPU suite therefore runs with large blocks returned at
# once, as a CUDA suite's device memory is read from the allocator's own counters; an
# environment that sets MALLOC_MMAP_THRESHOLD_ itself keeps its value. Recorded per run.
CPU_MMAP_THRESHOLD = "131072"


def launch(specs: list[dict], timeout: int, log_dir: Path) -> list[dict]:
    """Run ``specs`` in one process (several only in a dry run) and return their results; a
    process that dies or times out yields results that say so. The process gets its own
    session, and a timeout kills the whole group (compilers or workers it started included)."""
    for s in specs:
        _port[0] += 1
        s["port"] = _port[0]
    dry = specs[0]["dry_run"]
    name = ("dry-run" if dry else f"{specs[0]['system']}-{specs[0]['label']}-b{specs[0]['batch']}").replace(" ", "_")
    out = log_dir / f"{name}.result.json"
    log = log_dir / f"{name}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.systems", json.dumps(specs if dry else specs[0]), str(out)]
    n = specs[0].get("devices", 1)
    if n > 1 and not dry:  # torchrun starts one process per device; rank 0 writes the result
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "benchmarks.systems"]
    # Each ProTrain run profiles afresh: a cached profile may come from another load on this machine.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PROTRAIN_REPROFILE="1")
    if specs[0].get("device") == "cpu":
        env.setdefault("MALLOC_MMAP_THRESHOLD_", CPU_MMAP_THRESHOLD)
    with open(log, "w") as f:
        with _stopping.held():
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _stopping.release()
            code = proc.wait(timeout=timeout)
            failure = None if code == 0 else (
                f"killed by signal {-code} (host out of memory?)" if code < 0 else f"exit status {code}")
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failure = f"timed out after {timeout} s"
        except BaseException:  # the runner itself is stopped (SIGTERM, Ctrl-C): so is its run, before it exits
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if out.exists():  # written at the end of the run: valid even if the process failed afterwards
        results = json.loads(out.read_text())
        return results if isinstance(results, list) else [results]
    failure = failure or "the run wrote no result"
    tail = log.read_text()[-1500:] if log.exists() else ""
    status = "timeout" if failure.startswith("timed out") else "oom" if "signal 9" in failure else "error"
    return [{"status": status, "error": failure, "log_tail": tail} for _ in specs]


def summarise(spec: dict, result: dict) -> dict:
    """One row of the report: the run's identity, its raw result, and the derived figures."""
    row = {"system": spec["system"], "label": spec["label"], "batch": spec["batch"], "seq": spec["seq"],
           "model": spec["model"], "params": S.param_counts(spec["model"])[0], "memory_budget": spec["memory_budget"],
           **result}
    times = result.get("step_s") or []
    if result.get("status") == "ok" and times:
        med = statistics.median(times)
        n = spec.get("devices", 1)  # every process trains its own batch: the figures are all of them
        row.update(step_median_s=med, step_min_s=min(times), step_max_s=max(times),
                   tokens_per_s=n * spec["batch"] * spec["seq"] / med,
                   tflops=n * S.flops_per_step(spec) / med / 1e12, devices=n)
        if result.get("timeline"):
            row.update(adam_in_backward=adam_in_backward(result["timeline"]))
        bound = result.get("bound")
        if bound:
            lower = max(bound["compute_s"], bound["transfer_s"], bound["cpu_adam_s"])
            row.update(lower_bound_s=lower, vs_lower_bound=med / lower)
    return row


def run_key(row: dict) -> tuple:
    return (row["system"], row["label"], row["batch"], row["seq"], row.get("probe"), row.get("memory_budget"))


def config_key(row: dict) -> tuple:
    """What a run trains: a probe step with the same key as a throughput run reuses its result."""
    return (row["system"], json.dumps(row["model"], sort_keys=True), row["batch"], row["seq"], row.get("memory_budget"))


def run_suite(name: str, suite: Suite, *, systems, dry_run: bool, probes: bool, timeout: int, out: Path,
              memory_budget=None, resume: bool = False, workloads: set[str] | None = None) -> dict:
    """Run the suite, writing the report after every run (a suite stopped half-way keeps what
    it measured). ``resume``: the report starts as the one in ``out``; its runs are not run
    again, but for its errors, which are run again if selected (and kept if not). ``workloads``:
    run only the throughput, several-process and study workloads of these labels (the study's is
    "<label> study"); None: all."""
    import torch

    device_type = suite.device
    if device_type == "cuda" and not dry_run and not torch.cuda.is_available():
        raise SystemExit(f"Suite {name!r} needs a CUDA GPU and this machine has none; run it with --dry-run to "
                         "construct every system and configuration without training, or choose --suite cpu-smoke.")
    chosen = [s for s in S.SYSTEMS if systems is None or s in systems]
    skipped = {s: why for s in chosen if (why := S.unavailable(s, device_type))}
    runnable = [s for s in chosen if s not in skipped]
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"suite": name, "description": suite.description, "dry_run": dry_run, "date": now(),
              "command": "python -m benchmarks.run " + " ".join(sys.argv[1:]), "machine": machine(suite.device),
              "precision": suite.precision, "warmup": suite.warmup, "steps": suite.steps,
              "skipped": skipped, "runs": [], "probes": [], "study": []}
    if resume and not dry_run and (out / "results.json").exists():
        old = json.loads((out / "results.json").read_text())
        if old["machine"].get("gpu") != report["machine"].get("gpu") or old["suite"] != name:
            raise SystemExit(f"{out} holds a report of suite {old['suite']} on {old['machine'].get('gpu', 'no GPU')}; "
                             f"resuming it with suite {name} on {report['machine'].get('gpu', 'no GPU')} would mix "
                             "them: give another --out.")
        for part in ("runs", "probes", "study"):
            report[part] = list(old.get(part, []))
        report["skipped"] = {**{s: why for s, why in old.get("skipped", {}).items() if s not in runnable}, **skipped}
    for s, why in skipped.items():
        print(f"skipped {s}: {why}", flush=True)
    rank = ordering(suite)

    def go(specs, probe=None, into="runs", limit=None):
        first = dict(specs[0], probe=probe)
        part = "probes" if probe else into
        done = [r for r in report[part] if run_key(r) == run_key(first) and r["status"] != "error"]
        same = [r for r in report["runs"] if probe and config_key(r) == config_key(first)]
        if len(specs) == 1 and done:
            print(f"  {first['system']:<24} {first['label']:<16} batch {first['batch']:<3} {done[0]['status']:<8} "
                  "(from the previous report)", flush=True)
            return done
        if len(specs) == 1 and same:
            rows = [dict(same[0], probe=probe)]
            print(f"  {first['system']:<24} {first['label']:<16} batch {first['batch']:<3} {rows[0]['status']:<8} "
                  "(the same run as above)", flush=True)
        else:
            rows = []
            for one, res in zip(specs, launch(specs, limit or timeout, log_dir)):
                row = summarise(one, res)
                what = f"{row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else row.get("error", "")
                print(f"  {one['system']:<24} {one['label']:<16} batch {one['batch']:<3} {row['status']:<8} {what}",
                      flush=True)
                rows.append(dict(row, probe=probe) if probe else row)
        keys = {run_key(r) for r in rows}  # an error of the previous report, run again
        report[part] = sorted([r for r in report[part] if run_key(r) not in keys] + rows, key=rank)
        write(report, out)
        return rows

    def spec(system, w, **kw):
        return spec_of(suite, system, w, memory_budget=memory_budget, **kw)

    probe_systems = [s for s in runnable if suite.probe_systems is None or s in suite.probe_systems]
    if dry_run:  # one process constructs every system's configurations on the meta device
        specs = []
        for system in runnable:
            specs += [spec(system, w, dry_run=True) for w in suite.workloads if w.systems is None or system in w.systems]
            if probes and system in probe_systems:
                specs += [spec(system, w, dry_run=True) for w in suite.model_ladder + suite.batch_ladder]
        if specs:
            go(specs)
        return report
    for w in suite.workloads + multi_workloads(suite):
        for system in runnable:
            if (w.systems is None or system in w.systems) and (workloads is None or w.label in workloads):
                go([spec(system, w, dry_run=False)])
    study = study_workload(suite)
    if study is not None and "protrain-core" in runnable and (workloads is None or study.label in workloads):
        # its timed steps, then every other plan's and the timeline's: twice a run's time limit
        go([spec_of(suite, "protrain-core", study, dry_run=False, study=True,
                    memory_budget=memory_budget or suite.study_budget)], into="study", limit=2 * timeout)
    if probes:
        for kind, ladder in (("max model", suite.model_ladder), ("max batch", suite.batch_ladder)):
            for system in probe_systems:
                for w in ladder:  # ascending; the first failure ends the probe
                    budget = memory_budget or (suite.probe_budget if system.startswith("protrain") else None)
                    (row,) = go([spec_of(suite, system, w, dry_run=False, steps=2, warmup=suite.warmup,
                                         memory_budget=budget)], probe=kind)
                    if row["status"] != "ok":
                        break
    return report


def study_workload(suite: Suite) -> Workload | None:
    return suite.study and dataclasses.replace(suite.study, label=f"{suite.study.label} study")


def ordering(suite: Suite):
    """Sort key of a report's rows: the suite's order of workloads (ladders for probes), then
    of systems."""
    labels = [w.label for w in suite.workloads + suite.multi]
    ladders = {"max model": [w.label for w in suite.model_ladder], "max batch": [w.label for w in suite.batch_ladder]}

    def key(row):
        label, order = row["label"], ladders.get(row.get("probe"), labels)
        for w in suite.multi:  # "... all GPUs" is run as "... xN GPUs"
            if label.startswith(w.label.replace("all GPUs", "x")):
                label = w.label
        where = order.index(label) if label in order else len(order)
        system = S.SYSTEMS.index(row["system"]) if row["system"] in S.SYSTEMS else len(S.SYSTEMS)
        return (row.get("probe") or "", where, system, row["batch"])

    return key


def multi_workloads(suite: Suite) -> tuple[Workload, ...]:
    """The suite's several-process rows this machine can run: on a GPU suite with 2+ GPUs (every
    GPU: ``devices=0``), on the CPU always (gloo)."""
    if suite.device != "cuda":
        return suite.multi
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return ()
    return tuple(dataclasses.replace(w, devices=w.devices or n, label=w.label.replace("all GPUs", f"x{n} GPUs"))
                 for w in suite.multi)


# ----- the report --------------------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine(device_type: str) -> dict:
    import torch

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpu_model(), "cpu_threads": os.cpu_count(), "host_ram_gib": round(total_host_bytes() / 2**30, 1)}
    for dist in ("transformers", "lightning", "deepspeed", "torchao"):
        try:  # (from the installed metadata: importing lightning or deepspeed takes seconds)
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device_type == "cpu":
        info["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", CPU_MMAP_THRESHOLD)
    if device_type == "cuda" and torch.cuda.is_available():
        name, total = gpu_properties()
        info["gpu"] = f"{name}, {total / 2**30:.0f} GiB"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def gpu_properties() -> tuple[str, int]:
    """GPU 0's name and memory in bytes, asked in a process of its own: the runner then holds no
    CUDA context (nor the device memory one takes) while its runs train."""
    ask = "import torch; p = torch.cuda.get_device_properties(0); print(p.total_memory, p.name)"
    out = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    return out[1].strip(), int(out[0])


def cpu_model() -> str:
    """The CPU's name, with its family and model numbers (a VM's name may be only "AMD EPYC")."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
    except OSError:
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')}, model " \
           f"{fields.get('model', '?')})"


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def gib(n) -> str:
    return "—" if n is None else format_bytes(n)


def ms(s) -> str:
    return "—" if s is None else format_seconds(s)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"### `{report['command']}` — {report['date']}", "",
             f"{report['description']}. Machine: {m.get('gpu', 'no GPU')}; {m['cpu']} ({m['cpu_threads']} threads), "
             f"{m['host_ram_gib']} GiB RAM; torch {m['torch']}, transformers {m.get('transformers', '?')}, lightning "
             f"{m.get('lightning', '?')}" + (f", commit {m['commit']}" if "commit" in m else "") + ". "
             f"Precision {report['precision']}; {report['warmup']} warm-up + {report['steps']} timed steps.", ""]
    for system, why in report["skipped"].items():
        lines.append(f"- not run: **{system}** — {why}")
    if report["skipped"]:
        lines.append("")
    if report["dry_run"]:
        lines += ["Dry run: every configuration constructed (meta device), nothing trained.", "",
                  "| system | model | batch | status | note |", "|---|---|---|---|---|"]
        for r in report["runs"]:
            lines.append(f"| {r['system']} | {r['label']} | {r['batch']} | {r['status']} | "
                         f"{r.get('note') or r.get('error', '')} |")
        return "\n".join(lines) + "\n"
    lines += ["| model | system | status | tokens/s | TFLOPS | step median (min–max) | vs pytorch | peak device | "
              "peak host RSS | model states host / device | final loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ceiling = {r["label"]: r.get("tokens_per_s") for r in report["runs"] if r["system"] == "pytorch"}
    for r in report["runs"]:
        ok = "tokens_per_s" in r
        rel = f"{r['tokens_per_s'] / ceiling[r['label']]:.2f}x" if ok and ceiling.get(r["label"]) else "—"
        status = r["status"] if ok or r["status"] != "error" else f"error: {r.get('error', '')[:80]}"
        status = f"OOM: {r.get('error', '')[:80]}" if r["status"] == "oom" else status
        lines.append(
            f"| {r['label']} ({count(r['params'])}) | {r['system']} | {status} | "
            + (f"{r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | {ms(r['step_median_s'])} ({ms(r['step_min_s'])}–"
               f"{ms(r['step_max_s'])}) | {rel} | " if ok else "— | — | — | — | ")
            + f"{gib(r.get('peak_device_bytes'))} | {gib(r.get('peak_host_rss_bytes'))} | "
            + (f"{gib(r['states']['host'])} / {gib(r['states']['device'])} | " if r.get("states") else "— | ")
            + (f"{r['losses'][-1]:.4f} |" if r.get("losses") else "— |"))
    pro = [r for r in report["runs"] if r["system"].startswith("protrain") and "plan" in r]
    if pro:
        lines += ["", "ProTrain: plan, fidelity of the cost models, and the lower bound on step time", "",
                  "| model | system | plan | step: predicted / measured (error) | step: simulated (error) | "
                  "peak: predicted / measured | lower bound = max(compute, transfer, CPU Adam) | measured / bound | "
                  "host RSS peak in timed steps / planned host bytes + baseline |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in pro:
            measured_peak = r.get("peak_device_bytes") or r.get("peak_device_bytes_tracked")
            pred = r.get("predicted_step_s")
            err = f" ({(pred - r['step_median_s']) / r['step_median_s']:+.1%})" if pred and "step_median_s" in r else ""
            perr = (f" ({(r['predicted_peak_bytes'] - measured_peak) / measured_peak:+.1%})"
                    if measured_peak and r.get("predicted_peak_bytes") else "")
            b = r.get("bound")
            bound = (f"{ms(r['lower_bound_s'])} = max({ms(b['compute_s'])}, {ms(b['transfer_s'])}, "
                     f"{ms(b['cpu_adam_s'])})" if b and "lower_bound_s" in r else "—")
            plan = r["plan"] if r.get("searched", True) else f"{r['plan']} (the safe plan: still profiling)"
            sim = _simulated(dict(r, measured_step_s=r["step_median_s"]) if "step_median_s" in r else r)
            lines.append(f"| {r['label']} | {r['system']} | {plan} | {ms(pred)} / {ms(r.get('step_median_s'))}{err}"
                         f" | {sim} | {gib(r.get('predicted_peak_bytes'))} / {gib(measured_peak)}{perr} | {bound} | "
                         + (f"{r['vs_lower_bound']:.2f}x |" if "vs_lower_bound" in r else "— |")
                         + (f" {gib(r['steady_host_rss_bytes'])} / {gib(r['planned_host_bytes'])} + "
                            f"{gib(r['rss_baseline_bytes'])} = {r['rss_over_plan']:.3f}x (whole run "
                            f"{r['rss_over_plan_run']:.3f}x) |" if r.get("steady_host_rss_bytes") else " — |"))
    lines += study_markdown(report.get("study", []))
    if report["probes"]:
        lines += ["", "Probes (ascending; the first failure ends a probe)", "", "| probe | system | largest that trained | "
                  "first that failed |", "|---|---|---|---|"]
        for kind in ("max model", "max batch"):
            for system in dict.fromkeys(r["system"] for r in report["probes"] if r["probe"] == kind):
                tried = [r for r in report["probes"] if r["probe"] == kind and r["system"] == system]
                good = [r for r in tried if r["status"] == "ok"]
                bad = [r for r in tried if r["status"] != "ok"]
                def name(r):
                    return f"{r['label']} ({count(r['params'])})" if kind == "max model" else f"batch {r['batch']}"
                lines.append(f"| {kind} | {system} | {name(good[-1]) if good else 'none'} | "
                             + (f"{name(bad[0])}: {bad[0]['status']} |" if bad else "none of the ladder |"))
    return "\n".join(lines) + "\n"


def study_markdown(rows: list[dict]) -> list[str]:
    """The study run: the cost models across plans, and the timeline's overlap."""
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines += ["", f"Study run ({r['label']}): {r['status']}: {r.get('error', '')[:200]}"]
            continue
        lines += ["", f"Study run ({r['label']}, memory budget {r.get('memory_budget') or 'default'}): the cost models "
                  "across the plans that fit (the best at each number of persistent chunks)", "",
                  "| plan | step: predicted / measured (error) | step: simulated (error) | "
                  "peak: predicted / measured (error) |", "|---|---|---|---|"]
        for p in r.get("plans", []):
            sim = _simulated(p)
            if "measured_step_s" not in p:
                lines.append(f"| {p['plan']} | {ms(p['predicted_step_s'])} / {p['status']}: {p['error'][:120]} | {sim} | "
                             f"{gib(p['predicted_peak_bytes'])} / — |")
                continue
            err = (p["predicted_step_s"] - p["measured_step_s"]) / p["measured_step_s"]
            perr = (p["predicted_peak_bytes"] - p["measured_peak_bytes"]) / p["measured_peak_bytes"]
            lines.append(f"| {p['plan']}{' (searched)' if p['searched'] else ''} | {ms(p['predicted_step_s'])} / "
                         f"{ms(p['measured_step_s'])} ({err:+.1%}) | {sim} | {gib(p['predicted_peak_bytes'])} / "
                         f"{gib(p['measured_peak_bytes'])} ({perr:+.1%}) |")
        tl = r.get("timeline")
        if tl:
            busy = ", ".join(f"{lane} {ms(sum(s['end'] - s['start'] for s in tl['spans'] if s['lane'] == lane))}"
                             for lane in tl["lanes"])
            lines += ["", f"Timeline of one step ({tl['plan']}, {tl['overlap']}, CPU Adam "
                      f"{'in the worker thread' if tl['threaded'] else 'inline'}): busy time per lane: {busy}."
                      + (f" {r['adam_in_backward']:.0%} of the CPU Adam time ran while backward was running."
                         if r.get("adam_in_backward") is not None else "")]
        elif r.get("timeline_error"):
            lines += ["", f"Timeline: not recorded: {r['timeline_error']}"]
    return lines


def _simulated(p: dict) -> str:
    """The study plan's simulated step (protrain_core/simulator) and its distance to the measured one."""
    if "simulated_step_s" not in p:
        return f"not simulated: {p['simulation_error'][:80]}" if p.get("simulation_error") else "—"
    if "measured_step_s" not in p:
        return ms(p["simulated_step_s"])
    return f"{ms(p['simulated_step_s'])} ({(p['simulated_step_s'] - p['measured_step_s']) / p['measured_step_s']:+.1%})"


def adam_in_backward(timeline: dict) -> float | None:
    """The fraction of the CPU Adam's time that falls inside the backward phase."""
    backward = [(s["start"], s["end"]) for s in timeline["spans"] if s["lane"] == "compute" and s["label"] == "backward"]
    adam = [(s["start"], s["end"]) for s in timeline["spans"] if s["lane"] == "CPU Adam"]
    total = sum(e - b for b, e in adam)
    if not backward or not total:
        return None
    inside = sum(max(0.0, min(e, be) - max(b, bb)) for b, e in adam for bb, be in backward)
    return inside / total


def write(report: dict, out: Path) -> list[Path]:
    """results.json and results.md, then the figures (benchmarks/figures.py); returns the
    figures written (none without matplotlib: ``report["figures"]`` says why)."""
    from benchmarks import figures

    out.mkdir(parents=True, exist_ok=True)
    written, report["figures"] = [], None

    def tables():
        for name, text in (("results.json", json.dumps(report, indent=1)), ("results.md", markdown(report))):
            write_text(out / name, text)

    tables()  # first: a figure that cannot be drawn loses no result
    if report["dry_run"]:
        return written
    try:
        written = figures.write_figures(report, out)
        report["figures"] = [p.name for p in written]
    except figures.FiguresUnavailable as exc:
        report["figures"] = str(exc)
    except Exception as exc:  # noqa: BLE001 -- reported, and the tables are written
        report["figures"] = f"drawing the figures failed: {type(exc).__name__}: {exc}"
    tables()
    return written


def write_text(path: Path, text: str) -> None:
    """Atomically (a temporary file, then a rename), with the mode the umask gives new files."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, new_file_mode())
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", required=True, choices=sorted(SUITES))
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<suite>")
    ap.add_argument("--systems", default=None, help=f"comma-separated subset of {', '.join(S.SYSTEMS)}")
    ap.add_argument("--dry-run", action="store_true", help="construct every system and configuration, train nothing")
    ap.add_argument("--no-probes", action="store_true", help="skip the max-model-size and max-batch-size probes")
    ap.add_argument("--timeout", type=int, default=None, help="seconds per run (default: the suite's)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs of the report already in --out (all but errors) and run the rest")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated labels of the workloads to run (as in the table; the study run's is "
                         "'<label> study'); '' for none (the probes alone)")
    ap.add_argument("--memory-budget", default=None,
                    help="device memory ProTrain's search may use, e.g. 40GiB (default: free memory minus a margin)")
    args = ap.parse_args(argv)
    systems = None
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = sorted(set(systems) - set(S.SYSTEMS))
        if unknown:
            ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(S.SYSTEMS)}")
    if args.memory_budget is not None:
        from protrain_core.utils import parse_bytes

        try:
            parse_bytes(args.memory_budget)
        except ValueError as exc:
            ap.error(str(exc))
    suite = SUITES[args.suite]
    # (absolute: the systems run with the repository as their working directory)
    out = args.out.resolve() if args.out else ROOT / "benchmarks" / "results" / (
        args.suite + ("-dry-run" if args.dry_run else ""))
    print(f"suite {args.suite}: {suite.description}", flush=True)
    workloads = None if args.workloads is None else {w.strip() for w in args.workloads.split(",") if w.strip()}
    if workloads:
        study = study_workload(suite)
        known = {w.label for w in suite.workloads + multi_workloads(suite)} | ({study.label} if study else set())
        if workloads - known:
            ap.error(f"unknown workload(s) {', '.join(sorted(workloads - known))}; choose from {', '.join(sorted(known))}")
    # The GPU session (benchmarks.gpu_session) stops a runner that outlasts its piece with SIGTERM:
    # the run in flight is killed with it (launch), and every run before it is in the report.
    signal.signal(signal.SIGTERM, _stopping)
    report = run_suite(args.suite, suite, systems=systems, dry_run=args.dry_run, probes=not args.no_probes,
                       timeout=args.timeout or suite.timeout_s, out=out, memory_budget=args.memory_budget,
                       resume=args.resume, workloads=workloads)
    written = write(report, out)
    print(markdown(report))
    print(f"written: {', '.join(str(p) for p in [out / 'results.json', out / 'results.md', *written])}")
    if isinstance(report["figures"], str):
        print(f"no figures: {report['figures']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
