"""The device side: streams and events on CUDA, synchronous copies on the CPU -- and the seam a
simulated device plugs into (protrain_core/simulator: [Note: the simulated device]).

[Note: streams]
All long-lived device memory is allocated on the compute (current) stream; the other streams
only copy or communicate: ``h2d_stream`` and ``d2h_stream`` (both directions of the link busy at
once), ``swap_stream`` (activation swaps, not queued behind prefetches) and ``comm_stream``
(collectives of sharded chunks). Each waits for the compute stream before its work and records
an event its consumer waits on (the compute stream; for a gradient offload, only the CPU
worker). A buffer another stream reads is freed in stream order (``record_stream``). A streamed
chunk's host compute copy is both the source of its uploads and, in mixed precision, where its
gradients land (runtime/worker.py); the two never overlap, as a chunk is uploaded only from
``HOST``, reached after an offload only through ``end_update``. On the CPU there are no
streams: copies run inline, their events are ``None``, and ``BlockCache.free(t, after)`` does
what ``record_stream`` does. Collectives are issued with ``async_op=True`` from the thread that
drives the step, in program order (so every rank's pair up), and return a ``HostEvent``; what
reads their results runs when it is waited for.

[Note: host waits]
Where a host thread blocks on the training step's path, on CUDA (the simulated device lists each
by call site: ``protrain plan --simulate``). On the device: ``Engine.step`` reads the clipping
coefficient (``to_host``) and fp16's found-inf, once per step each; the end of backward frees
unused swap buffers after the swap stream (``HostBuffers.trim``); a prefetch left unused at
``step()`` (``end_fetch(wait_on_host=True)``); ``wait_all`` callers that read device state (state
dicts, ``replan``, ``close``). On the CPU worker: ``step()`` when the CPU Adam overlaps backward;
a fetch of a chunk whose update still runs; ``wait_all``; the worker itself waits for each
offload it lands. Host collectives between ranks (gloo, polled by ``wait_work`` so that ctrl-C
ends every rank): the usage check of each backward (``UsageCheck``), the longest batch when
plans follow batch lengths (``Sharding.max_on_host``), the budgets at ``wrap``. During backward
the thread that drives the device waits only where ``BACKWARD_HOST_WAITS`` says
(tests/test_simulator.py holds the runtime to it).
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


# [Note: host waits]: where the thread that drives the device may block during backward.
BACKWARD_HOST_WAITS = (
    "swap.py:HostBuffers.trim",  # the end of backward: swap buffers this backward did not use
    "chunk.py:Chunk.end_update",  # a chunk needed again while its CPU job runs
    "sharding.py:UsageCheck._verdict",  # W processes: the usage check's all-reduce (over by then, mostly)
)


class HostEvent:
    """Collectives in flight on the CPU and what runs once they are done (``span``: its timeline
    span). The continuations run once, on the thread that waits first, in the order added, after
    every collective of the event. ``after``: an event to finish first."""

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
        """Run ``fn`` once the event's collectives and continuations are over: on the thread that
        waits, or now if the event is over already."""
        with self._tail:
            if not self._done:
                self.continuations.append(fn)
                return
        fn()


class BlockCache:
    """A CPU device's freed blocks, handed out again for an allocation of the same size and dtype.

    [Note: a CPU device's block cache]
    torch's CPU allocator gives a block of 32 MB or more back to the kernel when it is freed,
    and every page of the next one faults in when first written (31 ms for a new 39 MB block
    against 7 ms: benchmarks/HISTORY.md, "A CPU device's gradient buffers kept"). A chunk's
    gradient buffer is such a block, allocated in every backward, so on a CPU device it comes
    from here and goes back once the event ``after`` of ``free(t, after)`` is over (the CPU form
    of ``record_stream``). ``DeviceContext.empty_cache`` and ``Engine.close`` empty it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        self._lock = threading.Lock()  # ``free`` may run on the CPU worker's thread (an event it waited for)
        self.allocated = self.reused = 0  # blocks allocated, and handed out again

    def __deepcopy__(self, memo) -> BlockCache:
        """Not a value (one engine's device memory, and a lock): a deep copy shares it."""
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
        def keep() -> None:
            with self._lock:
                self._free.setdefault((t.numel(), t.dtype), []).append(t)

        keep() if after is None else after.later(keep)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held for reuse."""
        with self._lock:
            return sum(t.numel() * t.element_size() for blocks in self._free.values() for t in blocks)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def wait_work(work) -> None:
    """Wait for a collective issued with ``async_op=True`` on CPU tensors (gloo) so that ctrl-C
    still reaches Python (``work.wait()`` holds the thread in C until gloo's timeout): poll
    ``is_completed`` (10 us, doubling to 0.5 ms), then ``wait()`` raises the error, if any."""
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
    """Runs each job when it is submitted, on the calling thread ([Note: CPU Adam on a CPU
    device] in worker.py). A job's error waits in its future; an interrupt or exit goes up."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - re-raised by the future's result(), as from a thread
            future.set_exception(e)
        return future


class DeviceContext:
    """Streams, events and host waits of one ``device`` ([Note: streams]). ``host``: where host
    tensors live; ``asynchronous``: copies, collectives and the CPU worker run beside the compute
    stream (CUDA, or a simulated GPU); ``blocks``: a CPU device's ``BlockCache``."""

    blocks: BlockCache | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.device("cpu")
        self.is_cuda = self.asynchronous = device.type == "cuda"
        new = (lambda: torch.cuda.Stream(device=device)) if self.is_cuda else (lambda: None)
        self.h2d_stream, self.d2h_stream, self.swap_stream, self.comm_stream = new(), new(), new(), new()
        self.timeline = None  # a Timeline while Engine.record_timeline() records ([Note: the step timeline])
        # A CPU device waits for its collectives where their results are used; CUDA orders them on comm_stream.
        self.deferred_collectives = not self.is_cuda
        self.blocks = BlockCache() if device.type == "cpu" else None

    @property
    def pin_memory(self) -> bool:
        """Host buffers of streamed chunks can be page-locked (CUDA)."""
        return self.is_cuda

    # ----- work on the side streams -------------------------------------------------------------
    def copy_async(self, dst: Tensor, src: Tensor, *, stream, span: tuple[str, str], after=None):
        """Copy ``src`` into ``dst`` on ``stream`` after the work queued so far on the compute
        stream (and ``after``, an event); return the event to wait on (None on the CPU).
        ``span``: (lane, label) of the copy in a recorded timeline."""
        return self._on_stream(stream, lambda: dst.copy_(src, non_blocking=self.is_cuda), after, span)

    def run_on(self, stream, fn, *, span: tuple[str, str]):
        """Run ``fn`` (kernels) on ``stream``, as ``copy_async`` runs its copy."""
        return self._on_stream(stream, fn, None, span)

    def collective(self, fn, after=None, *, then=None, span: tuple[str, str] = ("collectives", "")):
        """Run ``fn`` (collectives) and then ``then`` on the communication stream, as ``copy_async``
        runs its copy. On a CPU device ``fn``'s collectives are issued without blocking and
        ``then`` runs when the event is waited for (a ``HostEvent``; None if there is nothing)."""
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
            event = HostEvent(after)
            event.add(None, lambda: _timed(timeline, fn, span))
            return event
        if not self.is_cuda:
            _timed(timeline, fn, span)
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            _timed(timeline, fn, span, stream)
            return stream.record_event()

    def record_stream(self, t: Tensor, stream) -> None:
        """``t``'s memory, freed, is reused only after the work queued on ``stream`` so far."""
        if self.is_cuda:
            t.record_stream(stream)

    # ----- waits ------------------------------------------------------------------------------
    def wait_on_compute(self, event) -> None:
        """Make the compute stream wait for ``event`` (a ``HostEvent``: the host waits)."""
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
        """``t`` (a small device tensor) on the host ([Note: host waits])."""
        return t.to(self.host)

    # ----- the host side ------------------------------------------------------------------------
    def host_update(self, numel: int, state_format: str, folded_bytes: int = 0):
        """Around the CPU worker's update of ``numel`` elements with moments in ``state_format``
        (``folded_bytes`` per element folded before): nothing here; a simulated device's time."""
        return contextlib.nullcontext()

    def worker(self, threaded: bool, placement: Placement | None = None) -> Executor:
        """The CPU worker's executor: a thread (``threaded``), else jobs run inline. ``placement``:
        the cores it and its intra-op threads run on (None: the process's threads)."""
        if not threaded:
            return InlineExecutor()
        setup = {} if placement is None else {"initializer": placement.bind}
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam", **setup)

    def clock(self) -> float:
        """Seconds on the calling host thread (simulated time on a simulated device)."""
        return time.perf_counter()

    def thread_name(self) -> str:
        """The calling host thread's name (a timeline's host spans carry it)."""
        return threading.current_thread().name

    def stamp(self, stream=None):
        """Now on ``stream`` (default: the compute stream): a CUDA timing event, else ``clock()``."""
        if not self.is_cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def checkpoint_contexts(self):
        """``torch.utils.checkpoint``'s ``context_fn`` (nothing here; a simulated device's)."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    def elapsed(self, begin, end) -> float:
        """Seconds between two ``stamp()`` results (CUDA events: both complete)."""
        return begin.elapsed_time(end) / 1e3 if self.is_cuda else end - begin

    def empty_cache(self) -> None:
        """Give the allocator's cached free blocks back (CUDA; a CPU device's ``BlockCache``)."""
        if self.is_cuda:
            torch.cuda.empty_cache()
        if self.blocks is not None:
            self.blocks.clear()

    def check_host_memory(self, nbytes: int, what: str) -> None:
        """Refuse, with the fix, ``nbytes`` of host memory for ``what`` the machine does not have."""
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


def _timed(timeline, fn, span: tuple[str, str], stream=None) -> None:
    """``fn()``, recorded in ``timeline`` (None: none records) as ``span`` (lane, label)."""
    begin = None if timeline is None else timeline.stamp(stream)
    fn()
    if timeline is not None:
        timeline.add(*span, begin, timeline.stamp(stream))


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
    """The GPU of this process when none is named: the current one, unless torchrun started
    several processes on the node, nothing chose a GPU (the current one is 0) and each can have
    its own: then GPU ``LOCAL_RANK``, as Lightning's launchers do."""
    current = torch.cuda.current_device()
    local, processes = os.environ.get("LOCAL_RANK"), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if current != 0 or local is None or processes < 2 or processes > torch.cuda.device_count():
        return current
    return int(local)


def cpu_worker_placement(ctx: DeviceContext, world: int = 1, cores: tuple[int, ...] | None = None) -> Placement | None:
    """Where a threaded CPU worker of an engine sharded over ``world`` processes runs ([Note: CPU
    worker placement] in topology.py; ``cores``: ``RuntimeConfig.worker_cores``) on ``ctx``: on
    CUDA its share of this host's cores; elsewhere None, the process's own threads."""
    return worker_placement(world, cores) if ctx.is_cuda else None
