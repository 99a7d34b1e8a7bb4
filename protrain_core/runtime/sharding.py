"""Data parallelism over chunks: the process group a chunk's states are sharded over, and the
collectives that assemble and reduce chunks (ZeRO-3 over chunks; DESIGN.md §8).

[Note: sharded chunks]
With ``W`` processes every chunk is split in two spans, each sharded in ``W`` equal pieces
(padded): the frozen span (``F`` elements, shard ``s_f``) and the trainable span (``T``, shard
``s_t``). Rank ``r`` owns piece ``r`` of both: of the compute copy, and of the master, the
gradient accumulator and the Adam states. The gathered compute copy on the device is laid out
``[frozen: s_f * W | trainable: s_t * W]``; in one process (rank 0 of ``W = 1``) it is the
chunk's two spans where the layout puts them. ``ShardLayout`` in storage.py answers where a
member is in every tensor of a chunk on this rank.

  fetch     upload the rank's compute shard into its place in the device copy, then all-gather
            it in place (one collective per non-empty span: ``Sharding.gather_``)
  backward  gradients land in a device buffer of the whole (padded) trainable span, then are
            reduce-scattered to their mean as DDP takes it (each rank's gradient times ``1/W``,
            summed: ``Sharding.reduce_scatter_mean``); the rank's piece goes to the accumulator
  update    Adam on the rank's pieces (elementwise: a piece updates as the whole would); a
            persistent chunk then gathers its trainable span, a streamed one at its next fetch
  norms     each rank's pieces' norms are combined into the global norm with one all-reduce;
            fp16's found-inf is all-reduced (max)

A persistent chunk keeps its whole compute copy on the device (sharding its frozen span would
save no memory and cost a gather); a streamed chunk's frozen span is sharded like the rest.

Every rank must issue the same collectives in the same order: the runtime's decisions depend
only on the chunks' state machines, never on timing, and the planner's are rank 0's (``agree``).
Which parameters get gradients is the user's graph, so at each backward one host all-reduce
(``UsageCheck.begin``) compares which parameters the ranks' losses reach and a hash of the order
of the previous backward's reductions, and the ranks stop together with the fix where they
differ. It is read before the backward's first chunk collective (``Sharding.hold_collectives``).
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from protrain_core.runtime.device import deferring, wait_work

# torch >= 2.12 renamed the tensor collectives; the older names still work (with a warning).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The tag of gloo's reductions' messages (``Sharding._exchange_and_sum``), apart from a user's own.
_EXCHANGE_TAG = 0x5054


@dataclass
class Sharding:
    """The process group a wrapped model is sharded over; one process is ``ONE_PROCESS`` (``whole``)."""

    group: object = None  # a torch.distributed ProcessGroup (None: the group of one)
    rank: int = 0
    world: int = 1
    checks: object = None  # a gloo group over the same ranks for host-side agreement (None: ``group``)
    _verdict: Callable[[], str | None] | None = field(default=None, init=False, repr=False, compare=False)
    _device_type: str = field(default="cpu", init=False, repr=False, compare=False)  # of the chunks' tensors

    @staticmethod
    def resolve(process_group=None) -> Sharding:
        """The sharding of an engine built now: ``process_group`` (default: the default group when
        torch.distributed is initialized), or ``ONE_PROCESS``. A ``Sharding`` is used as it is."""
        if isinstance(process_group, Sharding):
            return process_group
        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return ONE_PROCESS
            process_group = dist.group.WORLD
        world = dist.get_world_size(process_group)
        if world == 1:
            return ONE_PROCESS
        checks = None
        if backend_of("cpu", process_group) != "gloo":  # NCCL alone: host-side checks need their own group
            ranks = [dist.get_global_rank(process_group, r) for r in range(world)]
            checks = dist.new_group(ranks=ranks, backend="gloo")
        return Sharding(process_group, dist.get_rank(process_group), world, checks)

    @property
    def whole(self) -> bool:
        """One process, the group of one: it holds every chunk whole, and every collective
        returns at once. The few things that differ with ``W`` processes ask this."""
        return self.world == 1

    @functools.cached_property
    def backend(self) -> str | None:
        """The backend of the chunk collectives on the engine's device (``check_device``)."""
        return None if self.whole else backend_of(self._device_type, self.group)

    def check_device(self, device: torch.device) -> None:
        """Refuse a ``device`` the group's backends cannot reach, before anything is allocated;
        the chunk collectives then run on that device type's backend."""
        if self.whole:
            return
        backend = backend_of(device.type, self.group)
        config = str(dist.get_backend_config(self.group))
        if device.type == "cpu" and backend != "gloo":
            raise ValueError(
                f"The process group's backends are {config!r}: none runs collectives on CPU tensors with ProTrain; "
                "train on CPU with the 'gloo' backend (Lightning picks it for accelerator='cpu')."
            )
        if device.type == "cuda" and backend not in ("nccl", "gloo"):
            raise ValueError(f"The process group's backends are {config!r}: none runs collectives on CUDA tensors; "
                             "use 'nccl'.")
        self.__dict__.pop("backend", None)
        self._device_type = device.type

    # ----- collectives ---------------------------------------------------------------------------
    def gather_(self, full: Tensor) -> None:
        """All-gather in place: piece ``rank`` of ``full`` (W equal pieces) is this rank's; on gloo a
        broadcast per piece, faster than its own (benchmarks/HISTORY.md, "gloo's gather by broadcasts")."""
        self.check_held()
        n = full.numel() // self.world
        if not n or self.whole:
            return
        if self.backend == "gloo":
            for r in range(self.world):
                _issue(dist.broadcast, full[r * n:(r + 1) * n], src=dist.get_global_rank(self.group, r), group=self.group)
            return
        _issue(_all_gather, full, full[self.rank * n:(self.rank + 1) * n], group=self.group)

    @property
    def pre_scale(self) -> float | None:
        """What each rank's gradients are multiplied by as they are copied into a buffer, before
        ``reduce_scatter_mean`` sums them: ``1/W`` on gloo (no average); None with NCCL."""
        return None if self.backend == "nccl" or self.whole else 1.0 / self.world

    def reduce_scatter_mean(self, out: Tensor, full: Tensor, *, scaled: bool = False) -> None:
        """``out`` = piece ``rank`` of the mean of ``full`` over the ranks, as DDP averages (NCCL's
        AVG). gloo has no average, so ``full`` is scaled in place first (unless ``scaled``: by
        ``pre_scale`` already) and reduced by messages (faster than its own collective)."""
        self.check_held()
        if not out.numel():
            return
        if self.whole:
            if out.data_ptr() != full.data_ptr():
                out.copy_(full)
            return
        if self.backend == "nccl":
            _issue(_reduce_scatter, out, full, op=dist.ReduceOp.AVG, group=self.group)
            return
        if not scaled:
            full.mul_(self.pre_scale)
        if self.backend == "gloo" and full.device.type == "cpu":
            self._exchange_and_sum(out, full)
            return
        if self.backend == "gloo":  # gloo on a GPU tensor: the whole sum, of which this rank keeps its piece
            mine = full[self.rank * out.numel():(self.rank + 1) * out.numel()]
            _issue(dist.all_reduce, full, op=dist.ReduceOp.SUM, group=self.group, then=lambda: out.copy_(mine))
            return
        _issue(_reduce_scatter, out, full, op=dist.ReduceOp.SUM, group=self.group)

    def _exchange_and_sum(self, out: Tensor, full: Tensor) -> None:
        """gloo's reduce-scatter of CPU tensors by messages: each rank sends piece ``r`` of ``full``
        to rank ``r`` and sums every rank's piece ``rank`` in rank order into ``out`` (with two
        ranks, the all-reduce's sum bit for bit)."""
        n, rank = out.numel(), self.rank
        others = [r for r in range(self.world) if r != rank]
        received = {r: out if k == 0 else torch.empty_like(out) for k, r in enumerate(others)}
        works = [dist.isend(full[r * n:(r + 1) * n], dst=dist.get_global_rank(self.group, r), group=self.group,
                            tag=_EXCHANGE_TAG) for r in others]
        works += [dist.irecv(received[r], src=dist.get_global_rank(self.group, r), group=self.group,
                             tag=_EXCHANGE_TAG) for r in others]

        def total() -> None:
            pieces = {**received, rank: full[rank * n:(rank + 1) * n]}
            out.add_(pieces[1 if others[0] == 0 else 0])  # out holds piece 0 or 1: their sum, either order
            for r in range(2, self.world):
                out.add_(pieces[r])

        _issue_all(works, then=total)

    def all_reduce_(self, t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        if not self.whole:
            _blocking(dist.all_reduce, t, op=op, group=self.group)
        return t

    def max_on_host(self, values: list[float]) -> list[float]:
        """The largest of each value over the ranks (host numbers: the slowest rank's timings)."""
        if self.whole:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        _blocking(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.checks or self.group)
        return t.tolist()

    def differences(self, used: list[bool], order: int) -> Callable[[], tuple[list[int], bool]]:
        """One host all-reduce, issued without waiting: the returned function waits for it and
        gives the positions of ``used`` (the parameters this rank's loss reaches) where the ranks
        differ, and whether ``order`` (a hash of the previous backward's reductions) differs."""
        t = torch.tensor([order, -order, *used, *(-int(u) for u in used)], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.checks or self.group, async_op=True)

        def result() -> tuple[list[int], bool]:
            wait_work(work)
            n = len(used)
            return (t[2:2 + n] != -t[2 + n:]).nonzero().flatten().tolist(), int(t[0]) != -int(t[1])

        return result

    def hold_collectives(self, verdict: Callable[[], str | None] | None) -> None:
        """The next chunk collective first calls ``verdict`` (once) and raises the message it
        gives, on every rank alike. None: forget a verdict not called (a failed backward)."""
        self._verdict = verdict

    def check_held(self) -> None:
        """Call the verdict ``hold_collectives`` left, if any, and raise its message."""
        verdict, self._verdict = self._verdict, None
        message = None if verdict is None else verdict()
        if message is not None:
            raise RuntimeError(message)

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, by rank (a host collective)."""
        if self.whole:
            return [obj]
        every = [None] * self.world
        dist.all_gather_object(every, obj, group=self.checks or self.group)
        return every

    def broadcast_(self, t: Tensor, src: int = 0) -> None:
        """Rank ``src``'s ``t`` on every rank, in place."""
        if not self.whole:
            _blocking(dist.broadcast, t, src=dist.get_global_rank(self.group, src), group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        return obj if self.whole else broadcast_object(obj, dist.get_global_rank(self.group, src), self.group)

    def barrier(self) -> None:
        if not self.whole:
            barrier(self.group)


ONE_PROCESS = Sharding()  # the group of one (``whole``): it holds no state, so every engine shares it


def backend_of(device_type: str, group=None) -> str | None:
    """The backend ("gloo", "nccl", ...; None: none) that runs ``group``'s collectives (None: the
    default group's) on tensors of ``device_type``, from its config ("cpu:gloo,cuda:nccl")."""
    config = str(dist.get_backend_config(group))
    backends = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return backends.get(device_type)


def barrier(group=None) -> None:
    """Every rank of ``group`` (None: the default group) here; on gloo waited for with
    ``wait_work``, so that ctrl-C still ends the process. A rank outside ``group`` returns at once."""
    if group is not None and dist.get_rank(group) < 0:
        return
    if backend_of("cpu", group) == "gloo":
        wait_work(dist.barrier(group=group, async_op=True))
        return
    dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group=None):
    """Global rank ``src``'s picklable ``obj`` on every rank of ``group`` (None: the default
    group), as ``dist.broadcast_object_list``; on gloo its pickle's size and bytes are waited for
    with ``wait_work`` (ctrl-C). A rank outside ``group`` gets ``obj`` back."""
    if group is not None and dist.get_rank(group) < 0:
        return obj
    if backend_of("cpu", group) != "gloo":
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    mine = dist.get_rank() == src
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
    size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
    wait_work(dist.broadcast(size, src=src, group=group, async_op=True))
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    wait_work(dist.broadcast(data, src=src, group=group, async_op=True))
    return obj if mine else pickle.loads(data.numpy().tobytes())


def _blocking(collective, t: Tensor, *args, **kwargs) -> None:
    """``collective`` on ``t`` (and ``args``) run to its end: on CPU tensors waited for with
    ``wait_work`` (ctrl-C); on a device, as torch issues it (ordered on the stream)."""
    if t.device.type != "cpu":
        collective(t, *args, **kwargs)
        return
    wait_work(collective(t, *args, async_op=True, **kwargs))


def _issue(collective, *args, then=None, **kwargs) -> None:
    """Run a tensor collective, then ``then``: at once, or, inside a CPU device's
    ``DeviceContext.collective``, joined to its event (``then`` runs when it is waited for)."""
    event = deferring()
    if event is None:
        _blocking(collective, *args, **kwargs)
        if then is not None:
            then()
        return
    event.add(collective(*args, async_op=True, **kwargs), then)


def _issue_all(works: list, then) -> None:
    """Point-to-point messages already posted (``works``), then ``then``, as ``_issue`` does for a
    collective; ``_Waiter`` waits for them (gloo's message ``Work`` cannot be polled)."""
    posted = _Posted(works)
    _Waiter.get().queue.put(posted)
    event = deferring()
    if event is None:
        wait_work(posted)
        then()
        return
    event.add(posted, then)


class _Posted(Future):
    """Messages a ``_Waiter`` waits for, as a ``Work`` that can be polled (``wait_work``)."""

    def __init__(self, works: list) -> None:
        super().__init__()
        self.works = works

    def is_completed(self) -> bool:
        return self.done()

    def wait(self) -> bool:
        self.result()  # (the waiter's error, raised here)
        return True


class _Waiter:
    """A daemon thread per process that waits, in order, for the messages of ``_issue_all``."""

    _instance: _Waiter | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.SimpleQueue[_Posted] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="protrain-messages", daemon=True).start()

    @classmethod
    def get(cls) -> _Waiter:
        if cls._instance is None or cls._instance.pid != os.getpid():  # none yet, or a forked parent's
            cls._instance = cls()
        return cls._instance

    def _run(self) -> None:
        while True:
            posted = self.queue.get()
            try:
                for work in posted.works:
                    work.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised by the thread that waits for it
                posted.set_exception(e)
            else:
                posted.set_result(True)
            posted.works = []


def broadcast_tensors(tensors, sharding: Sharding, device: torch.device) -> None:
    """Rank 0's values of ``tensors`` (a module's parameters or buffers) on every rank of
    ``sharding``, one at a time through ``device``, as DDP does when it wraps a model."""
    if sharding.whole:
        return
    with torch.no_grad():
        for t in tensors:
            moved = t.detach().to(device)
            sharding.broadcast_(moved)
            if moved is not t.data:
                t.data.copy_(moved)


def agree_budgets(sharding: Sharding, device_budget: int, host_budget: int | None) -> tuple[int, int | None]:
    """The budgets every rank of ``sharding`` plans with: the smallest ``device_budget`` of the
    ranks, and the smallest ``host_budget`` divided among the ranks of a node."""
    hosts = sharding.gather_objects(socket.gethostname())
    per_node = hosts.count(hosts[sharding.rank])
    # The smallest of each: the largest of the negated (exact in float64 below 2**53 bytes).
    low = sharding.max_on_host([-float(device_budget), -float(0 if host_budget is None else host_budget // per_node)])
    return int(-low[0]), None if host_budget is None else int(-low[1])


def check_same_configuration(sharding: Sharding, fields: dict[str, object]) -> None:
    """Every rank's ``fields`` (what ``wrap`` was given and derived) compared over ``sharding``;
    where they differ, every rank raises the same error, before anything is allocated."""
    every = sharding.gather_objects(fields)
    differ = [key for key in fields if any(other.get(key) != every[0].get(key) for other in every)]
    if not differ:
        return
    lines = []
    for key in differ:
        values = [other.get(key) for other in every]
        if all(isinstance(v, (list, tuple)) for v in values):  # say where the lists part
            at = next((k for k in range(max(map(len, values))) if len({repr(v[k]) if k < len(v) else None
                                                                          for v in values}) > 1), 0)
            values = [f"{len(v)} entries, entry {at}: {v[at] if at < len(v) else 'none'}" for v in values]
        lines.append(f"  {key}: " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    raise ValueError(
        f"The {sharding.world} processes wrap their models differently, so their chunks and collectives "
        "would not match:\n" + "\n".join(lines) + "\nEvery rank must call wrap (or build the strategy) with the "
        "same model, optimizer, precision, chunk size and plan arguments."
    )


def agree(sharding: Sharding, decision):
    """Rank 0's ``decision`` on every rank of ``sharding``: every choice that changes which
    collectives run is rank 0's ([Note: sharded chunks])."""
    return sharding.broadcast_object(decision)


class UsageCheck:
    """What each backward reduces, compared across the ranks first ([Note: sharded chunks])."""

    def __init__(self, sharding: Sharding, chunks: list) -> None:
        self.sharding, self.chunks = sharding, chunks
        self._order = 0  # a hash of the chunks this backward reduced, in order

    def reduced(self, c) -> None:
        """Chunk ``c``'s gradients are reduced now; the next backward compares the order."""
        self._order = (self._order * 1_000_003 + c.index + 1) % (1 << 61)

    def begin(self, loss: Tensor | None) -> None:
        """Before a backward of ``loss``: issue the ranks' comparison (``Sharding.differences``),
        read before its first chunk collective (``Sharding.hold_collectives``)."""
        if self.sharding.whole:
            return
        members = [(c, i) for c in self.chunks for i in c.grad_members]
        reached = reached_leaves(loss)
        result = self.sharding.differences([id(c.params[i]) in reached for c, i in members], self._order)
        self._order = 0
        self.sharding.hold_collectives(lambda: self._verdict(result, members))

    def _verdict(self, result, members) -> str | None:
        differ, order_differs = result()
        if not (differ or order_differs):
            return None
        names = [members[k][0].spec.members[members[k][1]].name for k in differ]
        what = (f"parameter(s) {', '.join(names[:3])}{' and others' if len(names) > 3 else ''} get a gradient on "
                "some ranks and not on others" if names else
                "the previous backward reduced its chunks in a different order on some ranks (the model ran its "
                "modules in a data-dependent order)")
        return (f"ProTrain with {self.sharding.world} processes (rank {self.sharding.rank}): {what}. Every rank must "
                "give a gradient to the same parameters, in the same order, in every backward, as DDP requires by "
                "default (find_unused_parameters=False): use the parameter on every rank (e.g. add 0 * its output to "
                "the loss), or set requires_grad=False on it.")


def reached_leaves(root: Tensor | None) -> set[int]:
    """The ids of the leaf tensors whose gradients ``root.backward()`` computes: the variables
    of the ``AccumulateGrad`` nodes its autograd graph reaches."""
    seen, leaves = set(), set()
    stack = [getattr(root, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(f for f, _ in node.next_functions)
    return leaves


def piece(start: int, numel: int, shard: int, rank: int) -> tuple[int, int, int] | None:
    """The part of the elements ``[start, start + numel)`` of a span that lies in piece ``rank``
    (of ``shard`` elements): (offset in the elements, offset in the piece, length); None if none."""
    lo, hi = max(start, rank * shard), min(start + numel, (rank + 1) * shard)
    if lo >= hi:
        return None
    return lo - start, lo - rank * shard, hi - lo
