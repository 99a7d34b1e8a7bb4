"""Where each member of one chunk is in the chunk's tensors on this rank, and its values
(``Chunk.values``): views and values from the storage's ``ShardLayout``. Its only collectives
are ``gathered_values`` and ``gather_shard`` ([Note: sharded chunks] in sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from protrain_core.runtime.frozen_formats import round_trip
from protrain_core.runtime.storage import ChunkStorage, ShardLayout
from protrain_core.structure.layout import ChunkSpec, ParamSlot


@dataclass(frozen=True)
class UpdateViews:
    """Per-member views of a chunk's states for one optimizer step (``ChunkValues.update_views``)."""

    flats: tuple  # the storage's tensors they view (a change rebuilds them)
    steps: list  # the storage's step counters they were taken from
    master: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    max_exp_avg_sqs: list[Tensor]
    member_steps: list[Tensor]
    lows: list[Tensor]  # in the compute copy's trainable span (mixed precision only, else [])

    @property
    def states(self) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The state slots' views (Adam's moments, or another optimizer's states)."""
        return self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs


class ChunkValues:
    """The members of one chunk in its storage's tensors: views, this rank's pieces, values."""

    def __init__(self, spec: ChunkSpec, storage: ChunkStorage) -> None:
        self.spec = spec
        self.storage = storage
        self._views: dict[tuple[int, ...], UpdateViews] = {}  # members -> their views for an update

    def __repr__(self) -> str:
        return f"ChunkValues({self.spec.index})"

    def forget_views(self) -> None:
        """The storage's tensors moved (a re-plan): drop the update views that keep the old ones."""
        self._views.clear()

    def view(self, flat: Tensor, i: int) -> Tensor:
        """Member ``i`` in ``flat``, a compute copy of the whole chunk."""
        m = self.spec.members[i]
        offset = self.storage.shards.device_offset(m)
        return flat[offset : offset + m.numel].view(m.shape)

    def at_rest(self, i: int) -> Tensor | None:
        """Member ``i``'s value where a streamed chunk rests (one process); None for a quantised
        member ([Note: quantised frozen chunks] in frozen_formats.py)."""
        storage, m = self.storage, self.spec.members[i]
        if self._in_store(i):
            return None if storage.frozen.entries[i][0] else self.member_value(i)
        _, at, n = storage.shards.host_piece(m)
        return storage.host_copy[at:at + n].view(m.shape)

    def _in_store(self, i: int) -> bool:
        """Member ``i`` is a frozen one of a streamed chunk whose frozen span is in the host store."""
        storage = self.storage
        return storage.frozen is not None and not storage.persistent and not self.spec.members[i].trainable

    def span_view(self, flat: Tensor, i: int) -> Tensor:
        """Member ``i`` (a trainable one) in ``flat``, a tensor of the whole trainable span."""
        m = self.spec.members[i]
        assert m.trainable, (self, m.name)
        start = self.storage.shards.span_offset(m)
        return flat[start : start + m.numel].view(m.shape)

    def span_gaps(self, members) -> tuple[tuple[int, int], ...]:
        """The (start, end) ranges of the trainable span that no member in ``members`` covers."""
        return tuple(gaps([(self.span_offset(i), self.spec.members[i].numel) for i in members],
                          self.storage.fmt.grad_buffer_numel))

    def state_part(self, i: int, rank: int | None = None) -> tuple[int, int, int] | None:
        """Member ``i``'s piece of this rank's (or ``rank``'s) shard of the trainable span."""
        shards = self.storage.shards if rank is None else ShardLayout(self.storage.fmt, rank)
        return shards.state_piece(self.spec.members[i])

    def span_offset(self, i: int) -> int:
        """Member ``i``'s offset in the whole trainable span."""
        return self.storage.shards.span_offset(self.spec.members[i])

    def state_view(self, flat: Tensor, i: int) -> Tensor:
        """Member ``i`` (a trainable one) in ``flat``, a tensor of this rank's shard of the
        trainable span: shaped like the member where it is whole, else flat (maybe empty)."""
        return _shaped(flat, self.storage.shards.state_piece(self.spec.members[i]), self.spec.members[i])

    def update_views(self, members: tuple[int, ...]) -> UpdateViews:
        """The views of ``members`` an Adam step reads and writes, built once per set of members
        (rebuilding them cost more than the step on small chunks) and when the tensors change."""
        storage = self.storage
        states = (storage.master, storage.grad_acc, storage.exp_avg, storage.exp_avg_sq, storage.max_exp_avg_sq)
        flats = states + (storage.compute_home,)
        views = self._views.get(members)
        if views is None or views.steps is not storage.steps or any(a is not b for a, b in zip(views.flats, flats)):
            def of(flat):
                return [] if flat is None else [self.state_view(flat, i) for i in members]

            lows = of(storage.compute_span()) if storage.fmt.separate_master else []
            views = UpdateViews(flats, storage.steps, *(of(f) for f in states), [storage.steps[i] for i in members], lows)
            self._views[members] = views
        return views

    def piece(self, i: int, flat: Tensor | None = None) -> tuple[int, Tensor] | None:
        """(offset in member ``i``'s flattened elements, this rank's piece of it) in ``flat`` (a
        shard tensor of the trainable span; None: of the member's value), or None: none here."""
        storage, m = self.storage, self.spec.members[i]
        trainable = m.trainable and (flat is not None or storage.master is not None)
        if flat is not None and not trainable:
            return None
        store = self._in_store(i)  # from the host store: the whole member (one process), or its piece
        if store and storage.fmt.whole:
            return 0, self.member_value(i).reshape(-1)
        shards = storage.shards
        part = shards.state_piece(m) if trainable else shards.frozen_piece(m) if store else shards.host_piece(m)
        if part is None:
            return None
        off, at, n = part
        if trainable:
            return off, self.state_view(storage.master if flat is None else flat, i).reshape(-1)
        if store:
            return off, storage.piece_values()[at:at + n]
        if storage.persistent:  # a frozen member: this rank's piece of the replicated device copy
            return off, self.view(storage.device_copy, i).reshape(-1)[off:off + n]
        return off, storage.host_copy[at:at + n]

    def own_piece(self, i: int, value: Tensor) -> Tensor:
        """This rank's piece of member ``i``'s whole ``value``, shaped as ``state_view`` is."""
        m = self.spec.members[i]
        part = self.storage.shards.state_piece(m)
        return _shaped(value.reshape(-1), None if part is None else (0, part[0], part[2]), m)

    def set_member(self, i: int, value: Tensor, *, in_place: bool = False) -> None:
        """Write member ``i``'s ``value``: its master (trainable), and the compute copy where it
        rests (this rank's pieces of a streamed chunk's host copy). ``in_place``: ``value`` is the
        compute copy written in place, whose unchanged elements keep the master's precision."""
        storage, m = self.storage, self.spec.members[i]
        trainable = m.trainable and storage.master is not None
        frozen, c = storage.frozen, storage.fmt.compute_dtype
        with torch.no_grad():
            if trainable:
                master = self.state_view(storage.master, i)
                piece = self.own_piece(i, value)
                if in_place and piece.dtype != master.dtype:  # (the compute copy: compared where the master is)
                    piece = piece.to(master.device)
                    piece = torch.where(piece != master.to(piece.dtype), piece.to(master.dtype), master)
                master.copy_(piece)
            if storage.persistent:
                if frozen is not None and not m.trainable and frozen.entries[i][0]:  # what a streamed chunk keeps
                    value = round_trip(value.detach().to(device=storage.device, dtype=c), frozen.fmt)
                self.view(storage.device_copy, i).copy_(value)
                return
            if self._in_store(i):
                frozen.write(i, value, storage.frozen_store, c)
                return
            part = storage.shards.host_piece(m)
            if part is None or (trainable and not storage.fmt.separate_master):  # the master is the host copy
                return
            off, at, n = part
            source = master.reshape(-1) if trainable else value.reshape(-1)[off:off + n]
            storage.host_copy[at:at + n].copy_(source)

    def member_value(self, i: int) -> Tensor:
        """Member ``i``'s authoritative value (one process): its master, or a frozen member's value."""
        storage = self.storage
        assert storage.fmt.whole, "a sharded chunk holds pieces only: gathered_values()"
        if self.spec.members[i].trainable and storage.master is not None:
            return self.state_view(storage.master, i)
        if self._in_store(i):  # a kept member's view, a quantised one's round trip
            return storage.frozen.read(i, storage.frozen_store, storage.fmt.compute_dtype)
        return self.view(storage.compute_home, i)

    def gathered_values(self, state: str | None = None) -> list[Tensor]:
        """Every member's whole authoritative value (``member_value``), all-gathered when sharded
        (a collective: every rank calls it in the same order). ``state``: gather the storage's
        shard tensor of that name instead of the master (an Adam state; frozen members then give None)."""
        storage, fmt = self.storage, self.storage.fmt
        shard = storage.master if state is None else getattr(storage, state)
        if fmt.whole:
            if state is None:
                return [self.member_value(i) for i in range(len(self.spec.members))]
            return [self.state_view(shard, i) if m.trainable and shard is not None else None
                    for i, m in enumerate(self.spec.members)]
        trainable = None if shard is None else gather_shard(storage, shard)
        frozen = None
        if state is None and fmt.frozen_numel and any(not m.trainable for m in self.spec.members):
            frozen = storage.device_copy[:fmt.trainable_device_start] if storage.persistent else \
                gather_shard(storage, storage.piece_values() if storage.frozen is not None else
                             storage.host_copy[:fmt.frozen_shard])
        out = []
        for i, m in enumerate(self.spec.members):
            if m.trainable and trainable is not None:
                out.append(self.span_view(trainable, i))
            elif state is None:
                out.append(self.view(storage.device_copy if m.trainable else frozen, i))
            else:
                out.append(None)
        return out


def gaps(pieces: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The (start, end) ranges of ``[0, end)`` that no ``(start, length)`` of ``pieces`` covers."""
    out, at = [], 0
    for start, n in sorted(pieces) + [(end, 0)]:
        if start > at:
            out.append((at, start))
        at = max(at, start + n)
    return out


def _shaped(flat: Tensor, part: tuple[int, int, int] | None, m: ParamSlot) -> Tensor:
    """The ``(member offset, offset, length)`` piece of ``flat`` (shaped like ``m`` when whole)."""
    if part is None:
        return flat[:0]
    _, at, n = part
    return flat[at:at + n].view(m.shape) if n == m.numel else flat[at:at + n]


def gather_shard(storage: ChunkStorage, shard: Tensor) -> Tensor:
    """The whole span of which ``shard`` is this rank's piece, all-gathered on ``storage``'s device."""
    n, sharding = shard.numel(), storage.sharding
    full = torch.empty(n * sharding.world, dtype=shard.dtype, device=storage.device)
    full[sharding.rank * n:(sharding.rank + 1) * n].copy_(shard)
    sharding.gather_(full)
    return full
