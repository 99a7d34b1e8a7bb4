"""The device side: streams and events on CUDA, synchronous copies on the CPU.

[Note: streams]
All long-lived device memory is allocated on the compute (current) stream; the copy stream
only copies. A host->device fetch waits for the compute stream (the recycled block may still be
read by earlier kernels), copies on the copy stream and records an event that the compute stream
waits on before the chunk is used. A device->host gradient offload waits for the compute stream
(the gradients are written there) and records an event that the CPU worker synchronises on
before reading the host copy; the device buffers are freed only after that event completed.
Swapped activations use their own ``swap_stream`` with the same rules, so that device->host
activation copies in forward do not queue behind (or delay) the parameter prefetches.
Collectives of sharded chunks ([Note: sharded chunks] in sharding.py) run on ``comm_stream``
with the same rules: it waits for the compute stream (and for the upload of the rank's shard),
and the compute stream waits for its event before the chunk is used.
On the CPU there are no streams: copies and collectives run synchronously and events are ``None``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DeviceContext:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self.swap_stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self.comm_stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self.timeline = None  # a Timeline while Engine.record_timeline() records ([Note: the step timeline])

    def copy_async(self, dst: Tensor, src: Tensor, stream=None, after=None, *, span: tuple[str, str] = ("", "")):
        """Copy ``src`` into ``dst`` on ``stream`` (default: the copy stream) after the work
        queued so far on the compute stream (and ``after``, an event); return the event to wait
        on (None on the CPU). ``span``: (lane, label) of the copy in a recorded timeline."""
        return self._on_stream(stream or self.copy_stream, lambda: dst.copy_(src, non_blocking=self.is_cuda), after, span)

    def collective(self, fn, after=None, *, span: tuple[str, str] = ("collectives", "")):
        """Run ``fn`` (collectives) on the communication stream after the compute stream's work
        so far (and ``after``); return the event to wait on (None on the CPU: ``fn`` ran)."""
        return self._on_stream(self.comm_stream, fn, after, span)

    def _on_stream(self, stream, fn, after, span):
        timeline = self.timeline
        if not self.is_cuda:
            begin = None if timeline is None else timeline.stamp()
            fn()
            if timeline is not None:
                timeline.add(*span, begin, timeline.stamp())
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            begin = None if timeline is None else timeline.stamp(stream)
            fn()
            if timeline is not None:
                timeline.add(*span, begin, timeline.stamp(stream))
            return stream.record_event()

    def wait_on_compute(self, event) -> None:
        """Make the compute stream wait for ``event`` (no host blocking)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def synchronize(event) -> None:
        """Block the calling host thread until ``event`` completed."""
        if event is not None:
            event.synchronize()

    @staticmethod
    def done(event) -> bool:
        return event is None or event.query()

    def synchronize_stream(self, stream) -> None:
        """Block the calling host thread until the work queued on ``stream`` completed."""
        if stream is not None:
            stream.synchronize()

    def synchronize_device(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; use device='cpu' or None.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"Unsupported device {device}; ProTrain runs on 'cuda' or 'cpu'.")
    return device
