"""Hardware probes: chunk-size copies each way and Adam on one chunk, as the runtime does them.

The probes run through the engine's DeviceContext -- its copy streams, its CPU worker, its clock --
so on a simulated device (protrain_core/simulator) they measure the simulation's figures by the
same path: the profile then describes the device the run will see.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import torch

from protrain_core.chunk_format import moment_dtype
from protrain_core.memtrack import on_host
from protrain_core.planner.profiles import Hardware
from protrain_core.precision import Precision
from protrain_core.runtime.device import DeviceContext, as_context, cpu_worker_placement
from protrain_core.runtime.frozen_formats import dequantise_into, quantised_dtype
from protrain_core.runtime.host_pool import PageLocked
from protrain_core.runtime.options import RuntimeConfig
from protrain_core.runtime.sharding import ONE_PROCESS, Sharding
from protrain_core.runtime.state_formats import moment_step
from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision, onepass


def _median_time(ctx: DeviceContext, fn, sync, *, budget_s: float = 0.15, max_reps: int = 20) -> float:
    fn()
    sync()
    times = []
    while len(times) < max_reps and (len(times) < 3 or sum(times) < budget_s):
        t = ctx.clock()
        fn()
        sync()
        times.append(ctx.clock() - t)
    return statistics.median(times)


def probe_hardware(device: torch.device | DeviceContext, chunk_elems: int, precision: Precision, *,
                   sharding: Sharding = ONE_PROCESS, switches: RuntimeConfig | None = None, state_format: str = "fp32",
                   frozen_format: str | None = None) -> Hardware:
    """Chunk-size copies each way and Adam on one chunk, as the runtime performs them (and with
    ``sharding``, a chunk's all-gather and reduce-scatter: every rank must call it): the CPU
    Adam on the engine's CPU worker (``_adam_rate``), the device Adam on device tensors; on a CPU
    device the "copies" are the runtime's memory copies between two host tensors, and the
    persistent chunks' Adam is the same CPU kernel. ``switches``: the engine's (pinned host
    memory, the one-pass kernel). ``state_format``: the Adam moments' format, which the updates
    are timed in ([Note: optimizer-state formats]); ``frozen_format``: frozen weights kept in 8
    bits, whose dequantisation after an upload is timed on the device ([Note: quantised frozen
    chunks])."""
    switches = switches or RuntimeConfig()
    ctx = as_context(device)
    n = max(1024, min(chunk_elems, 64 * 2**20))
    cdt = precision.compute_dtype
    low = cdt if precision.is_mixed else None
    h2d, d2h = _copy_rates(ctx, n, cdt, switches.pins(ctx))
    worker = ctx.worker(ctx.asynchronous, cpu_worker_placement(ctx, sharding.world, switches.worker_cores))
    try:
        with on_host():
            cpu_rate, land_rate, pass_rate = _adam_rate(ctx, n, ctx.host, low,
                                                        lambda fn: worker.submit(fn).result(), parts=True,
                                                        kernel=switches.one_pass_kernel, state_format=state_format,
                                                        update=lambda: ctx.host_update(n, state_format))
    finally:
        worker.shutdown()
    dev_rate = (_adam_rate(ctx, n, ctx.device, low, lambda fn: fn(), state_format=state_format)[0]
                if ctx.asynchronous else cpu_rate)
    gather, reduce = (0.0, 0.0) if sharding.whole else collective_rates(sharding, ctx, n, cdt)
    return Hardware(
        gather_bytes_per_s=gather, reduce_bytes_per_s=reduce,
        device=ctx.name(), async_copies=ctx.asynchronous,
        h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        cpu_adam_params_per_s=cpu_rate,
        cpu_land_params_per_s=land_rate,
        cpu_pass_params_per_s=pass_rate,
        device_adam_params_per_s=dev_rate,
        device_memory_bytes=int(ctx.free_memory()[1]),
        dequant_params_per_s=0.0 if frozen_format is None else _dequant_rate(ctx, n, cdt, frozen_format),
        page_lock_bytes_per_s=_page_lock_rate(ctx, n * cdt.itemsize) if switches.pins(ctx) else 0.0,
    )


def _copy_rates(ctx: DeviceContext, n: int, cdt: torch.dtype, pin: bool) -> tuple[float, float]:
    """Bytes per second of an ``n``-element copy each way, as the runtime copies a chunk."""
    with on_host():
        host = torch.empty(n, dtype=cdt, device=ctx.host, pin_memory=pin)
    dev = torch.empty(n, dtype=cdt, device=ctx.device)
    host.fill_(1)
    if ctx.asynchronous:
        copies = (lambda: ctx.copy_async(dev, host, stream=ctx.h2d_stream, span=("host->device", "probe")),
                  lambda: ctx.copy_async(host, dev, stream=ctx.d2h_stream, span=("device->host", "probe")))
    else:
        # The CPU runtime allocates a chunk's "device" buffer (and gradient buffer) anew for
        # every upload (and offload): fresh pages, so the probe allocates too.
        copies = (lambda: torch.empty(n, dtype=cdt).copy_(host), lambda: host.copy_(torch.zeros(n, dtype=cdt)))
    return tuple(n * cdt.itemsize / _median_time(ctx, copy, ctx.synchronize_device) for copy in copies)


def _page_lock_rate(ctx: DeviceContext, nbytes: int) -> float:
    """Bytes per second of page-locking fresh host memory in place, as ``HostPool`` does for a
    streamed chunk (the first touch of its pages included): the median of three."""
    return nbytes / _median_time(
        ctx, lambda: PageLocked(nbytes, device=ctx.device, what="the registration probe").close(), lambda: None,
        budget_s=0.05, max_reps=3)


def _dequant_rate(ctx: DeviceContext, n: int, cdt: torch.dtype, fmt: str) -> float:
    """Elements per second of ``dequantise_into`` on the device (the runtime's kernels after a
    quantised upload), on ``n`` elements in rows of 4096."""
    cols = min(n, 4096)
    rows = max(1, n // cols)
    q = torch.zeros(rows * cols, dtype=quantised_dtype(fmt), device=ctx.device)
    scales = torch.ones(rows, dtype=torch.float32, device=ctx.device)
    out = torch.empty(rows, cols, dtype=cdt, device=ctx.device)
    return rows * cols / _median_time(ctx, lambda: dequantise_into(out, q, scales), ctx.synchronize_device)


def _adam_rate(ctx: DeviceContext, n: int, on: torch.device, low: torch.dtype | None, run, *,
               parts: bool = False, kernel: bool = True, state_format: str = "fp32",
               update=contextlib.nullcontext) -> tuple[float, float, float]:
    """Parameters per second of one chunk's update on ``on`` as the runtime runs it (``run(fn)``:
    where; ``update()``: the context it runs in, ``DeviceContext.host_update`` on the worker):
    Adam, and with a low-precision compute dtype ``low`` the landing of the gradients into the
    accumulator before and the compute copy written from the master after (the host side does
    both). With ``parts``, also the landing alone (0 without one) and one elementwise pass over
    the fp32 gradients in place (clipping's), which the cost model charges where the runtime
    runs them ([Note: the overlap under clipping and fp16] in update.py); else (rate, 0, 0).
    Where the host's update runs in one pass (protrain_ops/onepass.py, every moment format),
    that pass is timed, and the landing's part is half of the one-pass landing (fold and copy
    restored), which the cost model charges twice where the update waits."""
    one_pass = onepass.kernel() if kernel and on.type == "cpu" else None
    p, g = (torch.zeros(n, device=on) for _ in range(2))
    m, v = (torch.zeros(n, device=on, dtype=moment_dtype(state_format, torch.float32)) for _ in range(2))
    moments = moment_step(state_format, n, on, kernel=one_pass)
    steps = [torch.zeros((), device=on)]
    copy = torch.zeros(n, dtype=low, device=on) if low is not None else None
    g.fill_(1e-3)
    hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    landing = copy is not None and on == ctx.host
    kernel = one_pass if landing else None

    def land():
        if kernel is not None:
            onepass.land(kernel, [p], [copy], [g], accumulate=False)
        else:
            g.copy_(copy)

    def step():
        with update():
            if kernel is not None and moments is not None:
                moments(p, g, hp, low=copy)
            elif kernel is not None:
                onepass.update(kernel, [p], [copy], [g], [m], [v], [], steps, hp, coef=None, clamp=None, landed=True,
                               accumulate=False)
            else:  # separate passes
                if landing:
                    land()
                if moments is not None:
                    moments(p, g, hp)
                else:
                    adam_step([p], [g], [m], [v], [], steps, hp)
                if copy is not None:
                    copy_to_low_precision(copy, p)

    def rate(fn, **budget) -> float:
        return n / _median_time(ctx, lambda: run(fn), ctx.synchronize_device, **budget)

    if not parts:
        return rate(step), 0.0, 0.0
    short = dict(budget_s=0.05, max_reps=10)  # the parts are a few memory passes each
    land_rate = (rate(land, **short) * (2 if kernel is not None else 1)) if landing else 0.0
    return rate(step), land_rate, rate(lambda: torch._foreach_mul_([g], 1.0), **short)


def collective_rates(sharding, ctx: DeviceContext, n: int, dtype: torch.dtype) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes per second on a chunk of ``n`` elements, as the runtime
    runs them (in place / into a shard, the gradients scaled for the mean as they landed). A
    fixed number of repetitions (every rank must issue the same collectives), the median, and
    the slowest rank's figure (all-reduced), so every rank plans with the same numbers."""
    world, device = sharding.world, ctx.device
    n = max(world, n // world * world)
    full = torch.ones(n, dtype=dtype, device=device)
    out = torch.empty(n // world, dtype=dtype, device=device)

    def timed(fn) -> float:  # no time budget: every rank runs the same count
        return _median_time(ctx, lambda: ctx.synchronize(ctx.collective(fn)), ctx.synchronize_device,
                            budget_s=math.inf, max_reps=5)

    seconds = sharding.max_on_host([timed(lambda: sharding.gather_(full)),
                                    timed(lambda: sharding.reduce_scatter_mean(out, full, scaled=True))])
    nbytes = n * dtype.itemsize
    return nbytes / max(float(seconds[0]), 1e-9), nbytes / max(float(seconds[1]), 1e-9)
