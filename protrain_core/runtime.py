"""Hooks and chunk movement: fetch / prefetch / evict, gradient offload, CPU Adam worker.

[Note: when a chunk is needed]
Forward: a pre-hook on every *unit module* (a transformer block, or a module outside the blocks
that owns parameters) pins the unit's chunks on the device and prefetches the next chunk in
execution order; the post-hook unpins them. Pinned chunks are never evicted; unpinned resident
chunks stay until their buffer is needed (least recently used first), so the last chunks of the
forward pass are still resident when backward starts and are not uploaded again.
Backward: the forward post-hook registers a hook on each output tensor of the unit; it fires
when the gradient of that output is complete, i.e. before any backward node of the unit runs,
and makes the unit's chunks resident (the *current* chunks) and prefetches the previous chunk.
Gradients: ``register_post_accumulate_grad_hook`` fires once per parameter and backward pass,
after autograd summed the contributions of every use (a tied parameter too). The hook moves the
gradient into the chunk's gradient buffer and clears ``.grad``. When every trainable parameter
of a streamed chunk has its gradient, the buffer is offloaded to host memory and the CPU worker
lands it in the accumulator (fp32; bf16 in bf16-true) and, at a gradient-accumulation boundary,
runs Adam on the chunk while backward goes on (unless Adam waits for step(): fp16, norm
clipping). Nothing of the chunk is needed by backward after that point: autograd runs a parameter's accumulation only after every node that uses the parameter ran.
A chunk that is still receiving gradients is never evicted.
In mixed precision the offloaded gradients land in the chunk's host compute-dtype copy (no extra
host memory); the worker folds them into the fp32 accumulator and then rewrites that copy from
the fp32 master. So while a chunk is UPDATING its parameters must not be read: they are valid
again when ``step()`` returns (or when the chunk is next fetched, which waits for the worker).
"""

from __future__ import annotations

import contextlib
import enum
import os
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from protrain_core.chunk import Chunk, ChunkState
from protrain_core.device import DeviceContext
from protrain_core.memtrack import untracked
from protrain_core.optim import ChunkOptimizer
from protrain_core.utils import iter_tensors

_UNTRACED = contextlib.nullcontext()


def traced(name: str):
    """A named range in profiler traces -- only while a profiler records: entering a
    ``record_function`` costs tens of microseconds per hook even with no profiler running."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _UNTRACED


class Phase(enum.Enum):
    IDLE = "idle"
    BACKWARD = "backward"


class Runtime:
    def __init__(
        self,
        chunks: list[Chunk],
        ctx: DeviceContext,
        optim: ChunkOptimizer,
        *,
        n_buffer: int,
        mixed: bool,
        check_invariants: bool,
    ) -> None:
        self.chunks = chunks
        self.streamed = [c for c in chunks if not c.persistent]
        self.ctx = ctx
        self.optim = optim
        self.n_buffer = n_buffer
        self.mixed = mixed
        self.eager_update = True  # Adam during backward (False: at step(); the engine decides)
        self.check_invariants = check_invariants
        self.phase = Phase.IDLE
        self.boundary = True  # this backward is followed by step() (not inside no_sync)
        self.hps = None  # hyper-parameters snapshot of the current step
        self.current: set[int] = set()
        self._tick = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam")
        # [Note: CPU Adam on a CPU device] With CUDA the worker thread overlaps Adam with the
        # device's backward. When the device *is* the CPU there is nothing to overlap with: two
        # OpenMP thread teams (backward's and the worker's) on the same cores slow each other
        # down far more than Adam costs (measured 2-core VM: 4.5 ms instead of 0.3 ms per chunk,
        # and +30 % backward). So Adam runs inline, at the same points; PROTRAIN_CPU_ADAM_THREAD=1
        # keeps the worker thread (the tests use it to exercise the threaded path on the CPU).
        self.threaded = ctx.is_cuda or os.environ.get("PROTRAIN_CPU_ADAM_THREAD", "") == "1"
        self._staging: queue.Queue | None = None  # landing buffers to add into grad_acc (its dtype)
        self._handles: list = []
        self.stats = {"fetches": 0, "offloads": 0, "evictions": 0, "cpu_updates": 0}
        self.events: list[tuple[str, int, float]] = []  # (what, chunk, time) when recording
        self.record_events = False

    # ----- hook registration --------------------------------------------------------------
    def register(self, units: dict[nn.Module, tuple[int, ...]]) -> None:
        for module, idxs in units.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_forward_hook(idxs)))
            self._handles.append(module.register_forward_hook(self._post_forward_hook(idxs), always_call=True))
        seen = set()
        for chunk in self.chunks:
            for i, p in enumerate(chunk.params):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(chunk, i)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_forward_hook(self, idxs):
        def hook(_module, _args):
            with traced("ProTrain::pre_forward"):
                self.acquire(idxs, pin=True)
                self.prefetch(max(idxs) + 1)
                self._check()

        return hook

    def _post_forward_hook(self, idxs):
        def hook(_module, _args, output):
            for i in idxs:
                c = self.chunks[i]
                if not c.persistent:
                    c.pins -= 1
            if torch.is_grad_enabled():
                for t in iter_tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward_hook(idxs))

        return hook

    def _pre_backward_hook(self, idxs):
        def hook(_grad):
            if self.phase is not Phase.BACKWARD:
                raise RuntimeError(
                    "A ProTrain-managed module is running backward outside engine.backward(loss). "
                    "Call engine.backward(loss) instead of loss.backward()."
                )
            with traced("ProTrain::pre_backward"):
                self.current = set(idxs)
                self.acquire(idxs, pin=False)
                self.prefetch(min(idxs) - 1)
                self._check()

        return hook

    def _grad_hook(self, chunk: Chunk, i: int):
        def hook(p: Tensor) -> None:
            with traced("ProTrain::post_accumulate_grad"):
                self._on_grad(chunk, i, p)
                self._check()

        return hook

    # ----- residency ----------------------------------------------------------------------
    def acquire(self, idxs, *, pin: bool) -> None:
        self._tick += 1
        for i in idxs:
            c = self.chunks[i]
            if c.persistent:
                continue
            self._make_resident(c, protect=set(idxs))
            if pin:
                c.pins += 1
            c.last_use = self._tick

    def _make_resident(self, c: Chunk, protect: set[int]) -> None:
        if c.state is ChunkState.OFFLOADING:
            self._finish_offload(c)
        if c.state is ChunkState.UPDATING:
            self._finish_update(c)  # the next use of a chunk waits for its own update only
        if c.state is ChunkState.HOST:
            self._make_room(protect | {c.index})
            self._fetch(c)
        if c.state is ChunkState.FETCHING:
            self.ctx.wait_on_compute(c.fetch_event)
            c.fetch_event = None
            c.end_fetch()
            c.point_params_at(c.param_dev)

    def prefetch(self, index: int) -> None:
        if not 0 <= index < len(self.chunks):
            return
        c = self.chunks[index]
        if c.persistent:
            return
        if c.state is ChunkState.UPDATING and c.future.done():
            self._finish_update(c)
        if c.state is not ChunkState.HOST or self._victim(self.current | {index}, spill=False) is False:
            return
        self._make_room(self.current | {index})
        self._fetch(c)
        c.last_use = self._tick

    def _resident(self) -> list[Chunk]:
        return [c for c in self.streamed if c.device_resident]

    def _victim(self, protect: set[int], *, spill: bool):
        """The chunk to evict for a free buffer: None if a buffer is free, False if none can go.

        Preference: a chunk whose offload is in flight, then the least recently used idle
        chunk, then (only if ``spill``) one holding a partial set of gradients: those are
        offloaded and accumulated on the host like a micro-batch, and the chunk is fetched
        again if more of its gradients arrive (a parameter unused in this pass can leave a
        chunk incomplete until the end of backward).
        """
        resident = self._resident()
        if len(resident) < self.n_buffer:
            return None
        offloading = [c for c in resident if c.state is ChunkState.OFFLOADING]
        if offloading:
            return min(offloading, key=lambda c: c.last_use)
        idle = [c for c in resident if c.state is ChunkState.RESIDENT and c.pins == 0 and c.index not in protect]
        candidates = [c for c in idle if c.grad_dev is None] or (idle if spill else [])
        return min(candidates, key=lambda c: c.last_use) if candidates else False

    def _make_room(self, protect: set[int]) -> None:
        while (victim := self._victim(protect, spill=True)) is not None:
            if victim is False:
                busy = [(c.index, c.state.name, c.pins) for c in self._resident()]
                raise RuntimeError(
                    f"ProTrain needs another device chunk buffer but all {self.n_buffer} are in use "
                    f"(chunk, state, forward pins): {busy}. Increase Plan.n_buffer (or Plan.n_persist)."
                )
            if victim.state is ChunkState.RESIDENT and victim.grad_dev is not None:
                self._offload(victim, final=False)  # finishes at once on the CPU
            if victim.state is ChunkState.OFFLOADING:
                self._finish_offload(victim)
            elif victim.state is ChunkState.RESIDENT:
                self._release(victim)

    def _fetch(self, c: Chunk) -> None:
        c.begin_fetch()
        c.param_dev.untyped_storage().resize_(c.param_dev.numel() * c.param_dev.element_size())
        c.fetch_event = self.ctx.copy_async(c.param_dev, c.param_host)
        self.stats["fetches"] += 1
        self._record("fetch", c.index)

    def _release(self, c: Chunk) -> None:
        c.release()
        c.point_params_at(c.param_host)
        c.param_dev.untyped_storage().resize_(0)
        self.stats["evictions"] += 1

    def release_all(self) -> None:
        """Free every streamed chunk's device buffer (idle only)."""
        self.wait_all()
        for c in self.streamed:
            if c.state is ChunkState.FETCHING:
                self.ctx.synchronize(c.fetch_event)
                c.fetch_event = None
                c.end_fetch()
            if c.state is ChunkState.RESIDENT:
                self._release(c)

    # ----- gradients ----------------------------------------------------------------------
    def _on_grad(self, c: Chunk, i: int, p: Tensor) -> None:
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        with torch.no_grad():
            if c.persistent:
                dst = c.view(c.grad_acc, i)
                dst.add_(grad) if c.received[i] else dst.copy_(grad)
            else:
                if c.state is not ChunkState.RESIDENT:
                    self._make_resident(c, protect=self.current | {c.index})
                if c.grad_dev is None:
                    with untracked():  # chunk memory: counted by device_bytes(), not as activations
                        c.grad_dev = torch.zeros(c.param_dev.numel(), dtype=c.compute_dtype, device=self.ctx.device)
                c.view(c.grad_dev, i).copy_(grad)
        c.received[i] = True
        c.arrived_this_backward += 1
        if c.arrived_this_backward == len(c.grad_members) and not c.persistent:
            self._offload(c, final=True)

    def _offload(self, c: Chunk, *, final: bool) -> None:
        """Send the chunk's gradients to host memory and hand the chunk to the CPU worker.

        ``final``: no more gradients of this chunk come in this backward pass, so at a
        gradient-accumulation boundary the worker runs Adam on it right away.
        """
        c.begin_offload()
        first = not c.has_grad_acc
        if self.mixed:
            landing = c.param_host  # the compute copy is restored from master by the worker
        elif first:
            landing = c.grad_acc  # same dtype (fp32, bf16-true): land straight in the accumulator
        else:
            landing = self._staging_buffer(c.grad_acc)
        c.offload_event = self.ctx.copy_async(landing, c.grad_dev)
        update = final and self.eager_update and self.boundary
        c.future = self._submit(self._land_and_update, c, c.offload_event, landing, first, update, self.hps)
        c.has_grad_acc = True
        c.updated_this_step = c.updated_this_step or update
        self.stats["offloads"] += 1
        self._record("offload", c.index)
        if not self.ctx.is_cuda:
            self._finish_offload(c)

    def _submit(self, fn, *args) -> Future:
        if self.threaded:
            return self._worker.submit(fn, *args)
        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised by _finish_update, as from the worker
            future.set_exception(e)
        return future

    def _staging_buffer(self, like: Tensor) -> Tensor:
        if self._staging is None:
            self._staging = queue.Queue()
            for _ in range(self.n_buffer):
                with untracked():
                    buf = torch.empty_like(like, pin_memory=self.ctx.is_cuda)
                self._staging.put(buf)
        return self._staging.get()

    def _land_and_update(self, c: Chunk, event, landing: Tensor, first: bool, update: bool, hps) -> None:
        """CPU worker: fold the offloaded gradients into grad_acc, then maybe run Adam."""
        self.ctx.synchronize(event)
        with torch.no_grad():
            if landing is not c.grad_acc:
                c.grad_acc.copy_(landing) if first else c.grad_acc.add_(landing)
                if landing is not c.param_host:
                    self._staging.put(landing)
            if update:
                self._record("cpu_adam_begin", c.index)
                self.optim.update(c, hps)
                self._record("cpu_adam_end", c.index)
                self.stats["cpu_updates"] += 1
            elif self.mixed:
                c.param_host.copy_(c.master)

    def _finish_offload(self, c: Chunk) -> None:
        self.ctx.synchronize(c.offload_event)
        c.offload_event = None
        c.end_offload()
        c.point_params_at(c.param_host)
        c.grad_dev = None
        c.param_dev.untyped_storage().resize_(0)

    def _finish_update(self, c: Chunk) -> None:
        future, c.future = c.future, None
        future.result()  # re-raises a failure of the worker
        c.end_update()

    # ----- passes -------------------------------------------------------------------------
    def begin_backward(self, *, boundary: bool) -> None:
        if self.phase is not Phase.IDLE:
            raise RuntimeError("engine.backward() was called while another backward is running.")
        if any(c.updated_this_step for c in self.chunks):
            raise RuntimeError(
                "engine.backward() was called twice without engine.step(), but the first backward "
                "already updated the offloaded chunks (ProTrain runs Adam during backward). For "
                "gradient accumulation, run the non-final micro-batches inside `with engine.no_sync():`."
            )
        self.phase = Phase.BACKWARD
        self.boundary = boundary
        self.hps = self.optim.snapshot()
        self.current = set()

    def end_backward(self) -> None:
        try:
            # Chunks some of whose parameters got no gradient (unused in this pass) finish here.
            for c in self.streamed:
                if c.state is ChunkState.RESIDENT and c.grad_dev is not None:
                    self._offload(c, final=True)
        finally:
            for c in self.chunks:
                c.arrived_this_backward = 0
            self.current = set()
            self.phase = Phase.IDLE
        self._check()

    def wait_all(self) -> None:
        for c in self.streamed:
            if c.state is ChunkState.OFFLOADING:
                self._finish_offload(c)
            if c.state is ChunkState.UPDATING:
                self._finish_update(c)

    def step(self, hps) -> None:
        """Update every chunk that has gradients and was not updated during backward."""
        self.wait_all()
        pending = [c for c in self.chunks if not c.updated_this_step and any(c.received)]
        for c in pending:
            if not c.persistent:
                if c.state is ChunkState.RESIDENT:
                    self._release(c)  # its device copy would be stale after the update
                c.begin_update()
                c.future = self._submit(self._update_only, c, hps)
        for c in pending:
            if c.persistent:
                with traced("ProTrain::device_adam"), torch.no_grad():
                    self.optim.update(c, hps)
        self.wait_all()
        for c in self.chunks:
            c.updated_this_step = False

    def _update_only(self, c: Chunk, hps) -> None:
        self._record("cpu_adam_begin", c.index)
        with torch.no_grad():
            self.optim.update(c, hps)
        self._record("cpu_adam_end", c.index)
        self.stats["cpu_updates"] += 1

    def zero_grad(self) -> None:
        self.wait_all()
        for c in self.chunks:
            c.received = [False] * len(c.params)
            c.has_grad_acc = False
            c.updated_this_step = False

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)

    # ----- accounting ---------------------------------------------------------------------
    def device_bytes(self) -> int:
        return sum(c.device_bytes() for c in self.chunks)

    def device_bytes_bound(self) -> int:
        persistent = sum(c.device_bytes() for c in self.chunks if c.persistent)
        if not self.streamed:
            return persistent
        c = self.streamed[0]
        per_buffer = 2 * c.param_dev.numel() * c.param_dev.element_size()  # params + gradients
        return persistent + self.n_buffer * per_buffer

    def assert_invariants(self) -> None:
        resident = self._resident()
        assert len(resident) <= self.n_buffer, f"{len(resident)} chunks resident > n_buffer={self.n_buffer}"
        for c in self.streamed:
            nbytes = c.param_dev.untyped_storage().nbytes()
            if c.device_resident:
                assert nbytes == c.param_dev.numel() * c.param_dev.element_size(), c
            else:
                assert nbytes == 0 and c.grad_dev is None, f"{c} holds device memory"
            home = c.param_dev if c.state is ChunkState.RESIDENT else c.param_host if not c.device_resident else None
            if home is not None:
                for p in c.params:
                    assert p.untyped_storage().data_ptr() == home.untyped_storage().data_ptr(), f"{c}: stale .data"
        assert self.device_bytes() <= self.device_bytes_bound(), "device bytes above the plan's bound"

    def _check(self) -> None:
        if self.check_invariants:
            self.assert_invariants()

    def _record(self, what: str, index: int) -> None:
        if self.record_events:
            self.events.append((what, index, time.perf_counter()))

