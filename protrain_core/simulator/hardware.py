"""What a simulated device is made of: every figure the simulation uses, with its source.

``DeviceSpec`` is the one place these numbers live; the simulated device (device.py) reads
nothing else. Presets: ``H100`` (SXM5 80 GB with a PCIe Gen5 x16 host link) and ``H200``, or a
JSON file of changes to one (``load_spec``); ``cpu_spec(profile)`` describes the CPU device from
a profile's measured figures ([Note: the simulated device] in device.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
OP_CLASSES = (  # (class, substrings of aten operator names), the first match wins
    ("attention", ("attention", "flash", "sdpa")),
    ("matmul", ("mm", "matmul", "linear")),
    ("optimizer", ("fused_adam",)),
    ("normalisation", ("rsqrt", "pow", "mean", "norm")),
    ("copies", ("copy", "_to_copy", "cat", "contiguous")),
    ("elementwise", ("add", "mul", "silu", "neg", "div", "sub", "where", "exp", "log", "softmax", "cross_entropy")),
)


@functools.lru_cache(maxsize=None)
def op_class(name: str) -> str:
    """The class of an aten operator ``name`` ("aten::mm" or "mm"): one of ``OP_CLASSES``, else
    "other". A trace (benchmarks/bench_calibration.py) and the simulated device sort by it."""
    bare = name.removeprefix("aten::")
    return next((c for c, keys in OP_CLASSES if any(k in bare for k in keys)), "other")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device to simulate and the host around it.

    Attributes:
        name: what reports call it.
        asynchronous: a GPU: streams run beside the host thread, copies on copy engines, the CPU
            worker on a thread of its own. False: the CPU device, where the runtime copies and
            updates inline and compute is what it measures (``cpu_spec``).
        tensor_flops_per_s: matmuls and attention in bf16/fp16 (tensor cores), achieved.
        fp32_flops_per_s: matmuls in fp32 (PyTorch's default keeps TF32 off), achieved.
        memory_bytes_per_s: device memory bandwidth, achieved: every other kernel is charged
            its bytes read and written over it.
        op_class_factor: each operator class's device time over its roofline time (``op_class``;
            a class not given: 1), fitted from a traced plain-PyTorch step on the device
            (``python -m benchmarks.bench_calibration --fit``): kernels short of the roofline,
            and the casts and reductions the roofline's byte count misses.
        kernel_s: the least time of one kernel on the device.
        launch_s: host time to issue one operator (eager PyTorch: dispatch and launch).
        launch_queue: operators a stream holds issued and not yet finished; the host issuing one
            more waits until the oldest finishes.
        h2d_bytes_per_s, d2h_bytes_per_s: pinned host <-> device copies, each direction on its
            own copy engine (full duplex when they run on separate streams).
        copy_latency_s: fixed cost of one copy.
        collective_bytes_per_s: bus bandwidth of all-gather and reduce-scatter between the
            simulated ranks (a ring moves (W-1)/W of the buffer per rank; all-reduce twice that).
        collective_latency_s: fixed cost of one collective.
        host_collective_s: one blocking host-side agreement between ranks (gloo, a few bytes).
        cpu_adam_params_per_s: the CPU worker's whole update of a streamed chunk (the landing
            folded, Adam, the compute copy written: one pass where protrain_ops' kernel runs),
            parameters per second, by the moments' format ("fp32", "bf16", "8bit"), as
            ``benchmarks.bench_adam`` and the profiler's probe measure it.
        host_memory_bytes_per_s: the CPU worker's other work (a landing folded before the
            update, norms), charged its bytes over this bandwidth.
        cpu_op_s: the CPU worker's overhead per operator.
        device_memory_bytes, host_memory_bytes: the memory of the device and of the host.
        sources: where each figure comes from.
    """

    name: str
    asynchronous: bool = True
    tensor_flops_per_s: float
    fp32_flops_per_s: float
    memory_bytes_per_s: float
    op_class_factor: dict[str, float] = field(default_factory=dict)
    kernel_s: float
    launch_s: float
    launch_queue: int = 1024
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    copy_latency_s: float
    collective_bytes_per_s: float
    collective_latency_s: float
    host_collective_s: float
    cpu_adam_params_per_s: dict[str, float]
    host_memory_bytes_per_s: float
    cpu_op_s: float
    device_memory_bytes: int
    host_memory_bytes: int
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        rates = [f.name for f in dataclasses.fields(self) if f.name.endswith("_per_s") and f.name != "cpu_adam_params_per_s"]
        bad = [n for n in rates if not getattr(self, n) > 0]
        update = self.cpu_adam_params_per_s
        if not isinstance(update, dict) or not update or not all(v > 0 for v in update.values()):
            bad.append("cpu_adam_params_per_s (by moments' format, e.g. {\"fp32\": 2.2e9})")
        classes = {c for c, _ in OP_CLASSES} | {"other"}
        if not all(c in classes and f > 0 for c, f in self.op_class_factor.items()):
            bad.append(f"op_class_factor (by operator class: {', '.join(sorted(classes))})")
        bad += [n for n in ("kernel_s", "launch_s", "copy_latency_s", "collective_latency_s", "host_collective_s",
                            "cpu_op_s") if getattr(self, n) < 0]
        bad += [n for n in ("device_memory_bytes", "host_memory_bytes", "launch_queue") if getattr(self, n) <= 0]
        if bad:
            raise ValueError(f"DeviceSpec {self.name!r}: {', '.join(bad)} must be positive numbers (rates, memory) "
                             "or >= 0 (times).")

    def cpu_update_rate(self, state_format: str) -> float:
        """Parameters per second of the CPU worker's update of a chunk with moments in ``state_format``."""
        rate = self.cpu_adam_params_per_s.get(state_format)
        if rate is None:
            raise ValueError(f"DeviceSpec {self.name!r} has no CPU update rate for moments in format "
                             f"{state_format!r} (cpu_adam_params_per_s gives {sorted(self.cpu_adam_params_per_s)}); "
                             "add it, or simulate another format.")
        return rate


# The GPU machines this project is lent (shared/GPU_NOTES.md): one H100 80 GB or one H200 141 GB,
# 16 CPU cores and 128 GiB of host memory each.
_SHARED_SOURCES = (
    "launch_s 5 us: eager PyTorch's host cost per operator (dispatcher and cudaLaunchKernel), an order of "
    "magnitude, assumed",
    "kernel_s 3 us: the shortest kernels' duration on Hopper, assumed",
    "launch_queue 1,024 operators per stream: the depth of CUDA's queue of pending launches as commonly reported, "
    "assumed (to be measured on the GPU box)",
    "h2d/d2h 50 GB/s each way: PCIe Gen5 x16 is 63 GB/s per direction (32 GT/s x 16 lanes, 128b/130b); pinned "
    "copies reach about 80 % of it, assumed (the profiler's probe measures it on the machine)",
    "copy_latency_s 10 us per copy, assumed",
    "collective_bytes_per_s 350 GB/s: NVLink 4 gives 450 GB/s per direction per GPU (NVIDIA H100 datasheet: "
    "900 GB/s total); NCCL all-gather / reduce-scatter bus bandwidth about 350 GB/s on 8 GPUs (nccl-tests), assumed",
    "collective_latency_s 20 us, host_collective_s 50 us (gloo between local processes), assumed",
    "cpu_adam_params_per_s fp32 2.2e9: memory-bound fused AdamW at 3e9 parameters/s on the 16-core host (the "
    "figure the cost-model studies use, update.py) with the landing and the copy back, 12 bytes a parameter at "
    "100 GB/s, assumed; bf16 3.0e9 and 8bit 2.1e9: fp32's times the ratios bench_adam measured on the 2-core Zen 5 "
    "VM with 2 threads (1.35x, 0.96x; benchmarks/HISTORY.md); benchmarks.gpu_session's cpu-adam piece measures them on "
    "the GPU box",
    "host_memory_bytes_per_s 100 GB/s and cpu_op_s 5 us for the worker's other operators, assumed",
    "host_memory_bytes 128 GiB: the lent machines",
)

H100 = DeviceSpec(
    name="simulated NVIDIA H100 80GB HBM3 (PCIe Gen5 x16 host link)",
    tensor_flops_per_s=790e12,
    fp32_flops_per_s=53.5e12,
    memory_bytes_per_s=3.0e12,
    kernel_s=3e-6,
    launch_s=5e-6,
    h2d_bytes_per_s=50e9,
    d2h_bytes_per_s=50e9,
    copy_latency_s=10e-6,
    collective_bytes_per_s=350e9,
    collective_latency_s=20e-6,
    host_collective_s=50e-6,
    cpu_adam_params_per_s={"fp32": 2.2e9, "bf16": 3.0e9, "8bit": 2.1e9},
    host_memory_bytes_per_s=100e9,
    cpu_op_s=5e-6,
    device_memory_bytes=78 * GIB,
    host_memory_bytes=128 * GIB,
    sources=(
        "tensor_flops_per_s 790 TFLOP/s: bf16 matmul measured on the lent H100 (shared/GPU_NOTES.md); the "
        "datasheet's dense peak is 989 TFLOP/s",
        "op_class_factor: none (every class at its roofline): no plain-PyTorch step was traced on an H100",
        "fp32_flops_per_s 53.5 TFLOP/s: the datasheet's 67 TFLOP/s FP32 (SXM5) at the same 80 % of peak",
        "memory_bytes_per_s 3.0 TB/s: device-to-device copy measured on the lent H100 (shared/GPU_NOTES.md); the "
        "datasheet's HBM3 peak is 3.35 TB/s",
        "device_memory_bytes 78 GiB: what the device tool reports for the lent H100",
        *_SHARED_SOURCES,
    ),
)

# Measured on the lent H200 (benchmarks/results/h200-2026-11-29, commit 0acb1b3): plain PyTorch and
# microbenchmarks only; ProTrain's rows of that session are the hold-out (benchmarks/holdout).
H200 = dataclasses.replace(
    H100,
    name="simulated NVIDIA H200 141GB HBM3e (PCIe Gen5 x16 host link)",
    memory_bytes_per_s=4.3e12,
    op_class_factor={"attention": 1.58, "copies": 1.78, "elementwise": 1.26, "matmul": 0.99, "normalisation": 0.5,
                     "optimizer": 2.17, "other": 0.67},
    h2d_bytes_per_s=54.3e9,
    d2h_bytes_per_s=54.3e9,
    cpu_adam_params_per_s={"fp32": 2.92e9, "bf16": 3.67e9, "8bit": 1.20e9},
    device_memory_bytes=139 * GIB,
    sources=(
        "tensor_flops_per_s, fp32_flops_per_s: as the H100 (the same SXM5 compute; NVIDIA H200 datasheet)",
        "memory_bytes_per_s 4.3 TB/s: device-to-device copy measured on the lent H200 (shared/GPU_NOTES.md); the "
        "datasheet's HBM3e peak is 4.8 TB/s",
        "op_class_factor: TinyLlama-1.1B's plain-PyTorch step (8 x 1024, bf16 autocast, fused AdamW) traced on the "
        "lent H200, calibration.json of benchmarks/results/h200-2026-11-29, fitted by python -m "
        "benchmarks.bench_calibration --fit",
        "h2d/d2h 54.3 GB/s each way: 256 MiB copies from ProTrain's registered host pool on the lent H200 "
        "(transfer.json, same folder; both directions at once moved 98.7 GB/s in all)",
        "cpu_adam_params_per_s fp32 2.92e9, bf16 3.67e9, 8bit 1.20e9: a streamed chunk's whole update with 16 "
        "threads on the lent H200's host, no copies beside it (cpu-adam.json, same folder); the engine's worker "
        "runs 15 threads beside the copies, and whether that kernel was built with AVX-512 VBMI (the 8-bit "
        "permutes) was not recorded",
        "device_memory_bytes 139 GiB: what the device tool reports for the lent H200",
        *(s for s in _SHARED_SOURCES if not s.startswith(("h2d/d2h", "cpu_adam"))),
    ),
)

PRESETS = {"h100": H100, "h200": H200}


def load_spec(name_or_path: str | Path | DeviceSpec) -> DeviceSpec:
    """A preset by name ("h100", "h200"), or a JSON file: ``{"base": "h100", "h2d_bytes_per_s":
    25e9, ...}`` (every field not given comes from the base preset; without a base, every
    field must be given)."""
    if isinstance(name_or_path, DeviceSpec):
        return name_or_path
    key = str(name_or_path).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"Unknown hardware {name_or_path!r}: use one of {', '.join(PRESETS)} or a JSON file of "
                         "DeviceSpec fields (with \"base\": a preset to start from).")
    fields = json.loads(path.read_text())
    base = fields.pop("base", None)
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{path}: unknown DeviceSpec fields {unknown}; the fields are {sorted(known)}.")
    fields["sources"] = tuple(fields.get("sources", (f"{path}",)))
    if base is not None:
        base_spec = load_spec(base)
        for by_key in ("cpu_adam_params_per_s", "op_class_factor"):  # the keys it gives, the base's others
            if isinstance(fields.get(by_key), dict):
                fields[by_key] = {**getattr(base_spec, by_key), **fields[by_key]}
        return dataclasses.replace(base_spec, name=fields.pop("name", f"{base_spec.name} ({path.name})"), **fields)
    missing = sorted(f.name for f in dataclasses.fields(DeviceSpec)
                     if f.name not in fields and f.default is f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{path}: fields {missing} are missing; give them, or \"base\": one of {', '.join(PRESETS)}.")
    return DeviceSpec(**fields)


def cpu_spec(hardware, state_format: str = "fp32", *, name: str = "the CPU device (measured figures)") -> DeviceSpec:
    """The CPU device as a simulated device, from a profile's measured hardware figures
    (``Profile.hardware``, timed with moments in ``state_format``): copies at the measured
    bandwidths, the CPU update at the measured rate, compute and host work as they run (there is
    no other device to model on a CPU)."""
    return DeviceSpec(
        name=name, asynchronous=False, tensor_flops_per_s=1.0, fp32_flops_per_s=1.0, memory_bytes_per_s=1.0,
        kernel_s=0.0, launch_s=0.0, h2d_bytes_per_s=hardware.h2d_bytes_per_s, d2h_bytes_per_s=hardware.d2h_bytes_per_s,
        copy_latency_s=0.0, collective_bytes_per_s=1.0, collective_latency_s=0.0, host_collective_s=0.0,
        cpu_adam_params_per_s={state_format: hardware.cpu_adam_params_per_s},
        host_memory_bytes_per_s=hardware.d2h_bytes_per_s, cpu_op_s=0.0, device_memory_bytes=int(hardware.device_memory_bytes),
        host_memory_bytes=int(hardware.device_memory_bytes),
        sources=("copies, the CPU update: the profile's probes on this machine (profiler/hardware.py); compute and host "
                 "work: as measured while the simulation runs",),
    )


def preset_for(device_name: str) -> DeviceSpec:
    """The preset of a GPU by its name (``torch.cuda.get_device_name``): H200, else H100."""
    return H200 if "H200" in device_name.upper() else H100


def with_measured(spec: DeviceSpec, hardware, state_format: str = "fp32") -> DeviceSpec:
    """``spec`` with the figures a profile measured on the machine (``Profile.hardware``): the
    copy bandwidths each way and the CPU update's rate (moments in ``state_format``)."""
    return dataclasses.replace(
        spec, name=f"{spec.name}, with this machine's measured copies and CPU Adam",
        h2d_bytes_per_s=hardware.h2d_bytes_per_s, d2h_bytes_per_s=hardware.d2h_bytes_per_s,
        cpu_adam_params_per_s={**spec.cpu_adam_params_per_s, state_format: hardware.cpu_adam_params_per_s},
        sources=spec.sources + (f"h2d/d2h, cpu_adam_params_per_s[{state_format!r}]: measured by the profiler's probes",),
    )
