"""Hardware probes: chunk-size copies each way and Adam on one chunk, as the runtime does them."""

from __future__ import annotations

import platform
import statistics
import time

import torch

from protrain_core.planner.profiles import Hardware
from protrain_core.precision import Precision
from protrain_core.utils import total_host_bytes
from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _median_time(fn, sync, *, budget_s: float = 0.15, max_reps: int = 20) -> float:
    fn()
    sync()
    times = []
    spent = 0.0
    while len(times) < max_reps and (len(times) < 3 or spent < budget_s):
        t = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return statistics.median(times)


def probe_hardware(device: torch.device, chunk_elems: int, precision: Precision, *, sharding=None) -> Hardware:
    """Chunk-size copies each way and Adam on one chunk, as the runtime performs them (and with
    ``sharding``, a chunk's all-gather and reduce-scatter: every rank must call it).

    CUDA: pinned host buffer <-> device buffer; CPU Adam on host tensors (plus the
    compute-dtype copy back in mixed precision, as the worker does); device Adam on device
    tensors. CPU device: the "copies" are what the runtime does there too, memory copies between
    two host tensors, and the persistent chunks' Adam is the same CPU kernel."""
    n = max(1024, min(chunk_elems, 64 * 2**20))
    cdt = precision.compute_dtype
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    host = torch.empty(n, dtype=cdt, pin_memory=cuda)
    dev = torch.empty(n, dtype=cdt, device=device)
    host.fill_(1)
    dev.fill_(1)
    nbytes = n * cdt.itemsize
    if cuda:
        h2d = nbytes / _median_time(lambda: dev.copy_(host, non_blocking=True), sync)
        d2h = nbytes / _median_time(lambda: host.copy_(dev, non_blocking=True), sync)
    else:
        # The CPU runtime allocates a chunk's "device" buffer (and gradient buffer) anew for
        # every upload (and offload): fresh pages, so the probe allocates too.
        h2d = nbytes / _median_time(lambda: torch.empty(n, dtype=cdt).copy_(host), sync)
        d2h = nbytes / _median_time(lambda: host.copy_(torch.zeros(n, dtype=cdt)), sync)
    del host, dev

    def adam_rate(on: torch.device, with_copy: bool) -> float:
        p, g, m, v = (torch.zeros(n, device=on) for _ in range(4))
        g.fill_(1e-3)
        steps = [torch.zeros((), device=on)]
        hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        low = torch.empty(n, dtype=cdt, device=on) if with_copy else None
        s = (lambda: torch.cuda.synchronize(on)) if on.type == "cuda" else (lambda: None)

        def step():
            adam_step([p], [g], [m], [v], [], steps, hp)
            if low is not None:
                copy_to_low_precision(low, p)

        return n / _median_time(step, s)

    mixed = precision.is_mixed
    cpu_rate = adam_rate(torch.device("cpu"), mixed)
    dev_rate = adam_rate(device, mixed) if cuda else cpu_rate
    total = torch.cuda.get_device_properties(device).total_memory if cuda else total_host_bytes()
    gather, reduce = (0.0, 0.0) if sharding is None else collective_rates(sharding, device, n, cdt)
    return Hardware(
        gather_bytes_per_s=gather,
        reduce_bytes_per_s=reduce,
        device=device_name(device),
        async_copies=cuda,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        cpu_adam_params_per_s=cpu_rate,
        device_adam_params_per_s=dev_rate,
        device_memory_bytes=int(total),
    )


COLLECTIVE_REPS = 5


def collective_rates(sharding, device: torch.device, n: int, dtype: torch.dtype) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes per second on a chunk of ``n`` elements, as the runtime
    runs them (in place / into a shard). A fixed number of repetitions (every rank must issue the
    same collectives), the median, and the slowest rank's figure (all-reduced), so every rank
    plans with the same numbers."""
    world = sharding.world
    n = max(world, n // world * world)
    full = torch.ones(n, dtype=dtype, device=device)
    out = torch.empty(n // world, dtype=dtype, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for _ in range(COLLECTIVE_REPS + 1):  # the first one warms up
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    seconds = torch.tensor([timed(lambda: sharding.gather_(full)),
                            timed(lambda: sharding.reduce_scatter_mean(out, full))], dtype=torch.float64)
    seconds = sharding.all_reduce_(seconds.to(device), torch.distributed.ReduceOp.MAX).cpu()
    nbytes = n * dtype.itemsize
    return nbytes / max(float(seconds[0]), 1e-9), nbytes / max(float(seconds[1]), 1e-9)
