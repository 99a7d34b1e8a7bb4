"""The device side: streams and events on CUDA, synchronous copies on the CPU -- and the seam a
simulated device plugs into (protrain_core/simulator: [Note: the simulated device]).

[Note: streams]
All long-lived device memory is allocated on the compute (current) stream; the copy streams
only copy. Host->device and device->host copies run on two streams of their own (``h2d_stream``,
``d2h_stream``), so that both directions of the link are busy at once in backward (uploads of
the chunks backward needs next, offloads of the gradients it produced). A fetch waits for the
compute stream (the recycled block may still be read by earlier kernels), copies on the h2d
stream and records an event that the compute stream waits on before the chunk is used. A
gradient offload waits for the compute stream (the gradients are written there), copies on the
d2h stream and records an event that only its consumer, the CPU worker, waits on; the device
gradient buffer is freed in stream order (``record_stream``: the caching allocator reuses its
memory only after the copy), so no host thread waits for the copy.
Swapped activations use their own ``swap_stream`` with the same rules, so that device->host
activation copies in forward do not queue behind (or delay) the parameter prefetches.
Collectives of sharded chunks ([Note: sharded chunks] in sharding.py) run on ``comm_stream``
with the same rules: it waits for the compute stream (and for the upload of the rank's shard),
and the compute stream waits for its event where the result is used.
Orderings that make the separate streams safe: a streamed chunk's host compute copy is both the
source of its uploads and, in mixed precision, the landing area of its gradient offloads
(runtime/worker.py). The two never overlap in time: a chunk is uploaded only from ``HOST``,
which it reaches after an offload only through ``end_update`` -- the worker's job, which waits
for the offload's event, landed the gradients and restored the copy from the master
(scheduler.py ``_make_resident``). Activation swaps write and read host buffers of their own.
On the CPU there are no streams: copies run synchronously and their events are ``None``;
what ``record_stream`` does for a freed gradient buffer, ``BlockCache.free(t, after)`` does for a
CPU device's ([Note: a CPU device's block cache]).
Collectives are issued with ``async_op=True`` (gloo runs them on its own threads, beside the
compute, as DDP's are) and return a ``HostEvent``; what reads their results (the piece a
reduce-scatter keeps, its sum into the accumulator, the copy of it to the host) runs when the
event is waited for: at the end of backward, at the end of the step, or by the CPU worker before
it lands a streamed chunk's gradients. They are issued from the thread that drives the step, in
program order, so every rank's collectives still pair up, the user's own included.

[Note: host waits]
Every place on the training step's path where a host thread blocks on the device or on the CPU
worker, on CUDA, and why (the simulated device lists each by call site: ``protrain plan
--simulate``). Waits on the device:
- ``Engine.step``: the clipping coefficient (norm clipping), read on the host (``to_host``) once
  per step when a streamed chunk's update needs it; fp16's found-inf, read once per step to
  decide whether the step runs;
- the end of backward (``HostBuffers.trim``): swap buffers this backward did not use are freed
  only after the swap stream is done with them;
- a prefetch left unused at ``step()`` (``end_fetch(wait_on_host=True)``): the chunk's update is
  about to rewrite the host copy the upload reads;
- ``wait_all`` callers that read device state: state dicts, ``replan``, ``close``.
Waits on the CPU worker (no device involved):
- ``step()`` when the CPU Adam overlaps backward: it returns when every update is over;
- a fetch of a chunk whose update still runs (NEXT_FORWARD: the next forward's first use of it;
  a gradient-holding chunk evicted and fetched again within a backward);
- ``wait_all``: ``wait_for_updates``, ``zero_grad`` (for jobs it must not race), state dicts;
- the worker itself waits for each gradient offload it lands (its own thread).
Host collectives between ranks (sharded; gloo, no device): one per backward, on which
parameters the losses reach (``UsageCheck.begin``: [Note: sharded chunks]), issued before
it and read before its first chunk collective (``UsageCheck._verdict``); the longest
batch of the ranks before each micro-batch when plans follow batch lengths
(``Sharding.max_on_host``); the budgets at ``wrap``. A wait for a collective on CPU tensors
polls it (``wait_work``) instead of blocking in C, so that ctrl-C still ends every rank. Not the
runtime's: the model's own reads
(Hugging Face's attention-mask code reads a device value in every forward) and the user's
(``loss.item()``). The norms taken on the host move to the device from pinned memory, without
a wait. During backward the thread that drives the device waits only where
``BACKWARD_HOST_WAITS`` says (tests/test_simulator.py holds the runtime to it on a simulated
H100).
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch
from torch import Tensor

from protrain_core.utils import available_host_bytes, check_host_memory, total_host_bytes
from protrain_core.runtime.topology import Placement, worker_placement


# [Note: host waits]: where the thread that drives the device may block during backward (the
# innermost runtime frame, as the simulated device names a call site).
BACKWARD_HOST_WAITS = (
    "swap.py:HostBuffers.trim",  # the end of backward: swap buffers this backward did not use
    "chunk.py:Chunk.end_update",  # a chunk needed again while its CPU job runs
    # W processes: the usage check's all-reduce, issued before backward, read before its first
    # chunk collective (over by then unless the ranks' forwards took different times)
    "sharding.py:UsageCheck._verdict",
)


class HostEvent:
    """Collectives in flight on the CPU (gloo runs them on its own threads, beside the compute)
    and what runs once they are done: ``DeviceContext.collective`` on a CPU device returns one,
    and whoever needs the results waits (``wait``): the end of backward, the end of a step, the
    CPU worker before it lands a chunk's gradients. The continuations run once, on the thread
    that waits first, in the order they were added, after every collective of the event (none
    may feed a later collective of the same event). ``after``: an event to finish first."""

    def __init__(self, after: HostEvent | None = None, span=None) -> None:
        self.after, self.span = after, span  # span: (timeline, lane, label, begin) or None
        self.works: list = []
        self.continuations: list = []
        self._lock = threading.Lock()  # held by the thread that waits
        self._tail = threading.Lock()  # the continuations' list against ``later`` (never held long)
        self._ran = 0  # continuations started: none runs twice, even after one raised
        self._done = False

    def add(self, work, then=None) -> None:
        """A collective issued with ``async_op=True`` (its ``Work``), and what follows it."""
        if work is not None:
            self.works.append(work)
        if then is not None:
            self.continuations.append(then)

    @property
    def empty(self) -> bool:
        return self.after is None and not self.works and not self.continuations

    def query(self) -> bool:
        """Whether the collectives completed (the continuations may not have run yet)."""
        return self._done or (all(w.is_completed() for w in self.works) and (self.after is None or self.after.query()))

    def wait(self) -> None:
        with self._lock:
            if self._done:
                return
            if self.after is not None:
                self.after.wait()
            for work in self.works:
                wait_work(work)
            while True:  # (``later`` may append while they run)
                with self._tail:
                    if self._ran == len(self.continuations):
                        self._done = True
                        break
                    then = self.continuations[self._ran]
                    self._ran += 1
                then()
            if self.span is not None:
                timeline, lane, label, begin = self.span
                timeline.add(lane, label, begin, timeline.stamp())

    def later(self, fn) -> None:
        """Run ``fn`` once the event's collectives and continuations are over: after them, on the
        thread that waits, or now if the event is over already (from any thread, without waiting
        for a wait in progress elsewhere)."""
        with self._tail:
            if not self._done:
                self.continuations.append(fn)
                return
        fn()


class BlockCache:
    """A CPU device's freed blocks, handed out again for the next allocation of the same size
    and dtype: what the CUDA caching allocator does for a GPU.

    [Note: a CPU device's block cache]
    torch's CPU allocator gives a block of 32 MB or more back to the kernel when it is freed
    (glibc's largest mmap threshold), and the next one is mapped anew: every page faults in,
    zeroed by the kernel, the first time it is written -- 31 ms to write a new 39 MB block
    against 7 ms for one written before, on the 2-core VM of benchmarks/HISTORY.md ("A CPU
    device's gradient buffers kept"). A chunk's gradient buffer is such a block, allocated in
    every backward: at 80M parameters (``bench_ddp``, all-persistent) 63,000-70,000 page faults
    per backward, where DDP, whose buckets live as long as the model, takes 8,000-32,000.
    So on a CPU device the gradient buffers come from here, and go back once nothing reads
    them: ``free(t, after)`` returns ``t`` when the event ``after`` (the collectives and the copy
    that read it) is over -- the CPU form of freeing in stream order (``record_stream``). A
    block whose event is never waited (a backward that failed) is never handed out again; it
    is freed with the last reference to it. The cache holds at most what the runtime held at
    once before (every block in it was in use together); ``DeviceContext.empty_cache``
    (parking) and ``Engine.close`` empty it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        self._lock = threading.Lock()  # ``free`` may run on the CPU worker's thread (an event it waited for)
        self.allocated = self.reused = 0  # blocks allocated, and handed out again

    def __deepcopy__(self, memo) -> BlockCache:
        """Not a value (the device memory of one engine, and a lock): a deep copy of the model
        whose gradient hooks reach a chunk's storage shares it, as it shares the engine
        (``Engine.__deepcopy__``)."""
        memo[id(self)] = self
        return self

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """An uninitialised CPU tensor of ``numel`` elements: a freed block, else a new one."""
        with self._lock:
            blocks = self._free.get((numel, dtype))
            if blocks:
                self.reused += 1
                return blocks.pop()
            self.allocated += 1
        return torch.empty(numel, dtype=dtype, device="cpu")

    def free(self, t: Tensor, after: HostEvent | None = None) -> None:
        """``t`` (from ``empty``) is not read once ``after`` is over (None: now)."""
        keep = lambda: self._keep(t)  # noqa: E731
        keep() if after is None else after.later(keep)

    def _keep(self, t: Tensor) -> None:
        with self._lock:
            self._free.setdefault((t.numel(), t.dtype), []).append(t)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held for reuse."""
        with self._lock:
            return sum(t.numel() * t.element_size() for blocks in self._free.values() for t in blocks)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def wait_work(work) -> None:
    """Wait for a collective issued with ``async_op=True`` on CPU tensors (gloo) so that a signal
    still reaches Python. ``work.wait()`` holds the calling thread in C until the collective
    ends; when ctrl-C (SIGINT to every process) lands while the ranks wait on collectives that
    cannot end (the signal broke one off, or a rank stopped before issuing its part), no rank
    would ever run its KeyboardInterrupt and the run hangs until gloo's timeout (30 minutes).
    Polling ``is_completed`` with sleeps (10 us, doubling to 0.5 ms) lets the interrupt end every
    process within seconds; the final ``wait()`` raises the collective's own error, if any."""
    delay = 1e-5
    while not work.is_completed():
        time.sleep(delay)
        delay = min(2 * delay, 5e-4)
    work.wait()


_deferring = threading.local()


def deferring() -> HostEvent | None:
    """The event ``DeviceContext.collective`` is assembling on this thread (a CPU device), if
    any: the sharding's collectives join it with ``async_op=True`` instead of blocking."""
    return getattr(_deferring, "event", None)


class InlineExecutor(Executor):
    """Runs each job when it is submitted, on the calling thread (the CPU worker on a CPU device:
    [Note: CPU Adam on a CPU device] in worker.py). A job's error waits in its future, as from a
    thread; an interrupt or exit (ctrl-C lands on the main thread, which runs the job here) goes
    up at once: kept in the future, it would surface only when the step reads it, after the other
    ranks had ended and broken the collectives this rank still waits on."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - re-raised by the future's result(), as from a thread
            future.set_exception(e)
        return future


class DeviceContext:
    """Streams, events and host waits of one device (see [Note: streams]).

    ``device``: where device tensors live; ``host``: where host tensors live (the CPU; a
    size-only simulation keeps both on the meta device). ``asynchronous``: copies, collectives
    and the CPU worker run beside the compute stream (CUDA, or a simulated GPU); False: every
    copy runs inline (a CPU device). ``is_cuda``: a real CUDA device (pinned memory, CUDA
    events, ``record_stream``). ``blocks``: a CPU device's ``BlockCache`` (None elsewhere)."""

    blocks: BlockCache | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.device("cpu")
        self.is_cuda = self.asynchronous = device.type == "cuda"
        new = (lambda: torch.cuda.Stream(device=device)) if self.is_cuda else (lambda: None)
        self.h2d_stream, self.d2h_stream, self.swap_stream, self.comm_stream = new(), new(), new(), new()
        self.timeline = None  # a Timeline while Engine.record_timeline() records ([Note: the step timeline])
        # A CPU device issues collectives asynchronously and waits where their results are used
        # (gloo runs them on its own threads, as DDP's do); a CUDA device orders them on comm_stream.
        self.deferred_collectives = not self.is_cuda
        self.blocks = BlockCache() if device.type == "cpu" else None

    @property
    def pin_memory(self) -> bool:
        """Host buffers of streamed chunks can be page-locked (CUDA; the engine asks
        ``RuntimeConfig.pin_memory`` too)."""
        return self.is_cuda

    # ----- work on the side streams -------------------------------------------------------------
    def copy_async(self, dst: Tensor, src: Tensor, *, stream, span: tuple[str, str], after=None):
        """Copy ``src`` into ``dst`` on ``stream`` after the work queued so far on the compute
        stream (and ``after``, an event); return the event to wait on (None on the CPU).
        ``span``: (lane, label) of the copy in a recorded timeline; the lane, "host->device" or
        "device->host", is the copy's direction."""
        return self._on_stream(stream, lambda: dst.copy_(src, non_blocking=self.is_cuda), after, span)

    def run_on(self, stream, fn, *, span: tuple[str, str]):
        """Run ``fn`` (kernels: a quantised upload's dequantisation) on ``stream`` after the work
        queued so far there and on the compute stream; return the event to wait on (None on the
        CPU). ``span``: (lane, label) in a recorded timeline."""
        return self._on_stream(stream, fn, None, span)

    def collective(self, fn, after=None, *, then=None, span: tuple[str, str] = ("collectives", "")):
        """Run ``fn`` (collectives) and then ``then`` on the communication stream after the
        compute stream's work so far (and ``after``); return the event to wait on. On a CPU
        device ``fn``'s collectives are issued without blocking and ``then`` runs when the
        event is waited for (a ``HostEvent``; None if ``fn`` issued none and there is no
        ``then``)."""
        if not self.deferred_collectives:
            return self._on_stream(self.comm_stream, fn if then is None else lambda: (fn(), then()), after, span)
        self.synchronize(after)  # a CPU copy ran inline; a collective's results are needed now
        timeline = self.timeline
        event = HostEvent(span=None if timeline is None else (timeline, *span, timeline.stamp()))
        _deferring.event = event
        try:
            fn()
        finally:
            _deferring.event = None
        event.add(None, then)
        return None if event.empty else event

    def _on_stream(self, stream, fn, after, span):
        timeline = self.timeline
        if isinstance(after, HostEvent):  # a CPU copy of a collective's result: it runs when that is waited for
            def run() -> None:
                begin = None if timeline is None else timeline.stamp()
                fn()
                if timeline is not None:
                    timeline.add(*span, begin, timeline.stamp())

            event = HostEvent(after)
            event.add(None, run)
            return event
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

    def record_stream(self, t: Tensor, stream) -> None:
        """``t``'s memory is in use by ``stream``: freed, it is reused only after the work queued
        on ``stream`` so far (the caching allocator's stream-ordered free; no host wait)."""
        if self.is_cuda:
            t.record_stream(stream)

    # ----- waits ------------------------------------------------------------------------------
    def wait_on_compute(self, event) -> None:
        """Make the compute stream wait for ``event`` (no host blocking; a CPU device's
        collectives: the host waits for them)."""
        if isinstance(event, HostEvent):
            event.wait()
        elif event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event) -> None:
        """Block the calling host thread until ``event`` completed."""
        if isinstance(event, HostEvent):
            event.wait()
        elif event is not None:
            event.synchronize()

    def done(self, event) -> bool:
        return event is None or event.query()

    def synchronize_stream(self, stream) -> None:
        """Block the calling host thread until the work queued on ``stream`` completed."""
        if stream is not None:
            stream.synchronize()

    def synchronize_device(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Free (``nbytes`` 0) or re-allocate a chunk buffer's memory in place, its tensors kept."""
        storage.resize_(nbytes)

    def to_host(self, t: Tensor) -> Tensor:
        """``t`` (a small device tensor) on the host: a host wait for the compute stream on CUDA
        (one of the waits [Note: host waits] names)."""
        return t.to(self.host)

    # ----- the host side ------------------------------------------------------------------------
    def host_update(self, numel: int, state_format: str, folded_bytes: int = 0):
        """Around the CPU worker's update of a chunk's ``numel`` elements with moments in
        ``state_format`` (the landing folded, Adam, the compute copy written; ``folded_bytes``
        per element: the landing's, where it was folded before): nothing here; a simulated
        device charges it once, at its rate for the format less the landing folded before."""
        return contextlib.nullcontext()

    def worker(self, threaded: bool, placement: Placement | None = None) -> Executor:
        """The CPU worker's executor: a thread (``threaded``), else jobs run inline. ``placement``:
        the cores it and its intra-op threads run on (None: the process's threads)."""
        if not threaded:
            return InlineExecutor()
        setup = {} if placement is None else {"initializer": placement.bind}
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam", **setup)

    def clock(self) -> float:
        """Seconds on the calling host thread (``time.perf_counter``; simulated time on a
        simulated device)."""
        return time.perf_counter()

    def thread_name(self) -> str:
        """The calling host thread's name (a timeline's host spans carry it)."""
        return threading.current_thread().name

    def stamp(self, stream=None):
        """Now on ``stream`` for a timeline: a CUDA timing event recorded on it (default: the
        compute stream); on the CPU, ``clock()``."""
        if not self.is_cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def checkpoint_contexts(self):
        """``torch.utils.checkpoint``'s ``context_fn``: what a checkpointed block's forward and
        its recomputation run under (nothing here; a simulated device's kernel choices)."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    def elapsed(self, begin, end) -> float:
        """Seconds between two ``stamp()`` results (CUDA events: both complete)."""
        return begin.elapsed_time(end) / 1e3 if self.is_cuda else end - begin

    def empty_cache(self) -> None:
        """Give the allocator's cached free blocks back to the device (CUDA), so that another
        process or library can use them; on a CPU device, the ``BlockCache``'s."""
        if self.is_cuda:
            torch.cuda.empty_cache()
        if self.blocks is not None:
            self.blocks.clear()

    def check_host_memory(self, nbytes: int, what: str) -> None:
        """Refuse, with the numbers and the fix for this device, ``nbytes`` of host memory the
        machine does not have."""
        check_host_memory(nbytes, what, device_memory=self.asynchronous)

    @property
    def autocast_device_type(self) -> str | None:
        """The device type for ``torch.autocast`` (None: run in the parameters' dtypes)."""
        return self.device.type

    def available_host_bytes(self) -> int | None:
        """Host memory available for offloaded states (None: unknown)."""
        return available_host_bytes()

    def free_memory(self) -> tuple[int, int]:
        """(free, total) bytes of device memory (CUDA: ``torch.cuda.mem_get_info``)."""
        if self.is_cuda:
            return torch.cuda.mem_get_info(self.device)
        return available_host_bytes() or 0, total_host_bytes()

    def name(self) -> str:
        """What a profile's key and report call this device."""
        if self.is_cuda:
            return f"{self.device} {torch.cuda.get_device_name(self.device)}"
        return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def as_context(device: torch.device | str | DeviceContext | None) -> DeviceContext:
    """The DeviceContext of ``device`` (a DeviceContext is used as it is: a simulated device)."""
    if isinstance(device, DeviceContext):
        return device
    return DeviceContext(resolve_device(device))


def resolve_device(device) -> torch.device:
    """``device`` as a torch device; None: CUDA if any, else the CPU. A CUDA device without an
    index is this process's GPU (``local_gpu``)."""
    if device is None:
        return torch.device("cuda", local_gpu()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; use device='cpu' or None.")
        if device.index is None:
            device = torch.device("cuda", local_gpu())
    elif device.type != "cpu":
        raise ValueError(f"Unsupported device {device}; ProTrain runs on 'cuda' or 'cpu'.")
    return device


def local_gpu() -> int:
    """The GPU of this process when none is named: the current one -- unless torchrun started
    it as one of several processes of the node (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), the
    current GPU is still the first (nothing chose one), and the node's processes can each have
    their own: then GPU ``LOCAL_RANK``, as Lightning's launchers do, where every rank would
    otherwise take GPU 0. (A process that sees one GPU, each its own through
    ``CUDA_VISIBLE_DEVICES``, keeps it.)"""
    current = torch.cuda.current_device()
    local, processes = os.environ.get("LOCAL_RANK"), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if current != 0 or local is None or processes < 2 or processes > torch.cuda.device_count():
        return current
    return int(local)


def cpu_worker_placement(ctx: DeviceContext, world: int = 1, cores: tuple[int, ...] | None = None) -> Placement | None:
    """Where a threaded CPU worker of an engine sharded over ``world`` processes runs ([Note: CPU
    worker placement] in topology.py; ``cores``: ``RuntimeConfig.worker_cores``): on CUDA its
    share of this host's cores; elsewhere None, the process's own threads (on a CPU device they
    would compete with the compute). The engine's worker and the profiler's CPU Adam probe
    both ask here, so the probe times the updates on the threads that will run them."""
    return worker_placement(world, cores) if ctx.is_cuda else None
