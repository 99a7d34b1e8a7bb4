"""Frozen weights kept in 8 bits on the host and over PCIe (``ProTrainConfig.frozen_dtype``).

[Note: quantised frozen chunks]
LoRA over a streamed base moves every frozen weight host -> device twice per step. With
``frozen_dtype`` "int8" or "fp8" a frozen weight matrix (a frozen member of two or more
dimensions) is stored in 8 bits with one fp32 scale per row of its first dimension (an
output channel of ``nn.Linear``; an input channel of GPT-2's ``Conv1D``):

  format  element                               scale of a row            round trip
  int8    round(w / s), clamped to [-127, 127]  2^ceil(log2(absmax/127))  q * s
  fp8     e4m3 of w / s (round to nearest)      2^ceil(log2(absmax/448))  q * s

A frozen member of one dimension (norm weights, biases) keeps the compute dtype. A chunk's host
store holds, in one byte buffer: the 8-bit values at the members' offsets in the frozen span,
the scales, and the kept members packed (``FrozenPlaces``). A fetch uploads it and dequantises
on the upload stream into the device copy, in the compute dtype as before: everything
downstream is unchanged, and the upload is about 1 byte per frozen parameter against 2.

The scales are powers of two, so ``q * s`` is exact in the compute dtype and the round trip is
a projection: quantising a dequantised weight gives the same values back (int8: the largest
``|q|`` is at least 64, so the scale comes out the same; fp8: at worst the scale halves and
every ``q`` doubles). Every path through values therefore keeps the bytes, and a persistent
chunk (dequantised values on the device) computes as a streamed one. fp16 compute: a row whose
dequantised values fall below fp16's normal range (2^-14) is rounded there.

The parity reference is the plain model with each such weight replaced by its round trip
(``dequantised``): bitwise in fp32 compute. At rest a quantised member of a streamed chunk has
no value in memory: its parameter points at a NaN expanded to its shape, ``module.state_dict()``
dequantises it for the call (runtime/states.py), and the engine's state dicts read the round trip.

With ``W`` processes a streamed chunk's frozen span is sharded ([Note: sharded chunks] in
sharding.py): rank ``r``'s store holds the 8-bit values of its piece of the span (``s_f``
elements from ``r * s_f``), and every row scale and kept member of the chunk (replicated: a
piece may cut a row). A fetch dequantises the rank's piece into its place in the device copy,
row by row where the piece cuts a row, and the all-gather assembles the whole. The scales are
those of whole rows, so every rank dequantises the values one process would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from protrain_core.runtime.host_pool import pool_bytes

FROZEN_FORMATS = ("int8", "fp8")
_QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8": 448.0}


def check_frozen_format(name: object) -> str | None:
    """``name`` if it is None or a known format, else a ValueError with the choices."""
    if name is not None and name not in FROZEN_FORMATS:
        raise ValueError(
            f"frozen_dtype={name!r}: use None (the default: frozen weights in the compute dtype), 'int8' (8-bit "
            "integers with a scale per weight row) or 'fp8' (float8 e4m3 with a scale per weight row)."
        )
    return name


def quantises(shape: tuple[int, ...]) -> bool:
    """A frozen member of this shape is kept in 8 bits (weight matrices; not norms or biases)."""
    return len(shape) >= 2 and shape[0] > 0


_SLAB = 1 << 22  # elements quantised at a time: bounds the fp32 temporaries (an embedding is large)


def quantise_into(value: Tensor, fmt: str, q: Tensor, scales: Tensor) -> None:
    """``value`` (rows: its first dimension) into ``q`` (its elements, flat) and ``scales`` (one
    fp32 power of two per row), computed in fp32 wherever ``value`` is, a slab of rows at a time."""
    rows = value.shape[0]
    v, out = value.reshape(rows, -1), q.reshape(rows, -1)
    step = max(1, _SLAB // max(1, v.shape[1]))
    limit = _QMAX[fmt]
    for r in range(0, rows, step):
        w = v[r:r + step].to(torch.float32, copy=True)  # (divided in place below)
        top = w.abs().amax(dim=1) / limit
        mantissa, exponent = torch.frexp(top)  # top = mantissa * 2^exponent, mantissa in [0.5, 1)
        s = torch.ldexp(torch.ones_like(top), exponent - (mantissa == 0.5).to(exponent.dtype))  # 1 for a zero row
        w.div_(s[:, None])  # exact: a power of two
        w = w.round_().clamp_(-limit, limit) if fmt == "int8" else w.clamp_(-limit, limit)
        out[r:r + step].copy_(w)
        scales[r:r + step].copy_(s)


def quantised_dtype(fmt: str) -> torch.dtype:
    """The dtype of format ``fmt``'s 8-bit values."""
    return _QDTYPE[fmt]


def dequantise_into(dst: Tensor, q: Tensor, scales: Tensor) -> None:
    """``dst`` (a member's value in the compute dtype; rows: its first dimension) = ``q * scales``
    per row: exact in the compute dtype (see the Note), in two kernels and no temporary."""
    rows = dst.shape[0]
    d = dst.reshape(rows, -1)
    d.copy_(q.reshape(rows, -1))
    d.mul_(scales[:, None])


def round_trip(value: Tensor, fmt: str) -> Tensor:
    """``value`` quantised and dequantised, in ``value``'s dtype: what ProTrain computes with."""
    q = torch.empty(value.numel(), dtype=_QDTYPE[fmt], device=value.device)
    scales = torch.empty(value.shape[0], dtype=torch.float32, device=value.device)
    quantise_into(value, fmt, q, scales)
    out = torch.empty_like(value)
    dequantise_into(out, q, scales)
    return out


@torch.no_grad()
def dequantised(model: nn.Module, frozen_dtype: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The parity reference of ``frozen_dtype``: every frozen weight matrix of ``model`` replaced, in
    place, by its round trip (after rounding to ``dtype``, the compute dtype; default its own),
    kept in its own dtype ([Note: quantised frozen chunks])."""
    if check_frozen_format(frozen_dtype) is None:
        return model
    for p in model.parameters():
        if not p.requires_grad and quantises(tuple(p.shape)):
            p.copy_(round_trip(p.detach().to(dtype or p.dtype), frozen_dtype))
    return model


@dataclass(frozen=True)
class FrozenPlaces:
    """Where a chunk's frozen members are in this rank's host store (offsets in elements):
    ``quantised``: (member, offset in the frozen span, rows, offset of its first scale);
    ``kept``: (member, offset in the frozen span, elements, offset in the kept values). The
    store's 8-bit values are those of the rank's piece of the frozen span, ``piece_numel``
    elements from ``piece_start`` (the whole span in one process)."""

    fmt: str
    piece_numel: int  # the 8-bit values: one per element of the rank's piece of the frozen span
    quantised: tuple[tuple[int, int, int, int], ...]
    kept: tuple[tuple[int, int, int, int], ...]
    shapes: tuple[tuple[int, ...], ...]  # every member's shape
    piece_start: int = 0

    def _sizes(self, compute_dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        scales, kept = sum(rows for _, _, rows, _ in self.quantised), sum(n for _, _, n, _ in self.kept)
        return [(self.piece_numel, _QDTYPE[self.fmt]), (scales, torch.float32), (kept, compute_dtype)]

    def store_bytes(self, compute_dtype: torch.dtype) -> int:
        return pool_bytes(self._sizes(compute_dtype))

    def views(self, store: Tensor, compute_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """(8-bit values, scales, kept values) in ``store`` (a byte tensor of ``store_bytes``)."""
        sizes = self._sizes(compute_dtype)
        starts = [pool_bytes(sizes[:k]) for k in range(len(sizes))]
        return tuple(store[at:at + numel * dtype.itemsize].view(dtype) for at, (numel, dtype) in zip(starts, sizes))

    @cached_property
    def entries(self) -> dict[int, tuple[bool, tuple[int, int, int, int]]]:
        """Each frozen member's (quantised?, its place)."""
        return {**{e[0]: (False, e) for e in self.kept}, **{e[0]: (True, e) for e in self.quantised}}

    def _in_piece(self, off: int, numel: int) -> tuple[int, int] | None:
        """The elements ``[a, b)`` of a member at ``off`` (of ``numel``) in the rank's piece; None: none."""
        a, b = max(off, self.piece_start) - off, min(off + numel, self.piece_start + self.piece_numel) - off
        return (a, b) if a < b else None

    def write(self, i: int, value: Tensor, store: Tensor, compute_dtype: torch.dtype) -> None:
        """Member ``i``'s whole ``value`` into the store (quantised from the compute dtype): its
        scales, its values in the rank's piece, a kept member whole."""
        q, scales, kept = self.views(store, compute_dtype)
        is_q, (_, off, n, at) = self.entries[i]
        value = value.detach().to(device=store.device, dtype=compute_dtype)
        if not is_q:
            kept[at:at + n].copy_(value.reshape(-1))
            return
        numel, span = math.prod(self.shapes[i]), self._in_piece(off, value.numel())
        base = off - self.piece_start
        if span == (0, numel):  # whole in the piece: quantised in place
            quantise_into(value, self.fmt, q[base:base + numel], scales[at:at + n])
            return
        whole = torch.empty(numel, dtype=q.dtype, device=store.device)
        quantise_into(value, self.fmt, whole, scales[at:at + n])
        if span is not None:
            q[base + span[0]:base + span[1]].copy_(whole[span[0]:span[1]])

    def read(self, i: int, store: Tensor, compute_dtype: torch.dtype) -> Tensor:
        """Member ``i``'s value (the round trip of a quantised one), shaped (one process)."""
        q, scales, kept = self.views(store, compute_dtype)
        is_q, (_, off, n, at) = self.entries[i]
        if not is_q:
            return kept[at:at + n].view(self.shapes[i])
        out = torch.empty(self.shapes[i], dtype=compute_dtype, device=store.device)
        assert self.piece_start == 0 and off + out.numel() <= self.piece_numel, "a rank's piece: piece_values()"
        dequantise_into(out, q[off:off + out.numel()], scales[at:at + n])
        return out

    def unpack(self, store: Tensor, piece: Tensor) -> None:
        """The rank's piece of every frozen member from ``store`` into ``piece`` (the frozen
        span's elements ``[piece_start, piece_start + piece_numel)``)."""
        q, scales, kept = self.views(store, piece.dtype)
        for i, off, rows, at in self.quantised:
            numel = math.prod(self.shapes[i])
            span = self._in_piece(off, numel)
            if span is not None:
                base, (a, b) = off - self.piece_start, span
                _dequantise_rows(piece[base + a:base + b], q[base + a:base + b], scales[at:at + rows], a, numel // rows)
        for i, off, n, at in self.kept:
            span = self._in_piece(off, n)
            if span is not None:
                base, (a, b) = off - self.piece_start, span
                piece[base + a:base + b].copy_(kept[at + a:at + b])

    def pack(self, device_copy: Tensor, store: Tensor) -> None:
        """The inverse of ``unpack`` from a persistent chunk's whole frozen span (``device_copy``:
        round trips already, so the bytes come back) into ``store``."""
        for i, off, _, _ in self.quantised + self.kept:
            self.write(i, device_copy[off:off + math.prod(self.shapes[i])].view(self.shapes[i]), store,
                       device_copy.dtype)


def _dequantise_rows(dst: Tensor, q: Tensor, scales: Tensor, first: int, row: int) -> None:
    """``dst`` = ``q`` times each element's row scale, for the elements ``[first, first + len)`` of
    a member whose rows have ``row`` elements (``scales``: all of its rows): whole rows in one
    pass, a cut row at either end on its own."""
    n = dst.numel()
    head = min(n, (-first) % row)  # the end of a row cut at the start
    r = -(-first // row)  # the first whole row
    if head:  # a cut row: one row of ``head`` elements
        dequantise_into(dst[None, :head], q[:head], scales[r - 1:r])
    whole = (n - head) // row
    if whole:
        dequantise_into(dst[head:head + whole * row].view(whole, row), q[head:head + whole * row],
                        scales[r:r + whole])
    tail = head + whole * row
    if tail < n:
        dequantise_into(dst[None, tail:], q[tail:], scales[r + whole:r + whole + 1])


def frozen_places(members, fmt: str | None, piece: tuple[int, int]) -> FrozenPlaces | None:
    """The places of a chunk's frozen members (``members``: its ``ParamSlot``s) in format ``fmt``
    (None where nothing is quantised) on the rank whose piece of the frozen span is ``piece``
    (start, elements)."""
    if fmt is None or not any(not m.trainable and quantises(m.shape) for m in members):
        return None
    quantised, kept, scales, rest = [], [], 0, 0
    for i, m in enumerate(members):
        if m.trainable:
            continue
        if quantises(m.shape):
            quantised.append((i, m.offset, m.shape[0], scales))
            scales += m.shape[0]
        else:
            kept.append((i, m.offset, m.numel, rest))
            rest += m.numel
    return FrozenPlaces(fmt, piece[1], tuple(quantised), tuple(kept), tuple(tuple(m.shape) for m in members), piece[0])
