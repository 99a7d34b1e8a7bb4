"""Data parallelism over chunks: the process group a chunk's states are sharded over, and the
collectives that assemble and reduce chunks (ZeRO-3 over chunks; DESIGN.md §8).

[Note: sharded chunks]
With ``W`` processes every chunk is split in two spans, each sharded in ``W`` equal pieces
(padded): the frozen span (``F`` elements, shard ``s_f``) and the trainable span (``T``, shard
``s_t``). Rank ``r`` owns piece ``r`` of both: of the compute copy (a streamed chunk keeps it in
pinned host memory), and of the master, the gradient accumulator and the Adam states. The
gathered compute copy on the device is laid out ``[frozen: s_f * W | trainable: s_t * W]``; in
one process (rank 0 of ``W = 1``) it is the chunk's two spans where the layout puts them
(``s_f = F``: member offsets are aligned). A member's place in it is its offset in the layout,
shifted by the trainable span's move for trainable members; ``ShardLayout`` in storage.py
answers where a member is in every tensor of a chunk on this rank.

  fetch     upload the rank's compute shard into its place in the device copy, then
            ``all_gather_into_tensor`` in place (one collective per non-empty span; gloo: one
            broadcast per rank's piece, ``Sharding.gather_``)
  backward  gradients land in a device buffer of the whole (padded) trainable span; when the
            chunk is done they are ``reduce_scatter_tensor``ed to their mean as DDP takes it
            (each rank's gradient times ``1/W``, summed: NCCL's AVG; gloo: times ``1/W``
            as each gradient is copied into the buffer, and on CPU tensors each rank sends
            the others their pieces and sums what it receives, ``_exchange_and_sum``), and
            the rank's piece goes to the accumulator (offloaded to the host for a streamed chunk)
  update    Adam on the rank's pieces (it is elementwise, so a piece of a parameter updates
            exactly as the whole would); a persistent chunk then gathers its trainable span
            again; a streamed one is gathered at its next fetch
  norms     each rank's pieces' norms are combined into the global norm with one all-reduce;
            fp16's found-inf is all-reduced (max)

A persistent chunk keeps its whole compute copy on the device (its frozen span is therefore
replicated: sharding it would save no memory and cost a gather); a streamed chunk's frozen span
is sharded like the rest (host memory is shared by a node's ranks, so replication would cost
``W`` times the host memory and ``W`` times the upload).

Every rank must issue the same collectives in the same order: the runtime's decisions depend
only on the state machines of the chunks, never on timing (a prefetch waits for the chunk's
update instead of skipping a chunk still updating), and the planner's decisions are rank 0's,
broadcast (``agree``). What the runtime cannot decide alone is which parameters get gradients:
that is the user's graph. So at each backward the ranks compare, in one host all-reduce
(``UsageCheck.begin``), which parameters their losses reach (the autograd graph's leaves,
as DDP's ``find_unused_parameters`` finds them), and stop together with the fix where they
differ -- before any chunk collective could pair one rank's chunk with another's: the
all-reduce is issued as backward begins, and its result read before the backward's first
chunk collective (``Sharding.hold_collectives``), so it travels while the last blocks'
gradients are computed. The same collective compares a hash of the order in which the
previous backward reduced its chunks, which the graph decides too (a model that runs its
modules in a data-dependent order).
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from protrain_core.runtime.device import deferring, wait_work

# torch >= 2.12 renamed the tensor collectives; the older names still work (with a warning).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The tag of the point-to-point messages of gloo's reductions (``Sharding._exchange_and_sum``),
# apart from a user's own messages (tag 0 unless they choose).
_EXCHANGE_TAG = 0x5054


@dataclass
class Sharding:
    """The process group a wrapped model is sharded over; one process is the group of one
    (``ONE_PROCESS``: ``whole``)."""

    group: object = None  # a torch.distributed ProcessGroup (None: the group of one)
    rank: int = 0
    world: int = 1
    checks: object = None  # a gloo group over the same ranks for host-side agreement (None: ``group``)
    _verdict: Callable[[], str | None] | None = field(default=None, init=False, repr=False, compare=False)
    _device_type: str = field(default="cpu", init=False, repr=False, compare=False)  # of the chunks' tensors

    @staticmethod
    def resolve(process_group=None) -> Sharding:
        """The sharding of an engine built now: ``process_group`` (default: the default group when
        torch.distributed is initialized), or the group of one (``ONE_PROCESS``) in one process. A
        ``Sharding`` is used as it is (a simulated group of ranks: protrain_core/simulator)."""
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
        """One process, the group of one: it holds every chunk whole, and every collective is
        the identity (it returns at once: no copy, no host wait). The few things that differ
        with ``W`` processes ask this: a gradient read through ``p.grad`` (no rank holds it
        whole), the order-independent global norm, timing-independent prefetches (every rank
        must issue the same collectives), a failed backward's reductions (a collective on a
        failure path meets a rank that has left), the ranks' usage check (nothing to compare)."""
        return self.world == 1

    @functools.cached_property
    def backend(self) -> str | None:
        """The backend of the chunk collectives: the group's for tensors of the engine's device
        (``check_device`` tells it which; before that, the CPU's)."""
        return None if self.whole else backend_of(self._device_type, self.group)

    def check_device(self, device: torch.device) -> None:
        """Refuse a device the group's backend cannot reach, before anything is allocated; the
        chunk collectives then run on that device's backend (a group may have one per device
        type: torch's default, ``init_process_group()`` without a backend, is gloo for CPU
        tensors and NCCL for CUDA ones)."""
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
        self.__dict__.pop("pre_scale", None)
        self._device_type = device.type

    # ----- collectives ---------------------------------------------------------------------------
    @property
    def _on_gloo(self) -> bool:
        """gloo's own all-gather and reduce-scatter are its slowest ways to move a chunk: slower
        than an all-reduce, and than one broadcast per piece (measured in benchmarks/HISTORY.md,
        "gloo's gather by broadcasts", "gloo's reduction by messages"). So on gloo a gather is
        a broadcast from each rank of its piece, and a reduction point-to-point messages (an
        all-reduce on GPU tensors, which gloo's messages do not take)."""
        return self.backend == "gloo"

    def gather_(self, full: Tensor) -> None:
        """All-gather in place: piece ``rank`` of ``full`` (W equal pieces) is this rank's. On
        gloo, each rank broadcasts its piece into the others' ``full`` (the same values, bit
        for bit: a copy)."""
        self.check_held()
        n = full.numel() // self.world
        if not n or self.whole:
            return
        if self._on_gloo:
            for r in range(self.world):
                _issue(dist.broadcast, full[r * n:(r + 1) * n], src=dist.get_global_rank(self.group, r), group=self.group)
            return
        _issue(_all_gather, full, full[self.rank * n:(self.rank + 1) * n], group=self.group)

    @functools.cached_property
    def pre_scale(self) -> float | None:
        """What each rank's gradients are multiplied by before ``reduce_scatter_mean`` sums
        them (``scaled``): ``1/W`` where the backend has no average (gloo); None with NCCL,
        whose average scales inside the collective. A chunk applies it as a gradient is copied
        into its buffer (``Chunk.receive``), so no pass over the buffer is added for it. (Read
        for every gradient: cached after the first look at the backend.)"""
        return None if self.backend == "nccl" or self.whole else 1.0 / self.world

    def reduce_scatter_mean(self, out: Tensor, full: Tensor, *, scaled: bool = False) -> None:
        """``out`` = piece ``rank`` of the mean of ``full`` over the ranks, as DDP averages:
        every rank's values times ``1/W``, then summed. NCCL's average does exactly that inside
        the collective (a pre-multiplied sum); gloo has no average, so ``full`` is scaled in
        place first -- unless ``scaled``: it holds ``pre_scale`` times the values already --
        and reduced by messages (``_on_gloo``)."""
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
        if self._on_gloo and full.device.type == "cpu":
            self._exchange_and_sum(out, full)
            return
        if self._on_gloo:  # gloo on a GPU tensor: the whole sum, of which this rank keeps its piece
            mine = full[self.rank * out.numel():(self.rank + 1) * out.numel()]
            _issue(dist.all_reduce, full, op=dist.ReduceOp.SUM, group=self.group, then=lambda: out.copy_(mine))
            return
        _issue(_reduce_scatter, out, full, op=dist.ReduceOp.SUM, group=self.group)

    def _exchange_and_sum(self, out: Tensor, full: Tensor) -> None:
        """gloo's reduce-scatter of CPU tensors by point-to-point messages: each rank sends piece
        ``r`` of its ``full`` to rank ``r`` and receives every other rank's piece ``rank``, then
        sums them in rank order into ``out`` (the first received piece lands in ``out`` itself).
        Each rank sends and receives ``(W-1)/W`` of the buffer, as a ring reduce-scatter does,
        against twice that for the all-reduce; gloo's own reduce-scatter and its all-reduce are
        several times slower (benchmarks/HISTORY.md, "gloo's reduction by messages"). With two
        ranks the sum is the all-reduce's bit for bit (one addition, commutative); with more,
        rank order fixes it (a ring sums each piece in another order: the last bits differ)."""
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
        if self.whole:
            return t
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
        """One host all-reduce, issued at the start of a backward (``UsageCheck.begin``)
        without waiting: the returned function waits for it and gives the positions of ``used``
        (which parameters this rank's loss reaches) where the ranks differ, and whether
        ``order`` (a hash of the chunks the previous backward reduced, in order) differs. The
        ranks' collectives must come in the same order ([Note: sharded chunks]); a parameter
        that gets a gradient on some ranks and not others breaks that."""
        t = torch.tensor([order, -order, *used, *(-int(u) for u in used)], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.checks or self.group, async_op=True)

        def result() -> tuple[list[int], bool]:
            wait_work(work)
            n = len(used)
            return (t[2:2 + n] != -t[2 + n:]).nonzero().flatten().tolist(), int(t[0]) != -int(t[1])

        return result

    def hold_collectives(self, verdict: Callable[[], str | None] | None) -> None:
        """The chunk collectives issued from now on (``gather_``, ``reduce_scatter_mean``) first
        call ``verdict`` (once): where it gives a message, they raise it instead, on every rank
        alike (the verdict is the outcome of a collective). None: forget a verdict not called
        (a backward that failed before its first chunk collective; nothing is waited for)."""
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
        if self.whole:
            return
        _blocking(dist.broadcast, t, src=dist.get_global_rank(self.group, src), group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        return obj if self.whole else broadcast_object(obj, dist.get_global_rank(self.group, src), self.group)

    def barrier(self) -> None:
        if not self.whole:
            barrier(self.group)


ONE_PROCESS = Sharding()  # the group of one (``whole``): it holds no state, so every engine shares it


def backend_of(device_type: str, group=None) -> str | None:
    """The backend that runs ``group``'s collectives (None: the default group's) on tensors of
    ``device_type``: "gloo", "nccl", ...; None where none does. Read from the group's backend
    config ("cpu:gloo,cuda:nccl"), which names one per device type also where the group was
    made with a single name, or with none (``get_backend`` then says "undefined")."""
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
    """``collective`` on ``t`` (and ``args``) run to its end: on CPU tensors (gloo) waited for
    with ``wait_work``, so that ctrl-C still ends the process; on a device, as torch issues it
    (NCCL orders it on the stream, and the host waits only where it reads the result)."""
    if t.device.type != "cpu":
        collective(t, *args, **kwargs)
        return
    wait_work(collective(t, *args, async_op=True, **kwargs))


def _issue(collective, *args, then=None, **kwargs) -> None:
    """Run a tensor collective, then ``then``: at once, or -- inside a CPU device's
    ``DeviceContext.collective`` -- issued without blocking and joined to its event, which runs
    ``then`` when it is waited for (every rank still issues the same collectives in the same
    order: from the thread that drives the step)."""
    event = deferring()
    if event is None:
        _blocking(collective, *args, **kwargs)
        if then is not None:
            then()
        return
    event.add(collective(*args, async_op=True, **kwargs), then)


def _issue_all(works: list, then) -> None:
    """Point-to-point messages already posted (their ``Work``s), then ``then``: waited for at
    once, or -- inside a CPU device's ``DeviceContext.collective`` -- joined to its event, as
    ``_issue`` does for a collective. gloo's message ``Work`` cannot be polled (its
    ``is_completed`` stays False, and a second ``wait`` never returns), so ``_Waiter`` waits
    for them and the caller polls that."""
    posted = _Waiter.get().watch(works)
    event = deferring()
    if event is None:
        wait_work(posted)
        then()
        return
    event.add(posted, then)


class _Posted:
    """Messages a ``_Waiter`` waits for, as a ``Work`` that can be polled (``wait_work``)."""

    def __init__(self, works: list) -> None:
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


class _Waiter:
    """A daemon thread per process that waits, in order, for the messages of ``_issue_all``
    (``Work.wait`` releases the GIL: the thread that drives the step runs on). The thread that
    waits for a ``_Posted`` polls it, so that ctrl-C still ends the process (``wait_work``)."""

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

    def watch(self, works: list) -> _Posted:
        posted = _Posted(works)
        self.queue.put(posted)
        return posted

    def _run(self) -> None:
        while True:
            posted = self.queue.get()
            try:
                for work in posted.works:
                    work.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised by the thread that waits for it
                posted.error = e
            posted.works = []
            posted.done.set()


def broadcast_tensors(tensors, sharding: Sharding, device: torch.device) -> None:
    """Rank 0's values of a module's parameters or buffers on every rank, one tensor at a time
    (through ``device``: NCCL broadcasts device tensors only), as DDP does when it wraps a model."""
    if sharding.whole:
        return
    with torch.no_grad():
        for t in tensors:
            moved = t.detach().to(device)
            sharding.broadcast_(moved)
            if moved is not t.data:
                t.data.copy_(moved)


def agree_budgets(sharding: Sharding, device_budget: int, host_budget: int | None) -> tuple[int, int | None]:
    """The budgets every rank plans with: the smallest device budget of the ranks, and the
    smallest host budget divided among the ranks of a node (they share its memory). Each rank
    measured its own free memory, which differs a little, and a plan must be the same on all."""
    hosts = sharding.gather_objects(socket.gethostname())
    per_node = hosts.count(hosts[sharding.rank])
    # Every rank has the same kind of device, so the host budget is None on all of them or none.
    # The smallest of each: the largest of the negated (exact in float64 below 2**53 bytes).
    low = sharding.max_on_host([-float(device_budget), -float(0 if host_budget is None else host_budget // per_node)])
    return int(-low[0]), None if host_budget is None else int(-low[1])


def check_same_configuration(sharding: Sharding, fields: dict[str, object]) -> None:
    """Every rank's ``fields`` (what ``wrap`` was given and derived: precision, chunk size, the
    model's parameters, the optimizer, the plan's inputs) compared in one host collective; where
    they differ, every rank raises the same error naming the fields and each rank's value --
    before anything is allocated, instead of a collective mismatch later."""
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
    """Rank 0's ``decision`` on every rank (identity in one process): every choice that changes
    which collectives run -- a plan, a switch -- is rank 0's ([Note: sharded chunks])."""
    return sharding.broadcast_object(decision)


class UsageCheck:
    """What each backward reduces, compared across the ranks before its first chunk collective
    ([Note: sharded chunks]): which parameters the loss reaches, and the order in which the
    previous backward reduced its chunks. The group of one has nothing to compare."""

    def __init__(self, sharding: Sharding, chunks: list) -> None:
        self.sharding, self.chunks = sharding, chunks
        self._order = 0  # a hash of the chunks this backward reduced, in order

    def reduced(self, c) -> None:
        """Chunk ``c``'s gradients are reduced now; the next backward compares the order."""
        self._order = (self._order * 1_000_003 + c.index + 1) % (1 << 61)

    def begin(self, loss: Tensor | None) -> None:
        """Before a backward: one host all-reduce compares which parameters the ranks' losses
        reach, and the order of the previous backward's reductions. It is issued here and read
        before the backward's first chunk collective (``Sharding.hold_collectives``), so the
        backward of the last blocks runs while it travels; a difference stops every rank there,
        with the fix, before a collective could pair different chunks."""
        if self.sharding.whole:
            return
        members = [(c, i) for c in self.chunks for i in c.grad_members]
        reached = reached_leaves(loss)
        result = self.sharding.differences([id(c.params[i]) in reached for c, i in members], self._order)
        self._order = 0
        self.sharding.hold_collectives(lambda: self._verdict(result, members))

    def _verdict(self, result, members) -> str | None:
        """The check's outcome, read before the backward's first chunk collective (a host wait
        for its all-reduce only where it is still travelling): the error, or None."""
        differ, order_differs = result()
        if not (differ or order_differs):
            return None
        return _usage_mismatch(self.sharding, [members[k][0].spec.members[members[k][1]].name for k in differ])


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


def _usage_mismatch(sharding, names: list[str]) -> str:
    what = (f"parameter(s) {', '.join(names[:3])}{' and others' if len(names) > 3 else ''} get a gradient on some "
            "ranks and not on others" if names else
            "the previous backward reduced its chunks in a different order on some ranks (the model ran its modules in "
            "a data-dependent order)")
    return (f"ProTrain with {sharding.world} processes (rank {sharding.rank}): {what}. Every rank must give a gradient "
            "to the same parameters, in the same order, in every backward, as DDP requires by default "
            "(find_unused_parameters=False): use the parameter on every rank (e.g. add 0 * its output to the loss), "
            "or set requires_grad=False on it.")


def piece(start: int, numel: int, shard: int, rank: int) -> tuple[int, int, int] | None:
    """The part of the elements ``[start, start + numel)`` of a span that lies in piece ``rank``
    (of ``shard`` elements): (offset in the elements, offset in the piece, length); None if none."""
    lo, hi = max(start, rank * shard), min(start + numel, (rank + 1) * shard)
    if lo >= hi:
        return None
    return lo - start, lo - rank * shard, hi - lo
