"""``engine.clipping``: gradient clipping and gradient norms of one engine, and the update
schedule they imply.

Clipping decides when the CPU Adam of streamed chunks may run: by value it runs during backward
(each chunk is clamped right before its own update); by norm, or when a clipping may still be
requested between backward and step, it waits for the global norm and overlaps the next forward
(update.py). This face keeps the scheduler's ``UpdatePolicy`` in step with the setting; the
gradients, their norms and the late requests live in ``StepGradients`` (gradients.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from protrain_core.phase import StepState
from protrain_core.precision import Precision
from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.gradients import StepGradients
from protrain_core.runtime.scheduler import Scheduler, UpdatePolicy
from protrain_core.update import ClippingConfig, Overlap, clips_norm, overlap_mode

_NEEDS_ACCUMULATORS = (
    "{what}, but this engine keeps no gradient accumulators for its offloaded chunks "
    "(ProTrainConfig(grad_accumulator=False)): each is updated as its gradients land, during backward. "
    "Keep the accumulators (grad_accumulator=None), or clip by value, configured ahead."
)


class Clipping:
    """Gradient clipping as plain PyTorch does it, over the optimizer's parameters, on the
    gradients Adam reads (fp32 in mixed precision, after fp16 unscaling): configured ahead
    (``configure``) or requested between backward and step (``clip_grad_norm_``)."""

    def __init__(self, grads: StepGradients, scheduler: Scheduler, chunks: list[Chunk], precision: Precision,
                 state: StepState) -> None:
        self._grads, self._scheduler, self._chunks = grads, scheduler, chunks
        self._precision, self._state = precision, state
        self.schedule_updates()

    def configure(self, algorithm: str | None, value: float | None = None, norm_type: float = 2.0) -> None:
        """Clip the gradients before every update exactly as ``torch.nn.utils.clip_grad_norm_(params,
        value, norm_type)`` (``algorithm`` "norm") or ``clip_grad_value_(params, value)`` ("value")
        would; None turns it off. "value" is elementwise, so streamed chunks are still updated
        during backward; "norm" needs the global norm first, so their Adam overlaps the next
        forward (``engine.overlap``); ``last_norm`` holds the total norm before clipping. Call it
        between steps (setting the current value again is a no-op at any time)."""
        self._state.check_open()
        clipping = None if algorithm is None else ClippingConfig(algorithm=algorithm, value=value, norm_type=norm_type)
        if clipping == self._grads.configured:
            return
        self._refuse_several("engine.clipping.configure()")
        if not self._state.idle:
            raise RuntimeError("engine.clipping.configure() was called during backward; call it between steps.")
        if clips_norm(clipping) and self._grads.consumed:
            raise ValueError(_NEEDS_ACCUMULATORS.format(what="Clipping by norm needs every gradient of the step "
                                                             "before any update"))
        if self._updated_in_backward():
            raise RuntimeError(
                "Gradient clipping changed between engine.backward() and engine.step(), but ProTrain "
                "already updated offloaded chunks during backward with the previous setting. Change "
                "it after engine.step(), before the next backward."
            )
        self._scheduler.wait_all()  # no update in flight reads the setting
        self._grads.set_policy(dataclasses.replace(self._grads.policy, configured=clipping))
        self.schedule_updates()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, between ``backward``
        and ``step`` (as ``fabric.clip_gradients`` does): returns the total norm before clipping.
        Exact when no chunk was updated during this backward: the engine holds the updates of
        its first step, and of every step after one that clipped late ([Note: finishing
        gradients early] in gradients.py). With clipping configured ahead (``configure``), the
        same setting only returns the norm."""
        clipping = self._late_request("norm", max_norm, norm_type)
        total = self._grads.late_norm(clipping)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total {norm_type:g}-norm of the gradients is non-finite ({total.item()}), so it cannot be "
                "clipped (clip_grad_norm_ with error_if_nonfinite=True). Pass error_if_nonfinite=False to scale "
                "the gradients by it anyway (under fp16 the step is then skipped by the loss scaler)."
            )
        self._accept(clipping)
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_(params, clip_value)`` over the optimizer's parameters,
        between ``backward`` and ``step`` (see ``clip_grad_norm_``)."""
        self._accept(self._late_request("value", clip_value))

    def _accept(self, clipping) -> None:
        """A late request: applied at step(), fused with the update -- or at once where ``p.grad``
        shows the gradients (``_hand_out``), or when another backward adds to them first."""
        self._grads.accept(clipping)
        if self._grads.read_since_backward:
            self._grads.apply_late()

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The total norm of the gradients over the optimizer's parameters, between ``backward``
        and ``step`` (as ``torch.nn.utils.get_total_norm`` of their ``.grad``; after fp16
        unscaling), without clipping anything."""
        ClippingConfig(value=1.0, norm_type=norm_type)  # refuses a wrong norm_type
        self._check_gradients("engine.clipping.grad_norm()")
        if self._grads.consumed and self._updated_in_backward():
            raise RuntimeError(_NEEDS_ACCUMULATORS.format(
                what="engine.clipping.grad_norm() reads the step's gradients, but the offloaded chunks consumed theirs "
                     "when they were updated during backward"))
        clip = self._grads.configured
        if clip is not None and clip.algorithm == "value" and self._updated_in_backward():
            raise RuntimeError(
                "engine.clipping.grad_norm() is the norm before clipping, but with clipping by value configured "
                "ahead the offloaded chunks' gradients were clamped when they were updated during backward. Request "
                "the clipping between backward and step instead (engine.clipping.clip_grad_value_) to measure it "
                "first."
            )
        self._scheduler.wait_all()
        self._grads.finish_all()
        return self._grads.total_norm(norm_type)

    def expect_late(self, expected: bool = True, norm_type: float = 2.0) -> None:
        """Say whether gradient clipping will be requested, or gradients changed through
        ``p.grad``, between backward and step. ``expected`` True: every step's updates wait for
        step() (the ``norm_type`` norms are taken as gradients land); False: never (a late
        request is then refused). Not called: the first step is held, and every step after one
        that clipped late or read ``p.grad``."""
        ClippingConfig(value=1.0, norm_type=norm_type)  # refuses a wrong norm_type
        if expected and self._grads.consumed:
            raise ValueError(_NEEDS_ACCUMULATORS.format(what="Clipping requested between backward and step needs "
                                                             "every gradient of the step before any update"))
        self._grads.set_policy(dataclasses.replace(self._grads.policy, expect_late=norm_type if expected else None,
                                                   hold_first=expected))
        self.schedule_updates()

    def grad_of(self, chunk: Chunk, i: int) -> Tensor | None:
        """What ``p.grad`` of member ``i`` of ``chunk`` reads ([Note: gradients read through p.grad]
        in gradients.py): a view of its accumulated gradient, or None (the parameter's own)."""
        state = self._state
        if not (self._grads.readable and state.idle and not state.optimizer_step and chunk.has_grad(i)):
            return None
        if not self._scheduler.sharding.whole:
            raise RuntimeError(
                f"p.grad of {chunk.spec.members[i].name} was read with ProTrain sharding the gradients over "
                f"{self._scheduler.sharding.world} processes: no rank holds it whole. Use engine.clipping "
                "(clip_grad_norm_, clip_grad_value_, grad_norm), or Lightning's gradient_clip_val / "
                "self.clip_gradients, which work on the shards.")
        if not chunk.storage.fmt.accumulator:
            raise RuntimeError(_NEEDS_ACCUMULATORS.format(
                what=f"p.grad of {chunk.spec.members[i].name} was read between backward and step"))
        self._hand_out(chunk)
        return chunk.values.state_view(chunk.storage.grad_acc, i)

    def _hand_out(self, chunk: Chunk) -> None:
        """``chunk``'s gradients reach the user's code in the window after backward: read or cleared."""
        if not self._grads.read_since_backward:  # the window's first read: every landing and update in flight over
            self._scheduler.wait_all()
            if self.gradients_ready:
                self._grads.finish_all()  # fp16: unscaled, as the update reads them
                self._grads.apply_late()  # a clipping requested before: p.grad shows it, as torch's
        self._grads.handed_out(chunk)

    def clear_grads(self, members: list[tuple[Chunk, int]]) -> None:
        """``p.grad = None`` of these members (``(chunk, i)``), or a module's ``zero_grad()``: no
        step updates them before a backward gives them new gradients. Inside a forward, backward
        or optimizer step nothing is cleared (torch's leaves a running backward's)."""
        members = [(c, i) for c, i in members if c.has_grad(i)]
        if not members or not self._state.idle or self._state.optimizer_step:
            return
        if self._grads.readable:  # a change in the window: step() takes its norms again
            for c in {id(c): c for c, _ in members if c.storage.fmt.accumulator}.values():
                self._hand_out(c)
        if self._scheduler.clear_grads(members):
            self._grads.discard()  # (every gradient cleared: what zero_grad leaves)

    def zeroed_in_place(self) -> None:
        """Before a backward: where every gradient of the step's finished backward was zeroed
        through ``p.grad`` (torch's ``zero_grad(set_to_none=False)``), clear them as ``zero_grad``
        does, so the backward starts the step afresh (torch's adds to the zeros)."""
        if not (self._scheduler.stepped_backward and self._grads.read_since_backward):
            return
        members = [(c, i) for c in self._chunks for i in range(len(c.spec.members)) if c.has_grad(i)]
        if all(c.storage.fmt.accumulator and not c.values.state_view(c.storage.grad_acc, i).any() for c, i in members):
            self.clear_grads(members)

    @property
    def configured(self) -> ClippingConfig | None:
        """The clipping configured ahead (``configure``)."""
        return self._grads.configured

    @property
    def last_norm(self) -> Tensor | None:
        """The total norm before clipping of the last step clipped by norm (or ``clip_grad_norm_``)."""
        return self._grads.last_norm

    @property
    def gradients_ready(self) -> bool:
        """The step's gradients are complete and not used yet: after a backward outside no_sync
        (or, under manual optimization, inside it), before ``step()``."""
        if not self._state.idle:
            return False
        accumulated = (self._state.manual and any(c.has_gradients for c in self._chunks)
                       and not self._updated_in_backward())
        return self._scheduler.stepped_backward or accumulated

    def overlap(self, *, steady: bool = False) -> Overlap:
        """When the CPU Adam runs now; ``steady``: after the first step (what plans are searched for)."""
        return overlap_mode(self._precision, self._grads.configured,
                            late_clipping=self._grads.late_reason(steady=steady))

    def schedule_updates(self) -> None:
        """Give the scheduler the update policy of the current setting (before every backward:
        whether a step is held can change after the first)."""
        self._scheduler.set_policy(UpdatePolicy(during_backward=self.overlap().during_backward,
                                                landing_clip=self._grads.landing_clip()))

    def describe(self, choice=None) -> str:
        """One line for ``engine.summary()``/``explain()``; ``choice``: the search's PlanChoice."""
        clip = self._grads.configured
        if clip is None:
            return "gradient clipping: off" + (" (requested after backward)" if self._grads.late_seen else "")
        if clip.algorithm == "value":
            return (f"gradient clipping {clip}: elementwise, per chunk before its Adam; the CPU Adam still "
                    "overlaps backward")
        line = (f"gradient clipping {clip}: the norms are taken as gradients land, and the CPU Adam of offloaded "
                "chunks runs after backward, overlapping the next forward")
        steady = self.overlap(steady=True).schedule
        if choice is not None and choice.schedule is not steady:
            line += (f"; this plan was searched for {choice.schedule.value}: ProTrainConfig(clipping={{'algorithm': "
                     f"'norm', ...}}) searches for {steady.value}")
        return line

    def _refuse_several(self, what: str) -> None:
        if self._grads.several_optimizers:  # (one step of every trainable parameter: [Note: several optimizers])
            raise RuntimeError(
                f"{what}: this engine steps several optimizers, one at a time, and ProTrain clips the gradients of "
                "one optimizer's whole step; clipping per optimizer is not supported. Train without clipping, or with "
                "one optimizer (a param group per model part) and clip that.")

    def _late_request(self, algorithm: str, value, norm_type: float = 2.0) -> ClippingConfig:
        self._refuse_several(f"engine.clipping.clip_grad_{algorithm}_()")
        clipping = ClippingConfig(algorithm=algorithm, value=value, norm_type=norm_type)
        self._check_gradients(f"engine.clipping.clip_grad_{algorithm}_()")
        self._grads.check_request(clipping, updated_in_backward=self._updated_in_backward())
        self._scheduler.wait_all()  # every gradient in its accumulator
        self._grads.finish_all()
        return clipping

    def _check_gradients(self, what: str) -> None:
        self._state.check_open()
        if not self.gradients_ready:
            raise RuntimeError(
                f"{what} reads the step's gradients: call it after engine.backward() of the step's last "
                "micro-batch (outside no_sync) and before engine.step()."
            )

    def _updated_in_backward(self) -> bool:
        return any(c.applied for c in self._chunks)
