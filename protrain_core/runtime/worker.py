"""The CPU worker: lands offloaded gradients in streamed chunks' accumulators and runs their Adam.

[Note: CPU Adam on a CPU device]
With CUDA the worker thread overlaps Adam with the device's backward. On a CPU device there is
nothing to overlap with, and two OpenMP thread teams on the same cores slow each other down far
more than Adam costs: Adam runs inline, at the same points (``RuntimeConfig.cpu_adam_thread``, or
PROTRAIN_CPU_ADAM_THREAD=1, keeps the thread).

[Note: CPU Adam threads]
On CUDA the worker thread and its intra-op threads (landing, Adam, copies back) run bound to the
cores of ``Placement`` ([Note: CPU worker placement] in topology.py), as does the profiler's CPU
Adam probe (``device.cpu_worker_placement``); the thread that drives the device keeps its own
count (1 under torchrun, which sets OMP_NUM_THREADS=1: a default that would leave the CPU Adam
on one core). On a CPU device they are left alone.

[Note: gradients consumed where they land]
In the mixed modes a streamed chunk's gradient lands in the trainable span of its host compute
copy, and the worker folds it into the chunk's fp32 accumulator before Adam reads it. When a
step has one backward and the chunk's Adam runs in the job that lands it, that accumulator holds
nothing but the landed gradient, only for that job: so a chunk may keep none
(``ProTrainConfig.grad_accumulator=False``; 4 bytes per trainable parameter less on the host).
The job then borrows the worker's *scratch*, one fp32 tensor of the largest trainable shard (the
jobs run one at a time). A job that lands without updating (a chunk spilled before all its
gradients came) gives the chunk a tensor of its own instead, kept until its update or
``zero_grad`` (``return_accumulator``); so does a persistent chunk streamed with gradients not
cleared. Gradients an update consumed are gone (``ChunkStorage.gradients_consumed``, until
``zero_grad``): a backward or a step that would use them again is refused, as are the settings
that would land without updating at every step (accumulation in ``no_sync``, norm clipping,
clipping requested between backward and step, fp16's overflow check).
"""

from __future__ import annotations

import queue
from concurrent.futures import Future

import torch
from torch import Tensor

from protrain_core.memtrack import on_host
from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.topology import Placement
from protrain_core.runtime.optim import ChunkOptimizer
from protrain_ops import fold_landing


class CpuWorker:
    def __init__(self, ctx: DeviceContext, optim: ChunkOptimizer, *, n_staging: int, staging_numel: int, record,
                 threaded: bool, placement: Placement | None = None) -> None:
        """``threaded``: run the jobs on a worker thread, else inline; ``placement``: the cores that
        thread runs on (None: the process's threads)."""
        self.ctx = ctx
        self.optim = optim
        self.n_staging = n_staging
        self.staging_numel = staging_numel  # the largest trainable shard of a streamed chunk
        self.record = record  # record(what, chunk index): the runtime's timeline and counters
        self.threaded = threaded
        self.placement = placement if threaded else None
        self._pool = ctx.worker(self.threaded, self.placement)
        self._staging: queue.Queue | None = None  # landing buffers to add into grad_acc (its dtype)
        self._scratch: Tensor | None = None  # the accumulator lent to chunks that keep none
        self._lent: dict[int, Tensor] = {}  # id of a landing slice -> its staging buffer

    def describe(self) -> str:
        """Where the CPU Adam runs, for ``engine.summary()``."""
        if self.placement is not None:
            return self.placement.describe()
        if self.threaded:
            return "the process's intra-op threads (a CPU device: they would compete with the compute)"
        return "inline on the thread that runs the step (a CPU device)"

    def resize_staging(self, *, n_staging: int, staging_numel: int) -> None:
        """After a re-plan (no landing in flight): other buffers, other largest span."""
        assert not self._lent
        self.n_staging, self.staging_numel, self._staging, self._scratch = n_staging, staging_numel, None, None

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the worker; a failure is re-raised by the future's ``result()``."""
        return self._pool.submit(fn, *args)

    def landing_buffer(self, chunk: Chunk, *, replace: bool) -> Tensor:
        """Where an offload lands on the host: in mixed precision the host compute copy's trainable
        span (restored from the master after landing); else the accumulator to ``replace`` it,
        or a staging buffer to add from."""
        storage = chunk.storage
        if storage.fmt.separate_master:
            return storage.compute_span()
        if replace:
            return storage.grad_acc
        if self._staging is None:
            self._staging = queue.Queue()
            for _ in range(self.n_staging):
                with on_host():
                    self._staging.put(torch.empty(self.staging_numel, dtype=storage.grad_acc.dtype,
                                                  device=self.ctx.host, pin_memory=self.ctx.is_cuda))
        full = self._staging.get()
        landing = full[:storage.fmt.state_numel]
        self._lent[id(landing)] = full
        return landing

    def land_and_update(self, chunk: Chunk, event, landing: Tensor, replace: bool, finish, update) -> None:
        """Fold the offloaded gradients into the accumulator; then ``finish`` them (unscale, norms:
        ``Finishing``) and run ``update`` = (hps, selected, clip) when given."""
        self.ctx.synchronize(event)
        storage = chunk.storage
        if storage.borrows_accumulator:
            assert replace or storage.grad_acc is not None, "a landing to add to was not kept"
            storage.borrow_accumulator(self.scratch(storage) if update is not None else None)
        kernel = self.optim.one_pass(chunk)
        if kernel is not None and update is not None and finish is None:
            self.update(chunk, *update, landed="copy" if replace else "add")  # landing, Adam, copy back: one pass
            return
        with torch.no_grad():
            if kernel is not None:  # landing, fp16's unscale and check, copy restored: one pass
                unscale = finish is not None and finish.inv_scale is not None
                found = self.optim.land(kernel, chunk, accumulate=not replace, members=finish.members if unscale else [],
                                        inv_scale=finish.inv_scale if unscale else None)
                if finish is not None:
                    finish.unscaled(found)
            else:
                if storage.fmt.separate_master:  # landed in the compute copy's span
                    fold_landing([storage.grad_acc], [landing], accumulate=not replace)
                elif not replace:  # landed in a staging buffer
                    storage.grad_acc.add_(landing)
                    self._staging.put(self._lent.pop(id(landing)))
                if finish is not None:
                    finish()
            if update is not None:
                self.update(chunk, *update)
            elif kernel is None and storage.fmt.separate_master:  # (the kernel restored the copy)
                storage.compute_span().copy_(storage.master)

    def scratch(self, storage) -> Tensor:
        """The accumulator lent to chunks that keep none ([Note: gradients consumed where they land])."""
        if self._scratch is None:
            with on_host():
                self._scratch = torch.empty(self.staging_numel, dtype=storage.fmt.master_dtype, device=self.ctx.host)
        return self._scratch

    def update(self, chunk: Chunk, hps, selected, clip, *, landed: str | None = None) -> None:
        self.record("cpu_adam_begin", chunk.index)
        fmt = chunk.storage.fmt  # (mixed precision: a landing not in this pass was folded before)
        folded = fmt.compute_dtype.itemsize + fmt.master_dtype.itemsize if landed is None and fmt.separate_master else 0
        with torch.no_grad():
            self.optim.update(chunk, hps, selected, clip, landed=landed,
                              timed=lambda: self.ctx.host_update(fmt.state_numel, fmt.state_format, folded))
        if chunk.storage.return_accumulator(consumed=True):
            chunk.values.forget_views()  # they hold the chunk's own accumulator: let it go
        self.record("cpu_adam_end", chunk.index)

    def shutdown(self, *, wait: bool = True) -> None:
        """Stop the worker; ``wait`` False (after a failure): drop the jobs not started, wait for none."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.record = None  # (the scheduler's: no cycle keeps a closed engine alive)
        if self.placement is not None:
            self.placement.close()
