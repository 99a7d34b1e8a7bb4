"""A step's gradients between backward and the update: fp16 unscaling and the overflow check,
gradient clipping (configured ahead, or requested between backward and ``step()``), and the
schedule of the streamed chunks' CPU Adam that these allow (update.py).

[Note: finishing gradients early]
Under fp16 or norm clipping no chunk may be updated before every gradient of the step is known
(one inf/nan skips the step; one global norm scales every gradient), yet the update needs only,
per chunk, whether it overflowed and the norm of each tensor. So at a step's last backward the
CPU worker *finishes* each streamed chunk's gradients where they landed, while backward goes on:
it unscales and checks them (``torch._amp_foreach_non_finite_check_and_unscale_``, as
``GradScaler.unscale_``) and takes each tensor's norm (``torch._foreach_norm``, as
``clip_grad_norm_``). At ``step()`` the total norm is ``vector_norm`` of the per-tensor norms
stacked in the optimizer's parameter order on the device, and the coefficient
``min(max_norm / (total + 1e-6), 1)``: ``clip_grad_norm_``'s arithmetic, so fp32 stays bitwise.
``step()`` then hands the streamed chunks to the worker and returns: the CPU Adam overlaps the
next forward (``UpdateSchedule.NEXT_FORWARD``).
Clipping requested between backward and step (``engine.clipping.clip_grad_norm_``) is exact
only when no chunk was updated during that backward, so the engine holds the updates of its
first step (``late_reason``), of every step after one that clipped late, or of every step when
told that clipping will come late (``expect_late``); told that none will come it holds nothing.

[Note: gradients read through p.grad]
Parameters hold no ``.grad`` of their own: autograd's is moved into the chunk as it comes. From
the end of a backward to the next ``step()`` or ``zero_grad``, ``p.grad`` of a managed parameter
reads a view of the chunk's accumulator (fp32 in the mixed modes), after the updates in flight
and fp16 unscaling. Writing into it changes what ``step()`` applies (the chunk's norms are
taken again); where the chunk was updated during backward, a change (seen by the accumulator's
version counter) is refused at ``step()``. So the first step is held, and every step after one
that read ``p.grad``. Elsewhere ``p.grad`` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from protrain_core.precision import LossScaler
from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.optim import ChunkOptimizer, UpdateClip
from protrain_core.runtime.sharding import Sharding
from protrain_core.update import ClippingConfig, clips_norm
from protrain_ops import clip_gradients


class Finishing:
    """Finishing one chunk's gradients of the step: those of ``members`` (the ones the optimizer
    updates that have a gradient) unscaled and checked for inf/nan (fp16: ``inv_scale``), then
    the norms taken (``norm_type``); it is then the chunk's record in ``finished``. Where the
    one-pass landing unscaled them already, ``unscaled(found)``."""

    def __init__(self, chunk: Chunk, members: list[int], inv_scale: Tensor | None, norm_type: float | None,
                 finished: dict[int, Finishing]) -> None:
        self.chunk, self.members, self.inv_scale, self.norm_type, self.finished = chunk, members, inv_scale, norm_type, finished
        self.found_inf: Tensor | None = None  # fp16: > 0 when an inf/nan was found (where the gradients live)
        self.norms: dict[float, list[Tensor]] = {}  # norm type -> the norm of each member in ``members``

    def __call__(self) -> None:
        grads, found = _grads(self.chunk, self.members), None
        if self.inv_scale is not None and grads:
            found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.inv_scale.to(grads[0].device))
        self.unscaled(found)

    def unscaled(self, found: Tensor | None) -> None:
        """After the gradients were unscaled and checked (``found``: the flag, or None): the norms."""
        grads = _grads(self.chunk, self.members) if self.norm_type is not None else []
        self.found_inf = found
        self.norms = {self.norm_type: list(torch._foreach_norm(grads, self.norm_type))} if grads else {}
        self.finished[self.chunk.index] = self


@dataclass(frozen=True)
class ClippingPolicy:
    """What the engine was told about clipping."""

    configured: ClippingConfig | None = None  # applied at every step (wrap / engine.clipping.configure)
    expect_late: float | None = None  # clipping comes late at any step: the norm type to finish early
    hold_first: bool = True  # hold the first step for a late request (False: no late request will come)


class StepGradients:
    """What the engine knows about clipping, and the finished gradients of the current step."""

    def __init__(self, optim: ChunkOptimizer, scaler: LossScaler | None, chunks: list[Chunk], ctx: DeviceContext,
                 sharding: Sharding) -> None:
        self.optim, self.scaler, self.chunks, self.ctx, self.device = optim, scaler, chunks, ctx, ctx.device
        # With several ([Note: several optimizers] in engine.py), p.grad reads through steps and zero_grads too.
        self.several_optimizers = len(optim.optimizers) > 1
        self.sharding = sharding  # norms and overflow all-reduced
        # Streamed chunks keep no accumulator ([Note: gradients consumed where they land] in worker.py).
        self.consumed = any(not c.storage.fmt.accumulator for c in chunks)
        self.policy = ClippingPolicy(hold_first=not self.consumed)  # set_policy
        self.late_seen = False  # some step clipped late
        self.read_seen = False  # some step's gradients were read through p.grad
        self.readable = False  # a backward ended and no step or zero_grad came since: p.grad reads them
        self._handed: dict[int, tuple[Chunk, int]] = {}  # chunk index -> (chunk, accumulator version when read)
        self.steps = 0
        self.last_norm: Tensor | None = None  # total norm before clipping, of the last norm clipping
        self._late: ClippingConfig | None = None  # this step's late request
        self._totals: dict[float, Tensor] = {}  # norm type -> this step's total norm
        self._finished: dict[int, Finishing] = {}  # chunk index -> (streamed chunks: written by the worker)

    # ----- the schedule ---------------------------------------------------------------------
    def set_policy(self, policy: ClippingPolicy) -> None:
        """Between steps. Another configured clipping forgets the last norm."""
        if policy.configured != self.policy.configured:
            self.last_norm = None
        self.policy = policy

    @property
    def configured(self) -> ClippingConfig | None:
        return self.policy.configured

    def late_reason(self, *, steady: bool = False) -> str | None:
        """Why the next backward must hold the CPU updates for a late clipping request (None: it
        need not); ``steady``: after the first step."""
        if self.several_optimizers:
            return "several optimizers: each one's step updates its chunks"
        if self.policy.expect_late is not None:
            return "gradient clipping or gradient changes expected after backward"
        if self.read_seen:
            return "gradients read through p.grad after backward in an earlier step"
        if self.configured is not None or not self.policy.hold_first:
            return None  # (configured: a late request must match it, nothing to hold for)
        if self.late_seen:
            return "gradient clipping requested after backward in an earlier step"
        if self.steps == 0 and not steady:
            return "first step: gradient clipping may still be requested after backward"
        return None

    # ----- finishing ------------------------------------------------------------------------
    def finisher(self, chunk: Chunk) -> Finishing | None:
        """The CPU worker's job after a streamed chunk's last landing of the step (None: nothing
        to finish); the job only touches this chunk."""
        norm_type = self.configured.norm_type if clips_norm(self.configured) else self.policy.expect_late
        if self.scaler is None and norm_type is None:
            return None
        inv_scale = None if self.scaler is None else self.scaler.inv_scale()
        return Finishing(chunk, self._members(chunk), inv_scale, norm_type, self._finished)

    def _members(self, chunk: Chunk) -> list[int]:
        return [i for members in chunk.opt_members.values() for i in members if chunk.has_grad(i)]

    def finish_all(self, chunks: list[Chunk] | None = None) -> None:
        """Finish every chunk (of ``chunks``: default all) with gradients not finished yet (the
        persistent ones, and streamed ones last landed before this step's last backward; one
        without an accumulator had them consumed by its update). No update may be in flight."""
        inv_scale = None if self.scaler is None else self.scaler.inv_scale()
        for c in self.chunks if chunks is None else chunks:
            if c.index not in self._finished and c.opt_members and c.has_gradients and c.storage.grad_acc is not None:
                Finishing(c, self._members(c), inv_scale, None, self._finished)()

    def total_norm(self, norm_type: float) -> Tensor:
        """``clip_grad_norm_``'s total norm over the optimizer's parameters (after finish_all),
        of the per-tensor norms in the optimizer's parameter order. Once per step and norm type."""
        if norm_type in self._totals:
            return self._totals[norm_type]
        norms = {}  # parameter id -> the norm of its gradient
        for f in self._finished.values():
            if norm_type not in f.norms:
                grads = _grads(f.chunk, f.members)
                f.norms[norm_type] = list(torch._foreach_norm(grads, norm_type)) if grads else []
            # (a member whose gradient a zero_grad() cleared since is left out, as torch leaves out a .grad
            # of None: a zero in the stack would change vector_norm's order of additions)
            norms.update((id(f.chunk.params[i]), n) for i, n in zip(f.members, f.norms[norm_type])
                         if f.chunk.has_grad(i))
        ordered = [norms[id(p)] for group in self.optim.optimizer.param_groups for p in group["params"] if id(p) in norms]
        if not self.sharding.whole:
            total = self._sharded_total(ordered, norm_type)
        elif not ordered:
            total = torch.tensor(0.0, device=self.device)
        else:
            total = torch.linalg.vector_norm(self._stacked_on_device(ordered), norm_type)
        self._totals[norm_type] = total
        return total

    def _stacked_on_device(self, ordered: list[Tensor]) -> Tensor:
        """The per-tensor norms, in order, as one tensor on the device: one transfer per place
        they were taken (the host's through pinned memory on CUDA: no host wait)."""
        moved: dict[int, Tensor] = {}
        for where in {n.device for n in ordered}:
            ks = [k for k, n in enumerate(ordered) if n.device == where]
            stacked = torch.stack([ordered[k] for k in ks])
            if where != self.device and self.ctx.is_cuda:
                stacked = stacked.pin_memory()
            for k, n in zip(ks, stacked.to(self.device, non_blocking=self.ctx.is_cuda)):
                moved[k] = n
        return torch.stack([moved[k] for k in range(len(ordered))])

    def _sharded_total(self, ordered: list[Tensor], norm_type: float) -> Tensor:
        """The global norm over the ranks' pieces: each rank's norm's p-th power all-reduced (or
        the maximum), then the p-th root: ``clip_grad_norm_``'s up to the order of additions."""
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        if ordered:
            local = torch.linalg.vector_norm(self._stacked_on_device(ordered).float(), norm_type)
        if math.isinf(norm_type):
            op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
            return self.sharding.all_reduce_(local, op)
        return self.sharding.all_reduce_(local.pow(norm_type)).pow(1.0 / norm_type)

    def found_inf(self) -> Tensor:
        """1.0 when any gradient of the step overflowed (fp16) on any rank, on the host (after
        finish_all): summed on the device, all-reduced, read once (``to_host``: [Note: host waits])."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        for f in self._finished.values():
            if f.found_inf is not None:
                found += f.found_inf.to(self.device)
        self.sharding.all_reduce_(found, dist.ReduceOp.MAX)
        return (self.ctx.to_host(found) > 0).float()

    def check_consumed(self, *, backward: bool, final: bool = True) -> None:
        """Without accumulators (worker.py): refuse a backward inside ``no_sync`` (``final`` False),
        and a backward or step (``backward`` False) needing gradients an earlier update consumed."""
        if not self.consumed:
            return
        if not final:
            raise RuntimeError(
                "engine.backward() inside no_sync() adds this micro-batch's gradients to the next one's, but this "
                "engine keeps no gradient accumulators for its offloaded chunks (ProTrainConfig(grad_accumulator="
                "False)): each is updated as its gradients land. Keep the accumulators (grad_accumulator=None) "
                "to accumulate, or take one backward per step.")
        stale = [c.index for c in self.chunks if c.storage.gradients_consumed and c.has_gradients
                 and (backward or not c.applied)]
        if stale:
            raise RuntimeError(
                f"engine.{'backward' if backward else 'step'}() after a step without zero_grad: the gradients of "
                f"that step are gone from offloaded chunks {stale[:8]} (this engine keeps no gradient accumulators, "
                "ProTrainConfig(grad_accumulator=False): each chunk's update consumed them), where torch would "
                f"{'add to them' if backward else 'step with them again'}. Call engine.zero_grad() after each step, "
                "or keep the accumulators (grad_accumulator=None).")

    # ----- late requests --------------------------------------------------------------------
    def check_request(self, clipping: ClippingConfig, *, updated_in_backward: bool) -> None:
        """Refuse a clipping request between backward and step that cannot be exact."""
        if self.configured is not None:
            if clipping != self.configured:
                raise ValueError(
                    f"Gradient clipping {clipping} was requested after backward, but this engine "
                    f"already clips with {self.configured} at every step "
                    "(ProTrainConfig(clipping=...) / engine.clipping.configure / the Trainer's gradient_clip_val). "
                    "Configure one of the two: remove the configured setting, or the late call."
                )
            return
        if self.consumed:
            raise RuntimeError(
                f"Gradient clipping {clipping} was requested between backward and step, but this engine "
                "keeps no gradient accumulators (ProTrainConfig(grad_accumulator=False)): the offloaded chunks are "
                "updated with their gradients during backward. Configure clipping by value ahead "
                "(ProTrainConfig(clipping=...), the Trainer's gradient_clip_val), or keep the accumulators "
                "(grad_accumulator=None)."
            )
        if updated_in_backward:
            raise RuntimeError(
                f"Gradient clipping {clipping} was requested between backward and step, but no "
                "earlier step clipped, so ProTrain already updated the offloaded chunks during this backward "
                "with unclipped gradients. Clip from the first step on, or say so before training: "
                "ProTrainConfig(clipping=...), engine.clipping.expect_late(), or the Trainer's "
                "gradient_clip_val."
            )
        if self._late is not None:
            raise RuntimeError("Gradient clipping was already requested for this step; request it once per step.")

    def accept(self, clipping: ClippingConfig) -> None:
        """This step applies ``clipping`` (after ``check_request``; a no-op when configured)."""
        if self.configured is None:
            self._late, self.late_seen = clipping, True

    def apply_late(self) -> None:
        """This step's late request applied now, in place, as torch's clipping changes ``.grad``
        at once ([Note: gradients read through p.grad]). After ``late_norm`` / ``finish_all``."""
        clip, self._late = self._late, None
        if clip is None:
            return
        coef = _norm_coef(clip, self.last_norm) if clips_norm(clip) else None
        value = None if coef is not None else clip.value
        for f in self._finished.values():
            grads = _grads(f.chunk, f.members)
            clip_gradients(grads, None if coef is None else coef.to(f.chunk.storage.grad_acc.device), value)
            f.norms.clear()
        self._totals.clear()

    def late_norm(self, clipping: ClippingConfig) -> Tensor:
        """The total norm for a request by norm (after finish_all); it is the last norm now."""
        self.last_norm = self.total_norm(clipping.norm_type)
        return self.last_norm

    # ----- p.grad ---------------------------------------------------------------------------
    @property
    def read_since_backward(self) -> bool:
        """``p.grad`` was read since the last backward (its gradients are settled and finished)."""
        return bool(self._handed)

    def handed_out(self, chunk: Chunk) -> None:
        """``chunk``'s accumulator is readable through ``p.grad`` now ([Note: gradients read
        through p.grad]); its version counter says whether it changed by ``step()``."""
        self._handed.setdefault(chunk.index, (chunk, chunk.storage.grad_acc._version))
        self.read_seen = True

    def take_changes(self) -> None:
        """At ``step()``: a chunk read through ``p.grad`` has its norms taken again; a change after
        its update ran during backward is refused."""
        handed = list(self._handed.values())
        self._handed.clear()
        applied = [c.index for c, version in handed if c.applied and c.storage.grad_acc._version != version]
        if applied:
            raise RuntimeError(
                f"Gradients of chunks {applied[:8]} were changed through p.grad between backward and step, but "
                "ProTrain had already updated those (offloaded) chunks during backward with the gradients as they "
                "were. From the next step on it holds the updates for such changes; to have every step exact, say "
                "so before training: engine.clipping.expect_late() (Fabric: fabric.strategy.engine.clipping."
                "expect_late(); the Trainer does it when the LightningModule or a callback overrides "
                "on_before_optimizer_step, on_after_backward or configure_gradient_clipping).")
        for c, _ in handed:
            finished = self._finished.get(c.index)
            if finished is not None:
                finished.norms.clear()
        if handed:
            self._totals.clear()

    def forget_reads(self) -> None:
        """A backward begins (it adds to the accumulators) or a step or zero_grad ended."""
        self._handed.clear()
        self.readable = False

    # ----- the update -----------------------------------------------------------------------
    def needs_finishing(self) -> bool:
        return self.scaler is not None or clips_norm(self.configured) or clips_norm(self._late)

    def step_clip(self) -> tuple[UpdateClip, bool]:
        """This step's clipping for every chunk's Adam, and whether the step runs (fp16 overflow
        skips it). After ``finish_all`` when ``needs_finishing``."""
        clip = self._late or self.configured
        found_inf = None
        if self.scaler is not None:
            found_inf = self.found_inf()
            self.scaler.update(found_inf)
        coef = None
        if clips_norm(clip):
            # Also on a skipped fp16 step: the norm is then inf/nan, as clip_grad_norm_ reports it.
            total = self.last_norm = self.total_norm(clip.norm_type)
            coef = _norm_coef(clip, total)
        value = clip.value if clip is not None and clip.algorithm == "value" else None
        return UpdateClip(coef=coef, value=value), found_inf is None or not found_inf.item()

    def landing_clip(self) -> UpdateClip:
        """The clipping of updates during backward (only elementwise clipping allows them)."""
        clip = self.configured
        return UpdateClip(value=clip.value if clip is not None and clip.algorithm == "value" else None)

    def end_step(self) -> None:
        self.discard()
        self.steps += 1

    def discard(self) -> None:
        """Forget this step's finished gradients and requests (after step, or zero_grad)."""
        self._finished.clear()
        self._totals.clear()
        self._late = None
        self._handed.clear()
        self.readable = self.readable and self.several_optimizers


def _grads(chunk: Chunk, members: list[int]) -> list[Tensor]:
    """Views of ``members``' accumulated gradients."""
    return [chunk.values.state_view(chunk.storage.grad_acc, i) for i in members]


def _norm_coef(clipping: ClippingConfig, total: Tensor) -> Tensor:
    """``clip_grad_norm_``'s factor for a total norm: ``min(max_norm / (total + 1e-6), 1)``."""
    return torch.clamp(clipping.value / (total + 1e-6), max=1.0)
