"""Cost models: predicted step time and peak device memory of a plan (paper §3.3, appendix A).

Both are pure functions of a ``Profile`` and a ``Plan`` (and of when Adam runs: the
``UpdateSchedule`` of update.py): ``estimate_runtime(profile, plan)``, ``estimate_memory(profile,
plan)``. ``CostModel`` holds the per-chunk arrays both need, so that the search can evaluate
thousands of plans cheaply.

Notation (all per iteration, one optimizer step):
  N        chunks, in execution order; P the persistent ones (the first p = n_persist unless the
           plan names them: ``Plan.persistent_chunks``); B = min(n_buffer, N - p) buffers in use,
           each as large as the largest streamed chunk's compute copy and gradients
  S        chunk size in elements; cb bytes per element of the compute dtype
  X_c, Y_c time to upload chunk c (its bytes, S*cb in one process / host->device bandwidth) and
           to offload its gradients (its trainable span T_c*cb / device->host bandwidth; 0 for a
           frozen chunk): each chunk is charged its own bytes
  segment  the modules before the first block ("pre"), each block, the modules after ("post");
           a segment's *home* chunk is the last chunk it uses (a block uses exactly one); its
           other chunks (tied embeddings used by the head) are *extra* fetches when streamed
  F_c      forward compute of the segments homed at chunk c
  G_c      their backward compute, plus their forward again for checkpointed blocks
  SO_c,SI_c  time to swap out / in the saved tensors of swapped blocks homed at c (saved bytes
           over the copy bandwidth; measured per block where copies do not overlap compute)
  U_c, V_c Adam time of chunk c on the CPU worker / on the device (trainable elements / rate;
           U_c: the worker's whole update, landing and clipping passes included)
  L_c      the part of U_c that lands chunk c's gradients (mixed precision; 0 otherwise)
  W        processes the chunks are sharded over: X_c adds the chunk's all-gather, Y_c its
           gradients' reduce-scatter, U_c and V_c update 1/W of the elements, and the persistent
           chunks' reduce-scatters and gathers are charged where they outlast backward and the
           updates (``CostModel.device_updates``), all at the measured collective rates
  e_c      extra streamed chunks fetched by the segments homed at c

[Note: the CPU worker's work, by schedule]
What the worker does for a streamed chunk (runtime/worker.py ``land_and_update``) depends on
the schedule, and the model charges each part where it runs (profiled separately:
``Hardware.cpu_land_params_per_s``, ``cpu_pass_params_per_s``):
- DURING_BACKWARD: one job when the gradients arrive: landing (L_c), clipping's passes, Adam,
  copy back. U_c in all, in the backward chain of eq. 7.
- NEXT_FORWARD: at the landing, during backward, the landing and the compute copy restored from
  the master (as many bytes again: 2 L_c; one pass of the kernel where it runs, which fp16's
  unscale joins; the norms are not charged, they read what the landing wrote and hide in
  backward), and after backward, in forward order, clipping's passes, Adam and the copy back
  (U_c - L_c), which the next forward waits for.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from protrain_core.chunk_format import ChunkFormat
from protrain_core.plan import BlockMode, Plan, interleaved_modes
from protrain_core.planner.profiles import Profile
from protrain_core.update import UpdateSchedule

CHECKPOINT, SWAP = BlockMode.CHECKPOINT, BlockMode.SWAP


@dataclass(frozen=True)
class RuntimeEstimate:
    forward_s: float
    backward_s: float
    optimizer_s: float  # what the optimizer adds after backward (0 when hidden behind it)
    total_s: float
    compute_s: float  # device compute, recomputation included
    recompute_s: float
    h2d_s: float  # host -> device traffic: chunk uploads and swapped activations coming back
    d2h_s: float  # device -> host traffic: gradient offloads and swapped activations going out
    cpu_adam_s: float
    device_adam_s: float
    bottleneck: str  # the busiest resource of ``busy``

    def busy(self) -> dict[str, float]:
        """Seconds each resource works in the step."""
        return {"device compute": self.compute_s, "host->device transfers": self.h2d_s,
                "device->host transfers": self.d2h_s, "CPU Adam": self.cpu_adam_s, "device Adam": self.device_adam_s}


@dataclass(frozen=True)
class MemoryEstimate:
    persistent_bytes: int  # persistent chunks: parameters, gradients, master weights, Adam states
    buffer_bytes: int  # chunk buffers of the streamed chunks
    base_bytes: int  # the batch and whatever else lives through the iteration
    activation_bytes: int  # activations (and temporaries) at the peak, fragmentation included
    peak_bytes: int
    peak_at: str  # where the peak happens, e.g. "backward of block.3"
    host_bytes: int  # host memory: streamed chunks' states and swapped activations
    swap_host_bytes: int = 0  # of which swapped activations (their buffers: up to 1/8 more, runtime/swap.py)
    staging_host_bytes: int = 0  # beside them, the CPU worker's staging for accumulated fp32 gradients
    pinned_host_bytes: int = 0  # of the chunk states, those page-locked (None known: 0)
    page_lock_s: float = 0.0  # predicted time ``wrap`` spends page-locking them (0: nothing is locked)

    @property
    def planned_host_bytes(self) -> int:
        """Every host byte the plan allocates: chunk states, swap buffers (rounded up to their
        size classes, at most 1/8 more) and the worker's staging."""
        return self.host_bytes + self.swap_host_bytes // 8 + self.staging_host_bytes


# ----- eq. 4-6, once: for Python numbers (one plan) and for tensors (every layout at once) ----
SCALAR = SimpleNamespace(max=max, where=lambda condition, a, b: a if condition else b)
TENSOR = SimpleNamespace(max=torch.maximum, where=torch.where)


def chunk_times(F, G, SO, SI, X, Y, extra, *, streamed, again, two_buffers, later, async_copies: bool, ops=SCALAR):
    """Eq. 4-6 of one chunk (Python numbers), or of many at once (tensors that broadcast, with
    ``ops=TENSOR``): (forward time, its uploads, backward time, its uploads, gradient offload).
    ``F`` .. ``Y`` as in the notation above; ``extra``: the uploads of e_c; ``streamed``: it
    streams; ``again``: backward uploads it again (streamed, and not among the last B streamed
    chunks, still resident when backward starts); ``two_buffers``: B >= 2; ``later``: not chunk 0.
    Eq. 4: a prefetched upload (two or more buffers, not the first chunk) hides behind the
    previous chunk's compute:
      t_f = max(F, up, SO)  if hidden,   max(F + up, SO)  otherwise
    Eq. 5-6:
      persistent:            max(G, SI + up)
      streamed, B >= 2:      max(G, up + SI, off)        (upload prefetched, offload async)
      streamed, one buffer:  max(G + up + off, up + SI)  (upload, compute, offload in turn)
    Without asynchronous copies (a CPU device) everything adds up: F + SO + up, G + SI + up + off."""
    up_f, up_b, off = extra + X * streamed, extra + X * again, Y * streamed
    if not async_copies:
        return F + SO + up_f, up_f, G + SI + up_b + off, up_b, off
    fwd = ops.where((up_f > 0) & two_buffers & later, ops.max(ops.max(F, up_f), SO), ops.max(F + up_f, SO))
    two, one = ops.max(ops.max(G, up_b + SI), off), ops.max(G + up_b + off, up_b + SI)
    bwd = ops.where(streamed, ops.where(two_buffers, two, one), ops.max(G, SI + up_b))
    return fwd, up_f, bwd, up_b, off


def _streaming(n_chunks: int, persistent: frozenset[int]) -> tuple[list[bool], list[int]]:
    """Whether each chunk streams, and how many streamed chunks come after it (the last B
    streamed chunks are still resident when backward starts)."""
    streamed = [c not in persistent for c in range(n_chunks)]
    return streamed, [*itertools.accumulate(reversed(streamed), initial=0)][-2::-1]


class CostModel:
    """The per-profile arrays of the two models; ``runtime(plan)`` and ``memory(plan)``.

    ``schedule``: when the streamed chunks' CPU Adam runs (``update.overlap_mode`` decides);
    ``gradient_passes``: the elementwise passes clipping makes over a chunk's gradients before
    its update (``Overlap.gradient_passes``)."""

    def __init__(self, profile: Profile, *, schedule: UpdateSchedule = UpdateSchedule.DURING_BACKWARD,
                 gradient_passes: int = 0) -> None:
        self.profile = profile
        self.schedule = schedule
        self.gradient_passes = gradient_passes
        hw = profile.hardware
        self.N = profile.n_chunks
        self.L = profile.n_blocks
        w, chunks = profile.world_size, profile.chunks
        # Collectives and dequantisation: zeros in one process, or where the rates were not measured.
        gather = [c.gather_bytes / hw.gather_bytes_per_s if w > 1 and hw.gather_bytes_per_s else 0.0 for c in chunks]
        reduce = [c.reduce_bytes / hw.reduce_bytes_per_s if w > 1 and hw.reduce_bytes_per_s else 0.0 for c in chunks]
        # A quantised frozen span is dequantised on the upload stream after its copy ([Note:
        # quantised frozen chunks]): part of the upload's time.
        dequant = [c.frozen_numel / hw.dequant_params_per_s if c.quantised and hw.dequant_params_per_s else 0.0
                   for c in chunks]
        self.X = [c.upload_bytes / hw.h2d_bytes_per_s + g + d for c, g, d in zip(chunks, gather, dequant)]
        self.Y = [c.offload_bytes / hw.d2h_bytes_per_s + r for c, r in zip(chunks, reduce)]  # 0 for a frozen chunk
        # A streamed chunk's CPU work, per part ([Note: the CPU worker's work, by schedule]).
        n_upd = [c.updated_numel / w for c in chunks]
        self.U_land = [n / hw.cpu_land_params_per_s if hw.cpu_land_params_per_s else 0.0 for n in n_upd]
        passes = [gradient_passes * n / hw.cpu_pass_params_per_s if hw.cpu_pass_params_per_s else 0.0 for n in n_upd]
        self.U = [n / hw.cpu_adam_params_per_s + k for n, k in zip(n_upd, passes)]
        self.has_grad = [c.trains for c in chunks]
        self._adam_reduce_gather = ([n / hw.device_adam_params_per_s for n in n_upd], reduce, gather)
        self.async_copies = hw.async_copies
        # Suffix sums of the streamed chunks' host bytes (``host_suffix[p]``: the first p persist).
        self.host_suffix = [*itertools.accumulate((c.streamed_host_bytes for c in reversed(chunks)), initial=0)][::-1]
        self.segments = profile.segments
        self.block_seg = [i for i, s in enumerate(profile.segments) if s.kind == "block"]
        self._layouts: dict[tuple[int, int], _Layout] = {}
        self._grid: _Grid | None = None

    def device_updates(self, persistent) -> float:
        """What the updates of the ``persistent`` chunks (indices) add after backward: their
        device Adam, one after the other, and what their collectives add (W processes): the
        reduce-scatter of the last one to finish backward (the lowest with gradients: the others
        run beside backward), and the all-gathers after the updates beyond the last update (each
        gather follows its chunk's update and the gather before it):
          a_c = a_{c'} + V_c,  g_c = max(g_{c'}, a_c) + gather_c  (c' the persistent chunk before c),
          the value g_c + r_first of the last c (one process: the sum of the Adam times)."""
        adam, reduce, gather = self._adam_reduce_gather
        a = g = 0.0
        first = None
        for c in sorted(persistent):
            if self.has_grad[c]:
                a += adam[c]
                g = max(g, a) + gather[c]
                first = c if first is None else first
        return (g if any(gather) else a) + (reduce[first] if first is not None else 0.0)

    def extra_uploads(self, extra: list[int], persistent: frozenset[int]) -> float:
        """Upload time of the extra chunks a segment fetches that are streamed."""
        return sum(self.X[e] for e in extra if e not in persistent)

    def buffers(self, plan: Plan) -> int:
        return min(plan.n_buffer, self.N - plan.n_persist)

    def layout(self, modes: tuple[BlockMode, ...]) -> _Layout:
        """The arrays of one activation layout (``modes``: ``interleaved_modes``), a row of ``grid()``."""
        key = (modes.count(SWAP), modes.count(CHECKPOINT))
        if key not in self._layouts:
            assert modes == interleaved_modes(self.L, *key), "the cost model knows interleaved layouts only"
            self._layouts[key] = _Layout(self, self.grid().pairs.index(key))
        return self._layouts[key]

    def _streamed(self, persistent: int | frozenset[int]) -> list[ChunkFormat]:
        """The records of the chunks not in ``persistent`` (the indices, or the first n)."""
        kept = range(persistent) if isinstance(persistent, int) else persistent
        return [f for c, f in enumerate(self.profile.chunks) if c not in kept]

    def buffer_bytes(self, persistent: int | frozenset[int]) -> int:
        """Device bytes of one chunk buffer: the largest streamed chunk's compute copy and
        gradients (a buffer holds any streamed chunk in turn; ``persistent``: the indices, or
        the first n)."""
        return max((f.buffer_device_bytes for f in self._streamed(persistent)), default=0)

    def states_bytes(self, persistent: int | frozenset[int], n_buffer: int) -> int:
        """Eq. 8: model-state bytes on the device, M_states = sum_{c in P} persist_c + B * buffer
        (``persistent``: the indices, or the first n)."""
        kept = range(persistent) if isinstance(persistent, int) else persistent
        buffers = n_buffer * self.buffer_bytes(persistent)
        return sum(self.profile.chunks[c].persistent_device_bytes for c in kept) + buffers

    def streamed_host_bytes(self, persistent: int | frozenset[int]) -> int:
        """Host bytes of the streamed chunks' states (``persistent``: the indices, or the first n)."""
        return sum(f.streamed_host_bytes for f in self._streamed(persistent))

    def staging_bytes(self, persistent: int | frozenset[int], n_buffer: int) -> int:
        """The CPU worker's staging buffers (runtime/worker.py): where a chunk's gradients of a
        later micro-batch land before they are added to the accumulator -- ``n_buffer`` of the
        largest streamed trainable shard, in the state dtype, only where the state dtype is the
        compute dtype (the mixed modes land in the host compute copy instead); and, where
        streamed chunks keep no accumulator, the one it lends them (the same shard, once)."""
        largest, itemsize, copies = 0, 0, 0
        for f in self._streamed(persistent):
            if not f.trains or (f.separate_master and f.accumulator):
                continue
            copies = 1 if f.separate_master else n_buffer
            if f.state_numel > largest:  # this rank's trainable shard, as the runtime sizes it
                largest, itemsize = f.state_numel, f.master_dtype.itemsize
        return copies * largest * itemsize

    # ----- runtime: eq. 3-7 ------------------------------------------------------------------
    def runtime(self, plan: Plan) -> RuntimeEstimate:
        return self.runtime_of(self.layout(plan.block_modes(self.L)), plan.persistent(), self.buffers(plan))

    def runtime_of(self, lay: _Layout, p: int | frozenset[int], B: int) -> RuntimeEstimate:
        """Eq. 3-7 for one activation layout, the persistent chunks ``p`` (indices, or the first
        ``p``) and ``B`` buffers."""
        p = frozenset(range(p)) if isinstance(p, int) else p
        streamed, after = _streaming(self.N, p)
        # Eq. 4-6 of each chunk: (forward, its uploads, backward, its uploads, gradient offload).
        chunks = [chunk_times(lay.F[c], lay.G[c], lay.SO[c], lay.SI[c], self.X[c], self.Y[c],
                              self.extra_uploads(lay.extra[c], p), streamed=streamed[c],
                              again=streamed[c] and after[c] >= B, two_buffers=B >= 2, later=c > 0,
                              async_copies=self.async_copies) for c in range(self.N)]
        t_fwd = sum((t for t, *_ in chunks), lay.F_free)
        t_bwd, h2d_bwd, d2h_bwd, cpu_end, cpu_total, landed = self._backward(lay, streamed, chunks)
        dev_total = self.device_updates(p)
        # Eq. 3, the iteration. The device Adam of persistent chunks runs at step(), after backward.
        # DURING_BACKWARD: the CPU worker overlaps backward, T = T_f + max(T_b + T_gpu_adam, cpu_end).
        # NEXT_FORWARD: the CPU Adam starts when the last gradients have landed and runs in forward
        #   order while the next forward waits for each chunk's own update (_forward_after_updates).
        # Without a separate device (CPU) the worker competes for the same cores: T adds up.
        during = t_fwd + max(t_bwd + dev_total, cpu_end)
        if not self.async_copies:
            total = t_fwd + t_bwd + dev_total + cpu_total
        elif self.schedule is UpdateSchedule.DURING_BACKWARD:
            total = during
        else:
            total = t_bwd + self._forward_after_updates(lay, streamed, chunks, max(0.0, landed - t_bwd), dev_total)
        estimate = RuntimeEstimate(
            forward_s=t_fwd, backward_s=t_bwd, optimizer_s=total - t_fwd - t_bwd, total_s=total,
            compute_s=lay.compute_s, recompute_s=lay.recompute_s, h2d_s=sum(c[1] for c in chunks) + h2d_bwd,
            d2h_s=sum(lay.SO) + d2h_bwd, cpu_adam_s=cpu_total, device_adam_s=dev_total, bottleneck="",
        )
        busy = estimate.busy()
        return dataclasses.replace(estimate, bottleneck=max(busy, key=busy.get))

    def _forward_after_updates(self, lay: _Layout, streamed, chunks, start: float, dev_total: float) -> float:
        """The next forward under NEXT_FORWARD (``chunks``: each chunk's ``chunk_times``), from the
        end of backward: the device first runs the persistent chunks' Adam; the CPU worker updates
        the streamed chunks one after the other in forward order from ``start``; a streamed chunk's
        forward (its upload included) begins no earlier than its update ends."""
        t, done = dev_total + lay.F_free, start
        for c, (t_c, *_) in enumerate(chunks):
            if streamed[c] and self.has_grad[c]:
                done += self.U[c] - self.U_land[c]
                t = max(t, done)
            t += t_c
        return t

    def _backward(self, lay: _Layout, streamed, chunks):
        """T_b (eq. 5-6, chunks in reverse; ``chunks``: each chunk's ``chunk_times``) with its
        traffic, and the Adam times: the CPU worker's Adam (eq. 7) starts on a chunk when its
        gradients are offloaded, a_c = max(a_{c+1}, tau_c + Y) + U_c, tau_c (``t``) the time chunk
        c's backward ends; ``landed``, when the worker has landed the last offloaded gradients,
        under NEXT_FORWARD (each chunk's landing then also restores its compute copy: as long
        again), and ``cpu_total`` all of the worker's work."""
        t = lay.G_free  # the segments without chunks ("post" of a parameter-free head) come first
        h2d = d2h = cpu_end = cpu_total = landed = 0.0
        deferred = self.schedule is not UpdateSchedule.DURING_BACKWARD
        for c in range(self.N - 1, -1, -1):
            _, _, t_c, up, off = chunks[c]
            h2d += up + lay.SI[c]
            d2h += off
            t += t_c
            if streamed[c]:
                cpu_total += self.U[c] + (self.U_land[c] if deferred else 0.0)
                cpu_end = max(cpu_end, t + off) + self.U[c]
                landed = max(landed, t + off) + (2 * self.U_land[c] if deferred else 0.0)
        return t, h2d, d2h, cpu_end, cpu_total, landed

    def grid(self) -> _Grid:
        """Every activation layout at once, as tensors (for the search)."""
        if self._grid is None:
            self._grid = _Grid(self)
        return self._grid

    # ----- memory: eq. 8-10 --------------------------------------------------------------------
    def memory(self, plan: Plan) -> MemoryEstimate:
        lay, B, kept = self.layout(plan.block_modes(self.L)), self.buffers(plan), plan.persistent()
        persistent, buffers, act = self.states_bytes(kept, 0), B * self.buffer_bytes(kept), lay.activation_peak
        return MemoryEstimate(
            persistent_bytes=persistent,
            buffer_bytes=buffers,
            base_bytes=self.profile.base_bytes,
            activation_bytes=act,
            peak_bytes=persistent + buffers + self.profile.base_bytes + act,
            peak_at=lay.peak_at,
            host_bytes=self.streamed_host_bytes(kept) + lay.swap_host_bytes,
            swap_host_bytes=lay.swap_host_bytes,
            staging_host_bytes=self.staging_bytes(kept, B),
            pinned_host_bytes=(pinned := sum(f.streamed_pinned_bytes for f in self._streamed(kept))),
            page_lock_s=pinned / rate if (rate := self.profile.hardware.page_lock_bytes_per_s) else 0.0,
        )


class _Layout:
    """One activation layout, a row of ``_Grid``, as Python numbers (for the scalar model)."""

    def __init__(self, model: CostModel, row: int) -> None:
        grid = model.grid()
        self.F, self.extra, self.F_free = grid.F, grid.extra, grid.F_free
        self.G, self.SO, self.SI = (t[row].tolist() for t in (grid.G, grid.SO, grid.SI))
        self.G_free, self.recompute_s = float(grid.G_free[row]), float(grid.recompute_s[row])
        self.compute_s, self.swap_host_bytes = float(grid.compute_s[row]), int(grid.swap_host_bytes[row])
        self.activation_peak, where = int(grid.activation_peak[row]), int(grid.peak_where[row])
        phase, seg = ("forward", "backward")[where % 2], model.segments[where // 2].name
        self.peak_at = "start" if where < 0 else f"{phase} of {seg}"


class _Grid:
    """Every activation layout (n_swap, n_checkpoint) at once, as float64/int64 tensors with one
    row per layout (``pairs``): its block modes, activation peak and where it is
    (``_memory_walk``); per chunk G, SO and SI (the notation above); its backward outside chunks
    G_free, recomputation, compute and swapped bytes in host memory. And what the layouts share:
    per chunk F and the extra chunks its segments fetch; F_free, the forward of the segments
    without chunks."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        L, N, segs, f64 = model.L, model.N, model.segments, torch.float64
        self.pairs = [(s, c) for s in range(L + 1) for c in range(L + 1 - s)]
        modes = [interleaved_modes(L, s, c) for s, c in self.pairs]
        self.swap, self.ckpt = (torch.tensor([[m is mode for m in row] for row in modes], dtype=torch.bool)
                                for mode in (SWAP, CHECKPOINT))
        self.activation_peak, self.peak_where = _memory_walk(model, self.swap, self.ckpt)  # eq. 9 for every row at once
        self.F, G, self.extra, home = [0.0] * N, [0.0] * N, [[] for _ in range(N)], []
        self.F_free = G_free = 0.0
        for s in segs:
            home.append(h := max(s.chunks, default=None))
            if h is None:
                self.F_free += s.fwd_s
                G_free += s.bwd_s
            else:
                self.F[h] += s.fwd_s
                G[h] += s.bwd_s
                self.extra[h].extend(c for c in s.chunks if c != h)
        rows, hw = len(self.pairs), model.profile.hardware
        self.G, self.SO, self.SI = torch.tensor(G, dtype=f64).repeat(rows, 1), *torch.zeros(2, rows, N, dtype=f64)
        self.G_free, self.recompute_s = torch.full((rows,), G_free, dtype=f64), torch.zeros(rows, dtype=f64)
        self.swap_host_bytes = torch.zeros(rows, dtype=torch.int64)
        # Recomputation or swap copies at the block's home chunk, block by block in order: each row
        # sums as the scalar model would.
        for b, i in enumerate(model.block_seg):
            seg, h, swap = segs[i], home[i], self.swap[:, b].to(f64)
            r = self.ckpt[:, b].to(f64) * seg.recompute_s
            self.recompute_s += r
            if h is None:
                self.G_free += r
                continue
            self.G[:, h] += r
            measured = seg.swap_out_s is not None and seg.swap_in_s is not None
            self.SO[:, h] += swap * (seg.swap_out_s if measured else seg.saved_bytes / hw.d2h_bytes_per_s)
            self.SI[:, h] += swap * (seg.swap_in_s if measured else seg.saved_bytes / hw.h2d_bytes_per_s)
            self.swap_host_bytes += self.swap[:, b] * seg.saved_bytes
        self.compute_s = sum(s.fwd_s + s.bwd_s for s in segs) + self.recompute_s
        # First-n sets: sums over spans of chunks of per-chunk cases, so prefix sums over chunks of
        # each case, (streamed, uploaded again in backward, two or more buffers), without the
        # chunks whose segments fetch others (their uploads depend on the set: charged apart).
        self.F_t, self.X_t, self.Y_t = (torch.tensor(v, dtype=f64) for v in (self.F, model.X, model.Y))
        self.later, self.special, self.prefix = torch.arange(N) > 0, [c for c in range(N) if self.extra[c]], {}
        for case in [(False, False, False), *itertools.product([True], [False, True], [False, True])]:
            v = self._times(slice(None), 0.0, *(torch.tensor(x) for x in case))
            v[:, self.special] = 0.0
            self.prefix[case] = torch.cat([torch.zeros(rows, 1, dtype=f64), v.cumsum(1)], 1)

    def _times(self, c: slice, extra, streamed, again, two) -> Tensor:
        """Forward + backward (``chunk_times``) of chunks ``c`` for every row."""
        fwd, _, bwd, _, _ = chunk_times(self.F_t[c], self.G[:, c], self.SO[:, c], self.SI[:, c], self.X_t[c],
                                        self.Y_t[c], extra, streamed=streamed, again=again, two_buffers=two,
                                        later=self.later[c], async_copies=self.model.async_copies, ops=TENSOR)
        return fwd + bwd

    def phases(self, sets: list, B: Tensor) -> Tensor:
        """T_f + T_b + device Adam of every row for each of ``sets`` (the persistent chunks: the
        first n, an int, or indices) with ``B[l, j]`` buffers in use (int64 [layouts, sets]): the
        scalar model's ``chunk_times`` summed, exactly the first terms of eq. 3, so a lower bound
        of the step time. First-n sets at once, from a few gathers of the prefix sums."""
        if not all(isinstance(p, int) for p in sets):
            return torch.stack([self.phases_of_set(p, B[:, j]) for j, p in enumerate(sets)], 1)
        m, N = self.model, self.model.N
        p = torch.tensor(sets).expand_as(B)
        two, cut = B >= 2, torch.maximum(p, N - B).clamp(max=N)  # streamed chunks in [p, cut) are uploaded again

        def span(again: bool, lo: Tensor, hi: Tensor) -> Tensor:  # streamed chunks lo <= c < hi
            s2, s1 = self.prefix[True, again, True], self.prefix[True, again, False]
            return torch.where(two, s2.gather(1, hi) - s2.gather(1, lo), s1.gather(1, hi) - s1.gather(1, lo))

        t = ((self.F_free + self.G_free)[:, None] + self.prefix[False, False, False].gather(1, p)
             + span(True, p, cut) + span(False, cut, torch.full_like(p, N))
             + torch.tensor([m.device_updates(range(q)) for q in sets], dtype=torch.float64))
        for c in self.special:
            extra = torch.tensor([m.extra_uploads(self.extra[c], range(q)) for q in sets], dtype=torch.float64)
            t = t + self._times(slice(c, c + 1), extra, p <= c, (p <= c) & (c < N - B), two)
        return t

    def phases_of_set(self, persistent: frozenset[int], B: Tensor) -> Tensor:
        """``phases`` for one set of persistent chunks (indices), with ``B[l]`` buffers in use
        (int64 [layouts]): ``chunk_times`` of every chunk and row at once."""
        m = self.model
        streamed, after = _streaming(m.N, persistent)
        streamed, B = torch.tensor(streamed), B[:, None]
        extra = torch.tensor([m.extra_uploads(e, persistent) for e in self.extra], dtype=torch.float64)
        t = self._times(slice(None), extra, streamed, streamed & (torch.tensor(after) >= B), B >= 2)
        return self.F_free + self.G_free + t.sum(1) + m.device_updates(persistent)


def _memory_walk(model: CostModel, swap: Tensor, ckpt: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 9 for each row of block modes (``swap``, ``ckpt``: bool [rows, blocks]; the pre/post
    segments keep their activations): the activation peak, and where it is (2i: in the forward
    of segment i, 2i + 1: in its backward, -1: at the start).

    Walk the segments forward, then backward, and take the most dynamic bytes at any point.
    held_i = what segment i leaves alive until its backward:
      out_i + saved_i (KEEP)   out_i (CHECKPOINT: its output is the next block's input)
      out_i (SWAP: the saved tensors are in host memory; counting its output is safe)
    Forward of i:  H_i + fwd_peak_i; a KEEP block H_i + max(fwd_peak_i, recompute_peak_i):
                   its recomputation *is* a forward that keeps the saved tensors
                   (+ saved_{i-1} on CUDA if i-1 swaps: its copy out may still run)
    Backward of i: H_i + bwd_peak_i (+ recompute_peak_i if CHECKPOINT, the larger of the
                   two) (+ saved_{i-1} if i-1 swaps: it is brought back one block ahead)
    with H_i = sum_{j<i} held_j. Eq. 10 then adds the model states (eq. 8) and the base,
    and multiplies the activation part by the measured fragmentation factor."""
    segs, block_seg = model.segments, torch.tensor(model.block_seg, dtype=torch.int64)
    seg_swap = torch.zeros(swap.shape[0], len(segs), dtype=torch.bool)
    seg_ckpt, seg_block = torch.zeros_like(seg_swap), torch.zeros(len(segs), dtype=torch.bool)
    seg_swap[:, block_seg], seg_ckpt[:, block_seg], seg_block[block_seg] = swap, ckpt, True
    seg_keep = ~(seg_swap | seg_ckpt)
    fields = ("out_bytes", "saved_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "recompute_peak_bytes")
    out, saved, fwd_peak, bwd_peak, rec_peak = (torch.tensor([getattr(s, f) for s in segs], dtype=torch.int64)
                                                for f in fields)
    inc = out + saved * seg_keep
    held = torch.cumsum(inc, 1) - inc
    prev = torch.zeros_like(held)
    prev[:, 1:] = seg_swap[:, :-1] * saved[:-1]
    fwd = held + torch.where(seg_keep & seg_block, torch.maximum(fwd_peak, rec_peak), fwd_peak)
    if model.async_copies:
        fwd = fwd + prev
    bwd = held + torch.where(seg_ckpt, torch.maximum(bwd_peak, rec_peak), bwd_peak) + prev
    peak, where = torch.stack([fwd, bwd], 2).flatten(1).max(1)  # the first of equal peaks
    where = torch.where(peak > 0, where, -1)
    return (peak.clamp(min=0).to(torch.float64) * model.profile.fragmentation).floor().to(torch.int64), where


def estimate_runtime(profile: Profile, plan: Plan, *, schedule: UpdateSchedule = UpdateSchedule.DURING_BACKWARD,
                     gradient_passes: int = 0) -> RuntimeEstimate:
    """Predicted step time of ``plan`` (eq. 3-7) for the measurements of ``profile`` when the CPU
    Adam runs on ``schedule`` after ``gradient_passes`` of clipping (``CostModel``)."""
    return CostModel(profile, schedule=schedule, gradient_passes=gradient_passes).runtime(plan)


def estimate_memory(profile: Profile, plan: Plan) -> MemoryEstimate:
    """Predicted peak device memory of ``plan`` (eq. 8-10) for the measurements of ``profile``."""
    return CostModel(profile).memory(plan)
