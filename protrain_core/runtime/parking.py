"""Moving a whole training state off the device and back between steps (``Engine.offload_states``
and ``Engine.onload_states``): for trainers that lend the GPU to something else between training
phases (a generation engine in reinforcement learning, an evaluation).

[Note: parking]
Offloading waits for the updates in flight, frees every streamed chunk's device buffer
(``Scheduler.release_all``), streams every persistent chunk (``Chunk.unpersist``: every state
copied into a host buffer of its own), moves the model's buffers to the host, and gives the
allocator's cached blocks back. Onloading makes the same chunks persistent again and moves the
buffers back. Only bytes are copied, so the steps after the round trip are bitwise the steps
without it; gradients accumulated since ``zero_grad`` travel too. The model cannot run while
its states are away (its forward is refused with the fix), but every state read works. With
``W`` processes onloading gathers the persistent chunks (a collective), offloading is local.

A persistent chunk keeps its host buffer after onloading (page-locking a new one at every
offload would take longer than the copy). Non-blocking offloading returns at once;
``OffloadedStates.wait()`` returns when the copies are over, and every state read waits for them
first (``Scheduler.copies_pending``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from protrain_core.memtrack import on_host
from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.scheduler import Scheduler


class OffloadedStates:
    """What ``Engine.offload_states`` moved to the host; ``wait()`` for a non-blocking one."""

    def __init__(self, ctx: DeviceContext, scheduler: Scheduler, event, *, chunks: tuple[int, ...],
                 buffers: list[tuple[Tensor, torch.device]], copied_bytes: int) -> None:
        self._ctx, self._scheduler, self._event = ctx, scheduler, event
        self.chunks = chunks  # the chunks that were persistent, made persistent again by onloading
        self.buffers = buffers  # (the model's buffer, its device) for each buffer moved to the host
        self.copied_bytes = copied_bytes  # bytes copied to the host (persistent chunks, buffers)

    def __repr__(self) -> str:
        return (f"OffloadedStates({len(self.chunks)} persistent chunks, {len(self.buffers)} buffers, "
                f"{self.copied_bytes} bytes copied, {'done' if self.done() else 'in flight'})")

    def done(self) -> bool:
        """The copies to the host are over (a non-blocking offload)."""
        return self._event is None or self._ctx.done(self._event)

    def wait(self) -> None:
        """Return when the copies are over and the device memory they read is free."""
        self._scheduler.wait_all()  # the copies first ([Note: parking])
        self._event = None
        self._ctx.empty_cache()


def check_between_steps(engine, what: str) -> None:
    """Refuse ``what`` inside a step of ``engine`` (from a training forward to ``engine.step()``)."""
    state = engine.step_state
    state.check_open()
    if not state.idle or state.batch_begun or any(c.applied or c.receiving for c in engine.chunks):
        raise RuntimeError(f"{what} was called within a step; call it after engine.step() (or before the "
                           "next forward).")
    if engine.hooks.backward_awaited():
        raise RuntimeError(f"{what} was called while the autograd graph of a forward that streamed chunks waits for "
                           "its backward (an output kept across a step, as a GAN's generated batch is): that backward "
                           "needs the chunks where they were. Call it after that backward, or once the graph is freed.")


def check_onloaded(engine, what: str) -> None:
    """Refuse ``what`` while the states are offloaded, with the fix."""
    if engine.offloaded is not None:
        raise RuntimeError(offloaded_message(what))


def offloaded_message(what: str) -> str:
    return (f"{what} needs the model's states on the device, but engine.offload_states() moved them to the host; "
            "call engine.onload_states() first (the Lightning strategies: trainer.strategy.onload_states() / "
            "fabric.strategy.onload_states(), e.g. in on_train_batch_start and on_validation_start).")


def offload(engine) -> OffloadedStates:
    """Every device byte of ``engine``'s training state to the host ([Note: parking])."""
    ctx, scheduler = engine.ctx, engine.scheduler
    engine.states.adopt_rebound()  # a value the user set between steps goes with the chunk
    scheduler.wait_all()
    scheduler.release_all()
    held = [c for c in engine.chunks if c.persistent]
    ctx.check_host_memory(sum(c.storage.fmt.streamed_host_bytes for c in held if c.storage.spare_pool is None),
                          "offloaded model states")
    last, copied = None, 0

    def copy(dst: Tensor, src: Tensor) -> None:
        nonlocal last, copied
        last = ctx.copy_async(dst, src, stream=ctx.d2h_stream, span=("device->host", "offload states")) or last
        ctx.record_stream(src, ctx.d2h_stream)  # its memory is reused only after the copy
        copied += src.numel() * src.element_size()

    buffers = []  # (the model's buffer, its device) for each buffer moved to the host
    with torch.no_grad():
        for b in engine.module.buffers():
            if b.device.type == ctx.device.type != ctx.host.type:
                with on_host():
                    host = torch.empty(b.shape, dtype=b.dtype, device=ctx.host, pin_memory=ctx.pin_memory)
                copy(host, b.data)
                buffers.append((b, b.device))
                b.data = host
        for c in held:
            c.unpersist(copy, parked=True)
    scheduler.copies_pending(last)
    return OffloadedStates(ctx, scheduler, last, chunks=tuple(c.index for c in held), buffers=buffers,
                           copied_bytes=copied)


def onload(engine, offloaded: OffloadedStates) -> None:
    """Back to the device what ``offload`` moved (``offloaded``) of ``engine``, on the host-to-device
    stream; the compute stream waits for each copy, the host thread for none."""
    ctx = engine.ctx
    offloaded.wait()

    def copy(dst: Tensor, src: Tensor) -> None:
        ctx.wait_on_compute(ctx.copy_async(dst, src, stream=ctx.h2d_stream, span=("host->device", "onload states")))

    with torch.no_grad():
        for b, device in offloaded.buffers:
            on_device = torch.empty(b.shape, dtype=b.dtype, device=device)
            copy(on_device, b.data)
            b.data = on_device
        for i in offloaded.chunks:
            engine.chunks[i].persist(keep_host=True, copy=copy)

