"""Cost models: predicted step time and peak device memory of a plan (paper §3.3, appendix A).

Both are pure functions of a ``Profile`` and a ``Plan``: ``estimate_runtime(profile, plan)``,
``estimate_memory(profile, plan)``. ``CostModel`` holds the per-chunk arrays both need, so
that the search can evaluate thousands of plans cheaply.

Notation (all per iteration, one optimizer step):
  N        chunks, in execution order; p = n_persist; B = min(n_buffer, N - p) buffers in use
  S        chunk size in elements; cb bytes per element of the compute dtype
  X, Y     time to upload one chunk (S*cb / host->device bandwidth) and to offload one chunk of
           gradients (S*cb / device->host bandwidth)
  segment  the modules before the first block ("pre"), each block, the modules after ("post");
           a segment's *home* chunk is the last chunk it uses (a block uses exactly one); its
           other chunks (tied embeddings used by the head) are *extra* fetches when streamed
  F_c      forward compute of the segments homed at chunk c
  G_c      their backward compute, plus their forward again for checkpointed blocks
  SO_c,SI_c  time to swap out / in the saved tensors of swapped blocks homed at c
  U_c, V_c Adam time of chunk c on the CPU worker / on the device (trainable elements / rate)
  e_c      extra streamed chunks fetched by the segments homed at c
"""

from __future__ import annotations

from dataclasses import dataclass

from protrain_core.activations import BlockMode, interleaved_modes
from protrain_core.plan import Plan
from protrain_core.profiles import Profile

KEEP, CHECKPOINT, SWAP = BlockMode.KEEP, BlockMode.CHECKPOINT, BlockMode.SWAP


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
    bottleneck: str


@dataclass(frozen=True)
class MemoryEstimate:
    persistent_bytes: int  # persistent chunks: parameters, gradients, master weights, Adam states
    buffer_bytes: int  # chunk buffers of the streamed chunks
    base_bytes: int  # the batch and whatever else lives through the iteration
    activation_bytes: int  # activations (and temporaries) at the peak, fragmentation included
    peak_bytes: int
    peak_at: str  # where the peak happens, e.g. "backward of block.3"
    host_bytes: int  # host memory: streamed chunks' states and swapped activations


class CostModel:
    """The per-profile arrays of the two models; ``runtime(plan)`` and ``memory(plan)``."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        hw = profile.hardware
        self.N = profile.n_chunks
        self.L = profile.n_blocks
        self.X = profile.chunk_bytes / hw.h2d_bytes_per_s
        self.Y = profile.chunk_bytes / hw.d2h_bytes_per_s
        self.U = [n / hw.cpu_adam_params_per_s for n in profile.chunk_trainable]
        self.V = [n / hw.device_adam_params_per_s for n in profile.chunk_trainable]
        self.has_grad = profile.chunk_has_grad
        self.async_copies = hw.async_copies
        # Prefix sums of the chunk sizes when persistent (eq. 8 is linear in n_persist).
        self.persist_prefix = [0]
        for b in profile.persist_bytes:
            self.persist_prefix.append(self.persist_prefix[-1] + b)
        self.host_suffix = [0] * (self.N + 1)
        for c in range(self.N - 1, -1, -1):
            self.host_suffix[c] = self.host_suffix[c + 1] + profile.host_bytes[c]
        self.segments = profile.segments
        self.block_seg = [i for i, s in enumerate(profile.segments) if s.kind == "block"]
        self._layouts: dict[tuple[BlockMode, ...], _Layout] = {}
        self._base = _Base(self)
        self._block_recompute = [profile.segments[i].recompute_s for i in self.block_seg]
        self.V_prefix = [0.0]
        for v in self.V:
            self.V_prefix.append(self.V_prefix[-1] + v)

    # ----- helpers -------------------------------------------------------------------------
    def modes(self, plan: Plan) -> tuple[BlockMode, ...]:
        return interleaved_modes(self.L, plan.n_swap, plan.n_checkpoint)

    def buffers(self, plan: Plan) -> int:
        return min(plan.n_buffer, self.N - plan.n_persist)

    def layout(self, modes: tuple[BlockMode, ...]) -> _Layout:
        lay = self._layouts.get(modes)
        if lay is None:
            lay = self._layouts[modes] = _Layout(self, modes)
        return lay

    def states_bytes(self, n_persist: int, n_buffer: int) -> int:
        """Eq. 8: model-state bytes on the device, M_states = sum_{c<p} persist_c + B * 2*S*cb."""
        return self.persist_prefix[n_persist] + n_buffer * self.profile.buffer_bytes

    def host_bytes(self, n_persist: int, modes: tuple[BlockMode, ...]) -> int:
        return self.host_suffix[n_persist] + self.layout(modes).swap_host_bytes

    # ----- runtime: eq. 3-7 ------------------------------------------------------------------
    def runtime(self, plan: Plan) -> RuntimeEstimate:
        return self._runtime(self.layout(self.modes(plan)), plan.n_persist, self.buffers(plan))

    def _t_fwd(self, lay: _Layout, c: int, p: int, B: int) -> tuple[float, float]:
        """(forward time of chunk c, its uploads) -- eq. 4."""
        X = self.X
        F, SO = lay.F[c], lay.SO[c]
        extra = sum(1 for e in lay.extra[c] if e >= p)
        up = X * (extra + (1 if c >= p else 0))
        if not self.async_copies:
            return F + SO + up, up
        if up and B >= 2 and c > 0:
            return max(F, up, SO), up
        return max(F + up, SO), up

    def _t_bwd(self, lay: _Layout, c: int, p: int, B: int) -> tuple[float, float, float]:
        """(backward time of chunk c, its uploads, its offload) -- eq. 5-6."""
        streamed = c >= p
        fetches = sum(1 for e in lay.extra[c] if e >= p) + (1 if streamed and c < self.N - B else 0)
        up = self.X * fetches
        off = self.Y if streamed and self.has_grad[c] else 0.0
        G, SI = lay.G[c], lay.SI[c]
        if not self.async_copies:
            return G + SI + up + off, up, off
        if not streamed:
            return max(G, SI + up), up, off
        if B >= 2:
            return max(G, up + SI, off), up, off
        return max(G + up + off, up + SI), up, off

    def _runtime(self, lay: _Layout, p: int, B: int) -> RuntimeEstimate:
        N = self.N
        sync = not self.async_copies
        h2d = d2h = 0.0
        # Eq. 4, forward. Persistent chunk: t_f = max(F_c, SO_c). Streamed chunk: its upload
        # (and its segments' extra uploads) is prefetched while the chunk before computes, so
        #   t_f = max(F_c, X * (1 + e_c), SO_c)         with B >= 2 buffers,
        #   t_f = max(F_c + X * (1 + e_c), SO_c)        with one buffer (nothing to prefetch into),
        #                                               and for chunk 0 (nothing to hide behind). Without
        # asynchronous copies (CPU) everything adds up: t_f = F_c + SO_c + X * (1 + e_c).
        t_fwd = lay.F_free
        for c in range(N):
            t, up = self._t_fwd(lay, c, p, B)
            t_fwd += t
            h2d += up
            d2h += lay.SO[c]
        # Eq. 5-6, backward, chunks in reverse. The last B streamed chunks are still resident
        # when backward starts (no upload again). Streamed chunk c:
        #   t_b = max(G_c, X * f_c + SI_c, Y)          with B >= 2 (upload prefetched, offload async)
        #   t_b = max(G_c + X * f_c + Y, X * f_c + SI_c)  with one buffer (upload, compute, offload in turn)
        # with f_c = [c < N - B] + e_c uploads; a persistent chunk t_b = max(G_c, SI_c); without
        # asynchronous copies t_b = G_c + SI_c + X * f_c + Y. The CPU worker's Adam (eq. 7)
        # starts on a chunk when its gradients are offloaded: a_c = max(a_{c+1}, tau_c + Y) + U_c,
        # tau_c the time chunk c's backward ends.
        t_bwd = lay.G_free
        tau = lay.G_free  # the segments without chunks ("post" of a parameter-free head) come first
        cpu_end = 0.0
        cpu_total = dev_total = 0.0
        for c in range(N - 1, -1, -1):
            t, up, off = self._t_bwd(lay, c, p, B)
            h2d += up + lay.SI[c]
            d2h += off
            t_bwd += t
            tau += t
            if c >= p:
                cpu_total += self.U[c]
                cpu_end = max(cpu_end, tau + off) + self.U[c]
            else:
                dev_total += self.V[c]
        # Eq. 3, the iteration: the device Adam of persistent chunks runs at step(), after
        # backward; the CPU worker overlaps backward (T = T_f + max(T_b + T_gpu_adam, cpu_end)).
        # fp16 defers every update to step(): T = T_f + T_b + max(T_gpu_adam, T_cpu_adam).
        # Without a separate device (CPU) the worker competes for the same cores: T adds up.
        if sync:
            total = t_fwd + t_bwd + dev_total + cpu_total
        elif self.profile.adam_in_backward:
            total = t_fwd + max(t_bwd + dev_total, cpu_end)
        else:
            total = t_fwd + t_bwd + max(dev_total, cpu_total)
        compute = lay.compute_s
        resources = {
            "device compute": compute,
            "host->device transfers": h2d,
            "device->host transfers": d2h,
            "CPU Adam": cpu_total,
            "device Adam": dev_total,
        }
        bottleneck = max(resources, key=resources.get)
        return RuntimeEstimate(
            forward_s=t_fwd,
            backward_s=t_bwd,
            optimizer_s=total - t_fwd - t_bwd,
            total_s=total,
            compute_s=compute,
            recompute_s=lay.recompute_s,
            h2d_s=h2d,
            d2h_s=d2h,
            cpu_adam_s=cpu_total,
            device_adam_s=dev_total,
            bottleneck=bottleneck,
        )

    def compute_bound(self, modes: tuple[BlockMode, ...]) -> float:
        """A lower bound of the step time of any plan with this activation layout: its device
        compute (every segment's forward and backward, plus the checkpointed blocks' forward
        again), without building the layout."""
        rec = self._block_recompute
        return self._base.compute + sum(rec[b] for b, m in enumerate(modes) if m is CHECKPOINT)

    def phases_bound(self, lay: _Layout, p: int, B: int) -> float:
        """T_f + T_b + device Adam of (p, B) in O(1) from prefix sums -- exactly the first
        terms of eq. 3 (so a lower bound of the step time when Adam overlaps backward, and
        of T_f + T_b + max(...) otherwise), used by the search to skip full evaluations."""
        P = lay.prefix(self)
        N, w = self.N, self.N - B
        fs = P.fS2 if B >= 2 else P.fS1
        bi = P.bSin2 if B >= 2 else P.bSin1
        bo = P.bSout2 if B >= 2 else P.bSout1
        cut = max(p, w)
        t = (lay.F_free + lay.G_free + P.fP[p] + fs[N] - fs[p] + P.bP[p] + bo[cut] - bo[p] + bi[N] - bi[cut]
             + P.V[p])
        for c in P.special:  # chunks whose segments fetch extra chunks, and chunk 0: exact
            t += self._t_fwd(lay, c, p, B)[0] + self._t_bwd(lay, c, p, B)[0]
        return t

    # ----- memory: eq. 8-10 --------------------------------------------------------------------
    def memory(self, plan: Plan) -> MemoryEstimate:
        modes = self.modes(plan)
        lay = self.layout(modes)
        B = self.buffers(plan)
        persistent = self.persist_prefix[plan.n_persist]
        buffers = B * self.profile.buffer_bytes
        act = lay.activation_peak
        return MemoryEstimate(
            persistent_bytes=persistent,
            buffer_bytes=buffers,
            base_bytes=self.profile.base_bytes,
            activation_bytes=act,
            peak_bytes=persistent + buffers + self.profile.base_bytes + act,
            peak_at=lay.peak_at,
            host_bytes=self.host_bytes(plan.n_persist, modes),
        )


class _Base:
    """What every layout shares: per-chunk forward/backward compute without recomputation, the
    segments' home chunks and extra fetches, and the per-segment bytes of the memory walk."""

    def __init__(self, model: CostModel) -> None:
        N = model.N
        segs = model.profile.segments
        self.F, self.G, self.zeros = [0.0] * N, [0.0] * N, [0.0] * N
        self.extra: list[list[int]] = [[] for _ in range(N)]
        self.F_free = self.G_free = 0.0
        self.home: list[int | None] = []
        for s in segs:
            if not s.chunks:
                self.home.append(None)
                self.F_free += s.fwd_s
                self.G_free += s.bwd_s
                continue
            home = max(s.chunks)
            self.home.append(home)
            self.F[home] += s.fwd_s
            self.G[home] += s.bwd_s
            self.extra[home].extend(c for c in s.chunks if c != home)
        self.compute = sum(s.fwd_s + s.bwd_s for s in segs)
        self.out = [s.out_bytes for s in segs]
        self.saved = [s.saved_bytes for s in segs]
        self.fwd_other = [s.fwd_peak_bytes for s in segs]
        self.fwd_keep = [max(s.fwd_peak_bytes, s.recompute_peak_bytes) if s.kind == "block" else s.fwd_peak_bytes
                         for s in segs]
        self.bwd_other = [s.bwd_peak_bytes for s in segs]
        self.bwd_ckpt = [max(s.bwd_peak_bytes, s.recompute_peak_bytes) for s in segs]


class _Layout:
    """Per-chunk arrays of one activation layout, and its activation peak (eq. 9)."""

    def __init__(self, model: CostModel, modes: tuple[BlockMode, ...]) -> None:
        profile = model.profile
        hw = profile.hardware
        N = model.N
        base = model._base
        # Layout-independent parts are shared: forward per chunk, extra fetches; the backward
        # gets the checkpointed blocks' recomputation, the copy links the swapped blocks' bytes.
        self.F, self.extra, self.F_free = base.F, base.extra, base.F_free
        self.G = list(base.G)
        self.G_free = base.G_free
        self.SO = self.SI = base.zeros
        self.recompute_s = 0.0
        self.swap_host_bytes = 0
        segs = profile.segments
        mode_of = [KEEP] * len(segs)  # pre/post segments keep their activations
        for b, i in enumerate(model.block_seg):
            m = modes[b]
            if m is KEEP:
                continue
            mode_of[i] = m
            home = base.home[i]
            if m is CHECKPOINT:
                r = segs[i].recompute_s
                self.recompute_s += r
                if home is None:
                    self.G_free += r
                else:
                    self.G[home] += r
            elif home is not None:
                if self.SO is base.zeros:
                    self.SO, self.SI = [0.0] * N, [0.0] * N
                saved = segs[i].saved_bytes
                self.SO[home] += saved / hw.d2h_bytes_per_s
                self.SI[home] += saved / hw.h2d_bytes_per_s
                self.swap_host_bytes += saved
        self.compute_s = base.compute + self.recompute_s

        # Eq. 9: walk the segments forward, then backward, and take the most dynamic bytes at
        # any point. held_i = what segment i leaves alive until its backward:
        #   out_i + saved_i (KEEP)   out_i (CHECKPOINT: its output is the next block's input)
        #   out_i (SWAP: the saved tensors are in host memory; counting its output is safe)
        # Forward of i:  H_i + fwd_peak_i; a KEEP block H_i + max(fwd_peak_i, recompute_peak_i):
        #                its recomputation *is* a forward that keeps the saved tensors
        #                (+ saved_{i-1} on CUDA if i-1 swaps: its copy out may still run)
        # Backward of i: H_i + bwd_peak_i (+ recompute_peak_i if CHECKPOINT, the larger of the
        #                two) (+ saved_{i-1} if i-1 swaps: it is brought back one block ahead)
        # with H_i = sum_{j<i} held_j. Eq. 10 then adds the model states (eq. 8) and the base,
        # and multiplies the activation part by the measured fragmentation factor.
        held = 0
        peak, where = 0, -1
        async_copies = hw.async_copies
        fwd_keep, fwd_other, bwd_ckpt, bwd_other = base.fwd_keep, base.fwd_other, base.bwd_ckpt, base.bwd_other
        out, saved = base.out, base.saved
        previous_swap = False
        for i in range(len(segs)):
            m = mode_of[i]
            fwd = held + (fwd_keep[i] if m is KEEP else fwd_other[i])
            bwd = held + (bwd_ckpt[i] if m is CHECKPOINT else bwd_other[i])
            if previous_swap:
                bwd += saved[i - 1]
                if async_copies:
                    fwd += saved[i - 1]
            if fwd > peak:
                peak, where = fwd, 2 * i
            if bwd > peak:
                peak, where = bwd, 2 * i + 1
            held += out[i] + (saved[i] if m is KEEP else 0)
            previous_swap = m is SWAP
        peak_at = "start" if where < 0 else f"{('forward', 'backward')[where % 2]} of {segs[where // 2].name}"
        self.activation_peak = int(peak * profile.fragmentation)
        self.peak_at = peak_at
        self._prefix = None

    def prefix(self, model: CostModel) -> _Prefix:
        if self._prefix is None:
            self._prefix = _Prefix(model, self)
        return self._prefix


class _Prefix:
    """Prefix sums over chunks of each case of eq. 4-5 for one layout: persistent, streamed with
    one or more buffers, in or out of the resident window. The formulas are those of
    ``CostModel._t_fwd`` / ``_t_bwd`` for a chunk without extra fetches; chunk 0 and chunks whose
    segments fetch extra chunks are left out (``special``) and computed exactly per plan."""

    def __init__(self, model: CostModel, lay: _Layout) -> None:
        N, X, Y = model.N, model.X, model.Y
        sync = not model.async_copies
        self.special = [c for c in range(N) if c == 0 or lay.extra[c]]
        names = ("fP", "fS2", "fS1", "bP", "bSin2", "bSout2", "bSin1", "bSout1")
        cases = {name: [0.0] * N for name in names}
        for c in range(N):
            if c == 0 or lay.extra[c]:
                continue
            F, SO, G, SI = lay.F[c], lay.SO[c], lay.G[c], lay.SI[c]
            off = Y if model.has_grad[c] else 0.0
            if sync:
                values = (F + SO, F + SO + X, F + SO + X, G + SI, G + SI + off, G + SI + X + off, G + SI + off,
                          G + SI + X + off)
            else:
                values = (max(F, SO), max(F, X, SO), max(F + X, SO), max(G, SI), max(G, SI, off),
                          max(G, X + SI, off), max(G + off, SI), max(G + X + off, X + SI))
            for name, v in zip(names, values):
                cases[name][c] = v
        for name, values in cases.items():
            acc = [0.0]
            for v in values:
                acc.append(acc[-1] + v)
            setattr(self, name, acc)
        self.V = model.V_prefix


def estimate_runtime(profile: Profile, plan: Plan) -> RuntimeEstimate:
    """Predicted step time of ``plan`` (eq. 3-7)."""
    return CostModel(profile).runtime(plan)


def estimate_memory(profile: Profile, plan: Plan) -> MemoryEstimate:
    """Predicted peak device memory of ``plan`` (eq. 8-10)."""
    return CostModel(profile).memory(plan)
