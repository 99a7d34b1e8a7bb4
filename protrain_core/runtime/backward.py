"""The engine's backward passes: what ``engine.backward(loss)`` does around autograd's pass,
and the same pass around a ``loss.backward()`` the user starts.

[Note: loss.backward()]
A backward the user starts with ``loss.backward()`` or ``torch.autograd.grad`` instead of
``engine.backward(loss)`` runs the same pass: its first act that reaches the runtime (a unit's
backward hook, a gradient, or a checkpointed block's recomputation) finds the engine idle and
opens the pass there (``begins``), and a callback queued on autograd's engine (as FSDP2 does)
closes it when autograd's pass ends. Where another engine's ``engine.backward`` started it (a
GAN's generator loss through the discriminator), the pass only accumulates, as inside
``no_sync``: the gradients land for this engine's step, or its ``zero_grad``, as torch's would.
A pass that raised never reaches its callback: the engine's next verb or forward closes it as
failed (``ready``). A pass in which no parameter got a
gradient is not the step's backward. Refused with the fix: create_graph=True (its gradients'
graph would read released parameters), and a pass the user starts inside ``engine.step()``,
between the step's backward and its step, or where the loss itself is needed (the fp16 scale
multiplies it; several processes compare which parameters it reaches: ``UsageCheck``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor

_HOW = "engine.backward(loss) (in a LightningModule self.manual_backward(loss); with Fabric fabric.backward(loss))"
_RUNNING: list = []  # every engine's engine.backward() in progress (one loss's pass may reach several engines)


def check_trains(trains: bool, what: str) -> None:
    """Refuse a training verb of an engine built for evaluation only."""
    if not trains:
        raise RuntimeError(
            f"{what} on an evaluation-only ProTrain engine (wrap(optimizer_states=False)): it holds no optimizer "
            "states. Wrap with optimizer_states=True to train."
        )


class BackwardPasses:
    def __init__(self, *, grads, clipping, scheduler, observers, trains: bool) -> None:
        """``observers``: the engine's step observers; ``trains``: the engine holds optimizer
        states (else a backward outside no_sync is refused). Nothing here refers to the engine."""
        self.step_state, self.grads, self.clipping, self.scheduler = scheduler.phase, grads, clipping, scheduler
        self.observers, self.scaler, self.trains = observers, grads.scaler, trains
        self.activations = None  # the engine's ActivationManager (set_activations)
        self._open: ExitStack | None = None  # a loss.backward()'s pass, until autograd's ends

    def set_activations(self, activations) -> None:
        """The blocks' activation manager now (``Engine.set_block_modes`` replaces it)."""
        self.activations = activations

    def run(self, loss: Tensor, run=None) -> None:
        """``engine.backward(loss, run)``."""
        _RUNNING.append(self)
        try:
            with self.around(loss):
                if self.scaler is not None:
                    loss = loss * self.scaler.scale.to(loss.device)
                loss.backward() if run is None else run(loss)
        finally:
            _RUNNING.remove(self)

    @contextmanager
    def around(self, loss: Tensor | None):
        """What one backward does around autograd's pass (``loss``: None where the user's
        ``loss.backward()`` started it)."""
        self.ready()
        self.clipping.zeroed_in_place()
        if self.scheduler.stepped_backward:
            raise RuntimeError(
                "engine.backward() was called twice without engine.step(), but the first backward "
                "already finished this step's gradients (ProTrain updates offloaded chunks during "
                "backward, or unscales them and takes their norms). For gradient accumulation, run "
                "the non-final micro-batches inside `with engine.no_sync():` (in a Fabric loop: `with "
                "fabric.no_backward_sync(model):`; the Trainer does it for accumulate_grad_batches).")
        self.grads.apply_late()  # a clipping requested since the last backward clips what it saw, as torch's
        state = self.step_state
        if state.final_micro_batch:
            check_trains(self.trains, "backward() outside no_sync()")
        self.grads.check_consumed(backward=True, final=state.final_micro_batch)
        self.clipping.schedule_updates()
        self.grads.forget_reads()
        self.observers.notify(lambda o: o.backward_begins())
        try:
            with self.scheduler.backward_pass(boundary=state.final_micro_batch, loss=loss), \
                    self.activations.backward_pass():
                yield
            self.grads.readable = True  # p.grad reads the gradients until step() or zero_grad
        except BaseException:  # one process: the gradients that arrived, as torch leaves them
            self.grads.readable = self.scheduler.sharding.whole  # ([Note: a backward that raised])
            raise
        finally:
            state.micro_batch_ended()
            self.observers.notify(lambda o: o.backward_ends())

    def hook(self) -> None:
        """The first act of every runtime backward hook: refuse create_graph=True (autograd runs
        its hooks with gradients on); a backward finding the engine idle ``begins``."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "A backward with create_graph=True reached ProTrain-managed modules (a gradient penalty, a "
                "higher-order gradient): the graph of its gradients would read a streamed chunk's parameters after "
                "ProTrain released them. Compute the penalty outside the model, or train that model without ProTrain.")
        self.begins()

    def begins(self) -> None:
        """A hook or a recomputation found the engine idle: a backward the user started begins
        here, and ends when autograd's pass does."""
        if not self.step_state.idle:
            return
        what = "A backward started outside engine.backward(loss) (loss.backward(), torch.autograd.grad)"
        if self.step_state.optimizer_step:  # (torch would apply its gradients in this step; the update ran)
            raise RuntimeError(f"{what} reached the model inside engine.step(), from the optimizer's step hooks: the "
                               "step's update already ran. Run the backward before the step.")
        if self.scheduler.stepped_backward:
            raise RuntimeError(f"{what} reached the model between the step's backward and engine.step(), which "
                               "finished the step's gradients. Run it before that backward, or after the step.")
        if self.scaler is not None:
            raise RuntimeError(f"{what} with precision='16-mixed': the loss is scaled first. Call {_HOW}.")
        if not self.scheduler.sharding.whole:
            raise RuntimeError(f"{what} with several processes: the ranks compare which parameters the loss reaches "
                               f"before the backward's first collective. Call {_HOW}.")
        stack = ExitStack()
        if any(p is not self for p in _RUNNING):  # another engine's loss (a GAN's generator loss through
            stack.enter_context(self.step_state.accumulating())  # the discriminator): its gradients only land
        stack.enter_context(self.around(None))
        self._open = stack

        def end() -> None:
            self._open = None
            stack.close()

        torch.autograd.Variable._execution_engine.queue_callback(end)

    def ready(self) -> None:
        """Not closed, and no ``loss.backward()`` half done: one that raised ends here, as failed."""
        self.step_state.check_open()
        failed, self._open = self._open, None
        if failed is not None:
            error = RuntimeError("loss.backward() raised")
            failed.__exit__(type(error), error, None)
