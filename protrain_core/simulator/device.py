"""A simulated device: the runtime's CUDA code path on CPU or meta tensors, timed by a model.

[Note: the simulated device]
``SimulatedDevice`` is a ``DeviceContext`` (runtime/device.py, the seam): an engine built on
it takes the asynchronous path a GPU takes -- streams, events, ``wait_event``, stream-ordered
frees, event queries, host waits, the CPU worker, collectives on the communication stream --
on small real CPU tensors (correctness runs: the numbers are real) or meta tensors (size-only
runs of 7B-70B shapes: no memory, no values). Nothing else of the runtime knows it is
simulated. A discrete-event clock (clock.py) keeps the time of every lane:
- the host thread that drives the device: it issues each operator (``launch_s``); a host wait
  (an event's ``synchronize``, a CPU job's ``result()``, a read of a device value, a stream's
  full launch queue of ``launch_queue`` operators) moves it to the time the awaited work ends,
  recorded by call site and training phase;
- the compute stream: every operator the host issues outside the side streams runs there
  once issued and after the events the stream waits for, for its roofline time (FLOPs from
  ``torch.utils.flop_counter`` over the matmul rate of its dtype, or its bytes over the memory
  bandwidth) times its operator class's factor (``op_class_factor``, fitted from a traced
  plain-PyTorch step), plus ``kernel_s``; the gap before it is *idle time*, charged to what
  held the stream: the event it waited for (an upload, an all-gather, a swap) or the host (a
  host wait, or its own issue time);
- the h2d and d2h copy streams and the swap stream: copies over their direction's bandwidth;
  each direction is one copy engine (PCIe is full duplex) serving each copy in the first free
  gap from when it is ready (``clock.Link``): two streams of one direction take turns, two of
  opposite directions overlap;
- the communication stream: all-gathers and reduce-scatters over the bus bandwidth, for the
  ranks of a ``SimulatedGroup`` (W identical ranks, one simulated; size-only);
- the CPU worker: each job runs inline (a simulation is deterministic) from when it is
  submitted and the worker is free, after the events it synchronizes on; a chunk's whole update
  (``DeviceContext.host_update``: the landing folded, Adam, the compute copy written) is charged
  once at ``cpu_adam_params_per_s`` of its moments' format (the rate the benchmark and the
  profiler's probe measure), every other operator its bytes at ``host_memory_bytes_per_s``; a
  job's future is done when the simulated clock has passed it.
Every figure is a field of a ``DeviceSpec`` (hardware.py). Every operator's reads and writes
are checked for stream order ([Note: the stream-order checker] in races.py), and device memory
is counted as the caching allocator counts it ([Note: simulated device memory] in memory.py).
Not modeled: the side streams' kernels contending with compute for the GPU's cores; host-side
blocking inside the runtime's own structures (a host thread that would wait for the worker to
give back a staging buffer, worker.py, does not). The runtime's ``Timeline`` records the same
spans as on CUDA, in simulated seconds; ``report.py`` sums a step.
The meta device cannot give values: ``.item()`` of a meta tensor reads True for a boolean (the
all-true branch of a model's own checks, e.g. Hugging Face's attention-mask shortcuts) and
raises otherwise; a device value read on the host (``to_host``, a copy to a CPU tensor) reads
zeros -- no fp16 overflow, a clipping coefficient of 0 -- after the host wait a GPU would make.
Attention runs the kernel CUDA picks (flash for bf16/fp16, memory-efficient for fp32), so its
FLOPs and saved bytes are the GPU's. The CPU device (``hardware.cpu_spec``) is simulated
synchronously: compute and host work take the time they take, copies and Adam the profile's.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from protrain_core.runtime.device import DeviceContext
from protrain_core.runtime.sharding import Sharding
from protrain_core.simulator.clock import Event, Lane, Link, MeasuredLane, Records, Stream, Wait, Work
from protrain_core.simulator.hardware import DeviceSpec, load_spec, op_class
from protrain_core.simulator.memory import ALLOCATOR_WAIT, DeviceMemory
from protrain_core.simulator.races import RaceChecker, byte_span
from protrain_core.utils import iter_tensors

# Operators that launch no kernel: allocation, metadata, aliasing.
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "_reshape_alias",
         "resize_", "set_", "lift_fresh", "lift_fresh_copy", "detach", "alias", "sym_size", "sym_stride", "sym_numel",
         "is_same_size", "_has_compatible_shallow_copy_type", "record_stream"}
LAUNCH_QUEUE_FULL = "launch queue full"  # a host wait for the device's work, not a synchronisation
_DIRECTIONS = ("host->device", "device->host")  # a copy's span lane: its direction
_HERE = (str(Path(__file__).resolve().parent),)


class SimulatedDevice(DeviceContext):
    """A ``DeviceContext`` whose streams and threads are simulated (see the Note). Enter it
    (``with sim:``) around everything that runs on it: building the engine, training steps.

    ``tensors``: "meta" (size-only) or "cpu" (small real tensors: the numbers are real);
    ``out_of_memory``: an allocation beyond the device's memory raises (False: memory is only
    counted, for studies of schedules that would not fit)."""

    def __init__(self, spec: DeviceSpec | str = "h100", *, tensors: str = "meta", out_of_memory: bool = True) -> None:
        if tensors not in ("meta", "cpu"):
            raise ValueError(f"SimulatedDevice(tensors={tensors!r}): use 'meta' (size-only) or 'cpu' (real values).")
        self.spec = load_spec(spec)
        self.asynchronous = self.spec.asynchronous
        if not self.asynchronous and tensors == "meta":
            raise ValueError("The CPU device is simulated with real tensors (tensors='cpu'): its compute is measured.")
        self.device = self.host = torch.device(tensors)
        self.is_cuda = self.deferred_collectives = False  # (simulated collectives take their time on their stream)
        self.timeline = None
        self.records = Records()
        self.phase_of = lambda: ""  # the training phase now, which host waits are recorded with (run.py sets it)
        self.main = Lane("host") if self.asynchronous else MeasuredLane("host")
        self.worker_lane = Lane("protrain-cpu-adam_0") if self.asynchronous else self.main
        self.compute = Stream("compute")
        self.h2d_stream, self.d2h_stream = Stream("h2d"), Stream("d2h")
        self.swap_stream, self.comm_stream = Stream("swap"), Stream("comm")
        self.links = {"host->device": Link("pcie h2d"), "device->host": Link("pcie d2h"), "collectives": Link("fabric")}
        self._local = threading.local()
        self._main_waits: list[Wait] = []  # the main lane's host waits not yet behind the compute stream
        self._directions: dict[str, str] = {}  # stream -> direction of its last copy
        self._modes: list[contextlib.ExitStack] = []  # one per ``with sim:`` (nested entries add nothing)
        self.charging_depth = 0  # _Charging modes active (one charges; a second would charge twice)
        # Every access of device memory ordered by events ([Note: the stream-order checker]).
        self.races = RaceChecker() if self.asynchronous else None
        # Device memory as the caching allocator counts it ([Note: simulated device memory]).
        self.memory = DeviceMemory(self.spec.device_memory_bytes if out_of_memory else None, lambda: self.host_lane().t,
                                   lambda until: self.block(self.host_lane(), until, ALLOCATOR_WAIT),
                                   self.spec.name) if self.asynchronous else None

    # ----- entering --------------------------------------------------------------------------
    def __enter__(self) -> SimulatedDevice:
        modes = contextlib.ExitStack()
        if not self._modes:
            modes.enter_context(self.charging())
            if self.device.type == "meta":
                modes.enter_context(_GpuAttention())
        self._modes.append(modes)
        return self

    def __exit__(self, *exc) -> None:
        self._modes.pop().__exit__(*exc)

    # ----- where work goes -------------------------------------------------------------------------
    def _where(self):
        """(kind, lane) of the calling code: ("compute", None) by default, ("stream", (stream,
        direction)) inside ``_on_stream`` (the CPU device: the main lane), ("cpu", lane) inside a
        worker job."""
        return getattr(self._local, "where", ("compute", None))

    @contextmanager
    def _at(self, kind: str, lane):
        """Inside, the calling code is ``(kind, lane)``; its work is modeled, so a measured host
        lane (the CPU device) does not count the real time it takes."""
        previous, real = self._where(), time.perf_counter()
        self._local.where = (kind, lane)
        try:
            yield
        finally:
            self._local.where = previous
            if isinstance(self.main, MeasuredLane):
                self.main.exclude(time.perf_counter() - real)

    def charging(self):
        """Charge the operators run inside (once: a no-op where they are charged already). A GPU
        charges all its work (entering the device does); the CPU device only the work it models."""
        return contextlib.nullcontext() if self.charging_depth else _Charging(self)

    def cpu_work(self, lane: Lane):
        """Operators inside run on the host lane ``lane`` (a CPU worker's job), at the host's rates."""
        return self._at("cpu", lane)

    @contextmanager
    def host_update(self, numel: int, state_format: str, folded_bytes: int = 0):
        spec = self.spec
        seconds = max(0.0, numel / spec.cpu_update_rate(state_format) - numel * folded_bytes / spec.host_memory_bytes_per_s)
        lane = self.host_lane()
        quiet, self._local.quiet = getattr(self._local, "quiet", False), True
        real = time.perf_counter()
        try:
            yield
        finally:
            self._local.quiet = quiet
        if isinstance(lane, MeasuredLane) and self._where()[0] != "cpu":  # (a worker's job excludes its own)
            lane.exclude(time.perf_counter() - real)
        start = lane.t
        lane.t += spec.cpu_op_s + seconds
        self.records.work.append(Work(lane.name, start, lane.t, f"update ({state_format} moments)", "update"))

    def host_lane(self) -> Lane:
        kind, lane = self._where()
        return lane if kind == "cpu" else self.main

    def _run(self, stream: Stream, seconds: float, label: str, kind: str, link: Link | None = None,
             nbytes: int = 0) -> None:
        """Issue ``seconds`` of work on ``stream`` from the main lane (see the Note): it starts
        once the host has issued it, the stream's earlier work and waits are done, and (a
        transfer) its link has room."""
        main = self.main
        main.t += self.spec.launch_s
        queue = stream.pending
        while queue and queue[0] <= main.t:
            queue.popleft()
        if len(queue) >= self.spec.launch_queue:
            self.block(main, queue.popleft(), LAUNCH_QUEUE_FULL)
        waited = stream.t
        ready = max(waited, main.t)
        start = ready if link is None else link.book(ready, seconds, floor=main.t)
        if stream is self.compute and start > stream.last_end:
            self._idle(stream.last_end, waited, ready, start, stream.held_by)
        end = start + seconds
        stream.t = stream.last_end = end
        queue.append(end)
        self.records.work.append(Work(stream.name, start, end, label, kind, nbytes))

    def _idle(self, last_end: float, waited: float, ready: float, start: float, held_by: str) -> None:
        """The compute stream idled from ``last_end`` to ``start``: until ``waited`` for the event
        it waited for; then until ``ready`` for the host (its waits where they overlap, else its
        own issue); then for the link (a collective on the compute stream)."""
        def idle(a: float, b: float, cause: str) -> None:
            if b > a:
                self.records.work.append(Work("compute", a, b, cause, "idle"))

        idle(last_end, waited, held_by or "waits")
        cursor = max(last_end, waited)
        self._main_waits = [w for w in self._main_waits if w.end > cursor]
        for w in self._main_waits:
            a, b = max(cursor, w.start), min(ready, w.end)
            if b > a:
                idle(cursor, a, "host issue")
                idle(a, b, f"host wait: {w.label} ({w.site})")
                cursor = b
        idle(cursor, ready, "host issue")
        idle(ready, start, "link busy")

    # ----- charging operators (the dispatch mode calls this) ----------------------------------
    def charge(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        if self.races is not None:
            self._order(func, name, args, kwargs, out)
        if self.memory is not None:
            self.memory.operator(args, kwargs, out, on_host=self._where()[0] == "cpu")
        if name in _FREE or getattr(self._local, "quiet", False):
            return
        kind, lane = self._where()
        if kind == "cpu":
            start = lane.t
            lane.t += self.spec.cpu_op_s + _touched(args, out)[1] / self.spec.host_memory_bytes_per_s
            self.records.work.append(Work(lane.name, start, lane.t, name, "cpu"))
            return
        stream, direction = lane if kind == "stream" else (self.compute, None)
        if name == "copy_" and direction in _DIRECTIONS:
            self._copy(stream, direction, args[1].nbytes)
        elif self.asynchronous:  # (the CPU device's compute takes the time it takes: the main lane's clock)
            self._run(stream, self._device_seconds(func, name, args, kwargs, out), name, "compute")

    def _order(self, func, name: str, args, kwargs, out) -> None:
        """The stream-order checker's view of an operator: who runs it, what it reads and writes."""
        if name in _FREE:
            if name.startswith(("empty", "new_empty")):
                self.races.fresh(out)
            return
        kind, lane = self._where()
        agent = lane[0].name if kind == "stream" else self.agent(self.host_lane())
        if kind == "stream":  # enqueued after the host's work so far
            self.races.follow(agent, self.compute.name)
        self.races.operator(agent, func, args, kwargs, out)

    def agent(self, lane: Lane) -> str:
        """The stream-order checker's agent of a host lane: the host thread that drives the device
        is one with the compute stream (host and device tensors are alike in a simulation: the
        order of the host's work is the compute stream's); a worker is its own."""
        return self.compute.name if lane is self.main else lane.name

    def _device_seconds(self, func, name: str, args, kwargs, out) -> float:
        """An operator's time on the device: its roofline time times its class's factor, plus ``kernel_s``."""
        spec = self.spec
        tensors, nbytes = _touched(args, kwargs, out)
        seconds = nbytes / spec.memory_bytes_per_s
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            flops = _flops(formula, func, args, kwargs, out)
            low = any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)
            seconds = max(seconds, flops / (spec.tensor_flops_per_s if low else spec.fp32_flops_per_s))
        return spec.kernel_s + seconds * spec.op_class_factor.get(op_class(name), 1.0)

    def _copy(self, stream: Lane, direction: str, nbytes: int) -> None:
        bandwidth = self.spec.h2d_bytes_per_s if direction == "host->device" else self.spec.d2h_bytes_per_s
        seconds = self.spec.copy_latency_s + nbytes / bandwidth
        if stream is self.main:  # the CPU device: the host thread copies
            start = stream.t
            stream.t += seconds
            self.records.work.append(Work(stream.name, start, stream.t, direction, "copy", nbytes))
            return
        self._run(stream, seconds, direction, "copy", self.links[direction], nbytes)

    def charge_collective(self, what: str, nbytes: int, factor: float) -> None:
        """A collective moving ``factor * nbytes`` over the bus, on the calling lane's stream (the
        communication stream inside ``collective``; else the compute stream, as NCCL orders a
        collective called outside a stream context after the current one)."""
        kind, lane = self._where()
        stream = lane[0] if kind == "stream" else self.compute
        spec = self.spec
        self._run(stream, spec.collective_latency_s + factor * nbytes / spec.collective_bytes_per_s, what, "collective",
                  self.links["collectives"], nbytes)

    def host_collective(self, what: str) -> None:
        """A blocking host-side agreement between the ranks (gloo): the calling host lane waits."""
        lane = self.host_lane()
        self.block(lane, lane.t + self.spec.host_collective_s, f"host collective: {what}")

    # ----- the DeviceContext interface ------------------------------------------------------------
    def _on_stream(self, stream, fn, after, span):
        lane_name, label = span
        if not self.asynchronous:  # the CPU device: the copy runs on the host thread, for its modeled time
            begin = self.main.t
            with self._at("stream", (self.main, lane_name)), self.charging():
                fn()
            if self.timeline is not None:
                self.timeline.add(lane_name, label, begin, self.main.t)
            return None
        self._check_duplex(stream, lane_name, after)
        self.races.follow(stream.name, self.compute.name)
        if self.compute.t > stream.t:
            stream.t, stream.held_by = self.compute.t, "compute stream"
        if after is not None:
            self._wait_event(stream, after)
        first = len(self.records.work)
        with self._at("stream", (stream, lane_name)):
            fn()
        begin = next((w.start for w in self.records.work[first:] if w.lane == stream.name), max(stream.t, self.main.t))
        if self.timeline is not None:
            self.timeline.add(lane_name, label, begin, stream.t)
        return Event(max(stream.t, self.main.t), label or lane_name, stream.name, self.races.snapshot(stream.name))

    def _check_duplex(self, stream: Stream, direction: str, after) -> None:
        """A copy queued on a stream behind a copy of the other direction waits for it although
        the link could carry both at once: recorded as a "stall" of the time it lost."""
        previous = self._directions.get(stream.name)
        if direction not in _DIRECTIONS:
            return
        self._directions[stream.name] = direction
        if previous in (None, direction):
            return
        ready = max(self.compute.t, self.main.t + self.spec.launch_s, after.time if after is not None else 0.0)
        free = self.links[direction].first_gap(ready, 0.0)
        if stream.last_end > free:
            self.records.work.append(Work(stream.name, free, stream.last_end,
                                          f"{direction} copy queued behind a {previous} copy", "stall"))

    def _wait_event(self, stream: Stream, event: Event) -> None:
        self._after(stream.name, event)
        if event.time > stream.t:
            stream.t, stream.held_by = event.time, event.label

    def wait_on_compute(self, event) -> None:
        if event is not None:
            self._wait_event(self.compute, event)

    def synchronize(self, event) -> None:
        if event is not None:
            lane = self.host_lane()
            self._after(self.agent(lane), event)
            self.block(lane, event.time, event.label)

    def _after(self, agent: str, event: Event) -> None:
        if self.races is not None and event.order is not None:
            self.races.merge(agent, event.order)

    def block(self, lane: Lane, until: float, label: str) -> None:
        """The host lane ``lane`` waits until ``until`` for ``label`` (recorded with the call site)."""
        if until <= lane.t:
            return
        wait = Wait(lane.name, lane.t, until, _call_site(), label, self.phase_of())
        self.records.waits.append(wait)
        if lane is self.main:
            self._main_waits.append(wait)
        lane.t = until

    def done(self, event) -> bool:
        return event is None or event.time <= self.host_lane().t

    def synchronize_stream(self, stream) -> None:
        if stream is not None:
            if self.races is not None:
                self.races.follow(self.agent(self.host_lane()), stream.name)
            self.block(self.host_lane(), stream.t, f"{stream.name} stream")

    def synchronize_device(self) -> None:
        streams = (self.compute, self.h2d_stream, self.d2h_stream, self.swap_stream, self.comm_stream)
        if self.races is not None:
            for s in streams:
                self.races.follow(self.agent(self.host_lane()), s.name)
        self.block(self.host_lane(), max(s.t for s in streams), "device synchronize")

    def record_stream(self, t: Tensor, stream) -> None:
        if self.memory is not None:
            self.memory.record_stream(t, stream)

    def resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        if self.memory is not None:
            self.memory.resize(storage, nbytes)
        storage.resize_(nbytes)

    def to_host(self, t: Tensor) -> Tensor:
        self.read_on_host("a device value read on the host")
        return torch.zeros(t.shape, dtype=t.dtype) if self.device.type == "meta" else t.to("cpu")

    def read_on_host(self, label: str) -> None:
        """The calling host lane reads a value the compute stream produces: it waits for it."""
        if self.asynchronous and self._where()[0] == "compute":
            self._run(self.compute, self.spec.copy_latency_s, "read on host", "copy")
            self.block(self.host_lane(), self.compute.t, label)

    def worker(self, threaded: bool, placement=None) -> Executor:
        # (``placement``: none on a simulated device; the worker's rate is the spec's)
        return SimulatedWorker(self, self.worker_lane if threaded else self.main)

    def clock(self) -> float:
        return self.host_lane().t

    def thread_name(self) -> str:
        return self.host_lane().name

    def stamp(self, stream=None):
        stream = stream or self.compute
        return max(stream.t, self.main.t) if self.asynchronous else self.main.t

    def checkpoint_contexts(self):
        # Autograd runs a recomputation without the forward's function modes: enter it again.
        return contextlib.nullcontext(), (_GpuAttention() if self.device.type == "meta" else contextlib.nullcontext())

    def check_host_memory(self, nbytes: int, what: str) -> None:
        if self.device.type != "meta":
            super().check_host_memory(nbytes, what)

    @property
    def autocast_device_type(self) -> str | None:
        return None if self.device.type == "meta" else self.device.type

    def available_host_bytes(self) -> int | None:
        return self.spec.host_memory_bytes

    def free_memory(self) -> tuple[int, int]:
        return self.spec.device_memory_bytes, self.spec.device_memory_bytes

    def name(self) -> str:
        return self.spec.name


def _touched(*objs) -> tuple[list[Tensor], int]:
    """The tensors an operator reads and writes (its arguments and outputs), and their bytes
    (each tensor once)."""
    tensors = list({id(t): t for t in iter_tensors(objs)}.values())
    return tensors, sum(t.nbytes for t in tensors)


def _flops(formula, func, args, kwargs, out) -> int:
    """``formula``'s count for the call, from an earlier call of ``func`` on the same metadata
    (``_described``) where there was one (torch's formulas read shapes only, and wrap every call
    in a tree map)."""
    try:
        key = (func, _described(args), _described(tuple(kwargs.items())))
        flops = _FLOPS.get(key)
    except (KeyError, TypeError):  # (a value that is not plain, or not hashable)
        return formula(*args, **kwargs, out_val=out)
    if flops is None:
        flops = _FLOPS[key] = formula(*args, **kwargs, out_val=out)
    return flops


_FLOPS: dict = {}  # (operator, arguments described) -> its FLOPs


def _call_site() -> str:
    """The innermost frames of the runtime that led here: "scheduler.py:_make_room <
    chunk.py:end_offload" (the simulator's own frames and the caller's code left out)."""
    frames = []
    frame = inspect.currentframe()
    while frame is not None and len(frames) < 3:
        name = _SITES.get(frame.f_code, False)
        if name is False:
            code, path = frame.f_code, frame.f_code.co_filename
            runtime = "protrain_core" in path and not path.startswith(_HERE)
            name = _SITES[code] = f"{Path(path).name}:{getattr(code, 'co_qualname', code.co_name)}" if runtime else None
        if name is not None:
            frames.append(name)
        frame = frame.f_back
    return " < ".join(frames) or "user code"


_SITES: dict = {}  # code object -> "file.py:qualname" of a runtime frame, or None (not the runtime's)


class SimulatedWorker(Executor):
    """The CPU worker on a lane of the simulated clock: each job runs inline, when submitted and
    the lane is free (see the Note)."""

    def __init__(self, sim: SimulatedDevice, lane: Lane) -> None:
        self.sim, self.lane = sim, lane

    def submit(self, fn, /, *args, **kwargs) -> Future:
        sim, lane = self.sim, self.lane
        start = lane.t = max(lane.t, sim.host_lane().t)
        if sim.races is not None and lane is not sim.host_lane():  # a job comes after its submission
            sim.races.follow(sim.agent(lane), sim.agent(sim.host_lane()))
        future = SimulatedFuture(sim)
        try:
            with sim.cpu_work(lane), sim.charging():
                value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised by result(), as from a thread (an interrupt goes up now)
            future.set_exception(e)
        else:
            future.set_result(value)
        future.event = Event(lane.t, "CPU worker job", lane.name,
                             sim.races.snapshot(sim.agent(lane)) if sim.races is not None else None)
        sim.records.work.append(Work(lane.name, start, lane.t, getattr(fn, "__name__", "job"), "cpu"))
        return future


class SimulatedFuture(Future):
    """Done when the calling lane's clock has passed ``event`` (the job's end, with the worker's
    vector clock then); ``result()`` waits for it (a host wait, recorded)."""

    def __init__(self, sim: SimulatedDevice) -> None:
        super().__init__()
        self.sim, self.event = sim, None

    @property
    def end(self) -> float:
        return self.event.time

    def done(self) -> bool:
        return super().done() and self.sim.done(self.event)

    def result(self, timeout=None):
        self.sim.synchronize(self.event)
        return super().result(timeout)


class _Charging(TorchDispatchMode):
    """Charges every operator to the lane that runs it (``SimulatedDevice.charge``), and
    answers the meta device's value reads (see the Note)."""

    def __init__(self, sim: SimulatedDevice) -> None:
        super().__init__()
        self.sim = sim

    def __enter__(self):
        self.sim.charging_depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.sim.charging_depth -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if func is torch.ops.aten._local_scalar_dense.default:
            (t,) = args
            if t.device.type != "meta" and sim.device.type == "meta":
                return func(t)  # a host tensor beside a meta device: no device read
            sim.read_on_host(".item() of a device tensor")
            if t.device.type != "meta":
                return func(t)
            if t.dtype is torch.bool:
                return True
            raise RuntimeError(
                "A size-only simulation (meta tensors) cannot read a tensor's value, but the model or the "
                f"training code calls .item() on a {t.dtype} tensor of shape {tuple(t.shape)}. Simulate with "
                "tensors='cpu' (a small model), or keep data-dependent reads out of the step."
            )
        if _reads_meta_on_cpu(func, args, kwargs):
            sim.read_on_host("a device tensor copied to the CPU")
            return func(*[a if not (isinstance(a, Tensor) and a.device.type == "meta") else
                          torch.zeros(a.shape, dtype=a.dtype) for a in args], **kwargs)
        if func.is_view:  # (most operators of a step: a view allocates, reads, writes and takes nothing)
            return func(*args, **kwargs)
        out = run_on_meta(func, args, kwargs) if sim.device.type == "meta" else func(*args, **kwargs)
        if sim.device.type != "meta" or any(t.device.type == "meta" for t in iter_tensors((args, kwargs, out))):
            sim.charge(func, args, kwargs, out)  # (beside a meta device, real CPU tensors are host work)
        return out


# [Note: meta outputs by shape]
# Most of a size-only simulation's host time is torch's meta kernels: Python shape rules
# (broadcasting, type promotion, strides) run for every operator, alike for each of a model's
# identical blocks. A meta kernel's outputs are fresh tensors whose shape, strides and dtype follow
# from the operator and its arguments' metadata alone, so the first call of each operator on each
# combination runs and is described, and later ones get new empty tensors of that description (a
# simulated 7B step: 28k operators, a few hundred kernels run) -- only where that is exactly the
# kernel's result: the operator mutates nothing; no other dispatch mode or tensor subclass sees it;
# every tensor argument is a plain strided meta tensor, every other argument a plain value (the
# default dtype is part of the key: factories and Python scalars follow it); its outputs are
# strided meta tensors of storages of their own, exactly their size. The simulated step is the
# same to the bit (tests/test_simulator.py compares every span with the memo and without).
_VALUES = (int, float, bool, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_META_OUTPUTS: dict = {}  # (operator, default dtype, arguments described) -> outputs described, or None: run it


def run_on_meta(func, args, kwargs):
    """``func(*args, **kwargs)``, from what an earlier call with the same metadata returned where
    that is the kernel's result ([Note: meta outputs by shape])."""
    if func._schema.is_mutable or torch._C._len_torch_dispatch_stack():
        return func(*args, **kwargs)
    try:
        key = (func, torch.get_default_dtype(), _described(args), _described(tuple(kwargs.items())))
        spec = _META_OUTPUTS.get(key, False)
    except (KeyError, TypeError):  # (a value that is not plain, or not hashable)
        return func(*args, **kwargs)
    if spec:
        kind, described = spec
        made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in described]
        return made[0] if kind is None else kind(made)
    out = func(*args, **kwargs)
    if spec is False:
        _META_OUTPUTS[key] = _fresh(out, args, kwargs)
    return out


def _plain(t: Tensor) -> bool:
    return t.device.type == "meta" and t.layout == torch.strided and not (t.is_conj() or t.is_neg())


def _described(a):
    if isinstance(a, Tensor):
        if type(a) not in (Tensor, torch.nn.Parameter) or not _plain(a):
            raise KeyError
        return a.shape, a.stride(), a.dtype, a.storage_offset()
    if isinstance(a, (list, tuple)):
        return tuple(_described(x) for x in a)
    if a is None or type(a) in _VALUES and a == a:  # (a NaN equals no key)
        return type(a), a
    raise KeyError


def _fresh(out, args, kwargs):
    """``out`` described if it is fresh strided meta tensors, else None: (None for one tensor, else
    the type of the tuple or list of them; each one's shape, strides and dtype)."""
    inputs = {StorageWeakRef(t.untyped_storage()) for t in iter_tensors((args, kwargs))}
    outputs = [out] if isinstance(out, Tensor) else out if isinstance(out, (tuple, list)) else [None]
    for t in outputs:
        if type(t) is not Tensor or not _plain(t) or t.storage_offset() or \
                StorageWeakRef(t.untyped_storage()) in inputs or t.untyped_storage().nbytes() != byte_span(t)[1]:
            return None
    kind = None if isinstance(out, Tensor) else type(out)
    return kind, tuple((tuple(t.shape), t.stride(), t.dtype) for t in outputs)


def _reads_meta_on_cpu(func, args, kwargs) -> bool:
    """A copy of a meta tensor into a CPU tensor (``_to_copy`` to the CPU, ``copy_`` into one)."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        target = kwargs.get("device")
        return isinstance(args[0], Tensor) and args[0].device.type == "meta" and target is not None and \
            torch.device(target).type == "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type == "meta"
    return False


class _GpuAttention(TorchFunctionMode):
    """On meta tensors, ``scaled_dot_product_attention`` runs the kernel CUDA would pick
    (flash attention for bf16/fp16, memory-efficient attention for fp32): its FLOPs and saved
    tensors are a GPU's, not those of the math path meta tensors would take."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            out = _gpu_sdpa(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if query.device.type != "meta":
        return None
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: the kernels take equal heads
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    bias = None if attn_mask is None else attn_mask.to(query.dtype) if attn_mask.dtype is not torch.bool else \
        torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                                        scale=scale)[0]


class SimulatedGroup(Sharding):
    """``world`` identical ranks, one of them simulated (rank 0): collectives are charged on the
    simulated clock and do not communicate. Size-only: the other ranks' pieces of a gathered
    chunk hold nothing meaningful, so a sharded simulation runs on meta tensors."""

    def __init__(self, sim: SimulatedDevice, world: int) -> None:
        if world < 2:
            raise ValueError("SimulatedGroup(world): simulate 2 or more ranks (one rank is not sharded).")
        if sim.device.type != "meta":
            raise ValueError("A sharded simulation is size-only: build its SimulatedDevice with tensors='meta'.")
        super().__init__(group=None, rank=0, world=world)
        self.sim = sim

    @property
    def backend(self) -> str:
        return "simulated"

    def check_device(self, device: torch.device) -> None:
        pass

    def gather_(self, full: Tensor) -> None:
        self.check_held()
        self.sim.charge_collective("all-gather", full.nbytes, (self.world - 1) / self.world)

    @property
    def pre_scale(self) -> None:
        return None  # NCCL's average, inside the collective

    def reduce_scatter_mean(self, out: Tensor, full: Tensor, *, scaled: bool = False) -> None:
        self.check_held()
        if out.numel():
            self.sim.charge_collective("reduce-scatter", full.nbytes, (self.world - 1) / self.world)

    def all_reduce_(self, t: Tensor, op=None) -> Tensor:
        if t.device.type == "cpu":
            self.sim.host_collective("all-reduce")
        else:
            self.sim.charge_collective("all-reduce", t.nbytes, 2 * (self.world - 1) / self.world)
        return t

    def max_on_host(self, values: list[float]) -> list[float]:
        self.sim.host_collective("max over ranks")
        return list(values)

    def differences(self, used: list[bool], order: int):
        ready = self.sim.host_lane().t + self.sim.spec.host_collective_s  # issued now: its reader waits for the rest

        def result() -> tuple[list[int], bool]:
            self.sim.block(self.sim.host_lane(), ready, "host collective: parameters used")
            return [], False

        return result

    def gather_objects(self, obj) -> list:
        self.sim.host_collective("configurations")
        return [obj] * self.world

    def broadcast_(self, t: Tensor, src: int = 0) -> None:
        pass

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def barrier(self) -> None:
        self.sim.host_collective("barrier")
