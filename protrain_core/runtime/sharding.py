"""Data parallelism over chunks: the process group a chunk's states are sharded over, and the
collectives that assemble and reduce chunks (ZeRO-3 over chunks; DESIGN.md §8).

[Note: sharded chunks]
With ``W`` processes every chunk is split in two spans, each sharded in ``W`` equal pieces
(padded): the frozen span (``F`` elements, shard ``s_f``) and the trainable span (``T``, shard
``s_t``). Rank ``r`` owns piece ``r`` of both: of the compute copy (a streamed chunk keeps it in
pinned host memory), and of the master, the gradient accumulator and the Adam states. The
gathered compute copy on the device is laid out ``[frozen: s_f * W | trainable: s_t * W]``; in
one process it is the chunk itself (``s_f * W = F``), so a member's place in it is its offset
in the layout, shifted by the trainable span's move for trainable members (``ChunkFormat``).

  fetch     upload the rank's compute shard into its place in the device copy, then
            ``all_gather_into_tensor`` in place (one collective per non-empty span)
  backward  gradients land in a device buffer of the whole (padded) trainable span; when the
            chunk is done they are multiplied by ``1/W`` and ``reduce_scatter_tensor``ed (sum),
            as DDP does (each rank's gradient times ``1/W``, summed), and the rank's piece goes
            to the accumulator (offloaded to the host for a streamed chunk)
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
broadcast (``agree``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.12 renamed the tensor collectives; the older names still work (with a warning).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Sharding:
    """The process group a wrapped model is sharded over (one per engine)."""

    group: object  # a torch.distributed ProcessGroup
    rank: int
    world: int
    checks: object = None  # a gloo group over the same ranks for host-side agreement (None: ``group``)
    members: int = 0  # the most members with gradients of any chunk (the width of ``agree_received``)

    @staticmethod
    def resolve(process_group=None) -> Sharding | None:
        """The sharding of an engine built now: ``process_group`` (default: the default group when
        torch.distributed is initialized); None in one process. A ``Sharding`` is used as it
        is (a simulated group of ranks: protrain_core/simulator)."""
        if isinstance(process_group, Sharding):
            return process_group
        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            process_group = dist.group.WORLD
        world = dist.get_world_size(process_group)
        if world == 1:
            return None
        checks = None
        if "gloo" not in str(dist.get_backend(process_group)):  # NCCL: host-side checks need their own group
            ranks = [dist.get_global_rank(process_group, r) for r in range(world)]
            checks = dist.new_group(ranks=ranks, backend="gloo")
        return Sharding(process_group, dist.get_rank(process_group), world, checks)

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))

    def check_device(self, device: torch.device) -> None:
        """Refuse a device the group's backend cannot reach, before anything is allocated."""
        backend = self.backend
        if device.type == "cpu" and "gloo" not in backend:
            raise ValueError(
                f"The process group's backend is {backend!r}, which cannot run collectives on CPU tensors; "
                "train on CPU with the 'gloo' backend (Lightning picks it for accelerator='cpu')."
            )
        if device.type == "cuda" and "nccl" not in backend and "gloo" not in backend:
            raise ValueError(f"The process group's backend {backend!r} cannot run collectives on CUDA tensors: use 'nccl'.")

    # ----- collectives ---------------------------------------------------------------------------
    def gather_(self, full: Tensor) -> None:
        """All-gather in place: piece ``rank`` of ``full`` (W equal pieces) is this rank's."""
        n = full.numel() // self.world
        if n:
            _all_gather(full, full[self.rank * n:(self.rank + 1) * n], group=self.group)

    def reduce_scatter_mean(self, out: Tensor, full: Tensor) -> None:
        """``out`` = piece ``rank`` of the mean of ``full`` over the ranks, as DDP averages:
        every rank's values times ``1/W``, then summed. ``full`` is scaled in place."""
        if not out.numel():
            return
        full.mul_(1.0 / self.world)
        _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_(self, t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def max_on_host(self, values: list[float]) -> list[float]:
        """The largest of each value over the ranks (host numbers: the slowest rank's timings)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.checks or self.group)
        return t.tolist()

    def agree_received(self, index: int, received: list[bool]) -> list[bool]:
        """Before chunk ``index``'s gradients are reduced (``index`` -1: the end of a backward):
        check on the host that every rank reduces the same chunk now, and return which of its
        members got a gradient on any rank (the mean of their gradients exists; torch skips the
        others). The ranks' collectives must come in the same order ([Note: sharded chunks]); a
        parameter that gets a gradient on some ranks and not others breaks that, so it is
        refused here, with the fix, instead of mixing up chunks."""
        t = torch.zeros(2 + self.members, dtype=torch.int64)
        t[0], t[1] = index, -index
        t[2:2 + len(received)] = torch.tensor(received, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.checks or self.group)
        if int(t[0]) != -int(t[1]):
            here = f"chunk {index}" if index >= 0 else "the end of backward"
            raise RuntimeError(
                f"ProTrain with {self.world} processes: rank {self.rank} is at {here} of its backward while another "
                f"rank reduces chunk {int(t[0])}: some parameter got a gradient on some ranks and not on others (a "
                "branch, an expert or a module one rank did not use). Every rank must give a gradient to the same "
                "parameters in every backward, as DDP requires by default (find_unused_parameters=False): use the "
                "parameter on every rank (e.g. add 0 * its output to the loss), or set requires_grad=False on it."
            )
        return [bool(v) for v in t[2:2 + len(received)]]

    def broadcast_(self, t: Tensor, src: int = 0) -> None:
        """Rank ``src``'s ``t`` on every rank, in place."""
        dist.broadcast(t, src=dist.get_global_rank(self.group, src), group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def broadcast_module(module, sharding: Sharding, device: torch.device) -> None:
    """Rank 0's parameters and buffers on every rank, one tensor at a time (through ``device``:
    NCCL broadcasts device tensors only), as DDP does when it wraps a model."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            moved = t.detach().to(device)
            sharding.broadcast_(moved)
            if moved is not t.data:
                t.data.copy_(moved)


def agree_budgets(sharding: Sharding | None, device_budget: int, host_budget: int | None) -> tuple[int, int | None]:
    """The budgets every rank plans with: the smallest device budget of the ranks, and the
    smallest host budget divided among the ranks of a node (they share its memory). Each rank
    measured its own free memory, which differs a little, and a plan must be the same on all."""
    if sharding is None:
        return device_budget, host_budget
    hosts = [None] * sharding.world
    dist.all_gather_object(hosts, socket.gethostname(), group=sharding.checks or sharding.group)
    per_node = hosts.count(hosts[sharding.rank])
    # Every rank has the same kind of device, so the host budget is None on all of them or none.
    t = torch.tensor([device_budget, 0 if host_budget is None else host_budget // per_node], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=sharding.checks or sharding.group)
    return int(t[0]), None if host_budget is None else int(t[1])


def agree(sharding: Sharding | None, decision):
    """Rank 0's ``decision`` on every rank (identity in one process): every choice that changes
    which collectives run -- a plan, a switch -- is rank 0's ([Note: sharded chunks])."""
    return decision if sharding is None else sharding.broadcast_object(decision)


def piece(start: int, numel: int, shard: int, rank: int) -> tuple[int, int, int] | None:
    """The part of the elements ``[start, start + numel)`` of a span that lies in piece ``rank``
    (of ``shard`` elements): (offset in the elements, offset in the piece, length); None if none."""
    lo, hi = max(start, rank * shard), min(start + numel, (rank + 1) * shard)
    if lo >= hi:
        return None
    return lo - start, lo - rank * shard, hi - lo
