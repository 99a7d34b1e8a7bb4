"""Execution-order chunk layout (paper §3.1 and appendix B.1; PatrickStar).

Parameters are packed into equal-size flat chunks in the order the forward pass first uses
them. All parameters of one transformer block form one *unit* and a unit never straddles two
chunks; every module outside the blocks (embeddings, final norm, head) is a unit of its own. A
tied parameter belongs to the unit of its first use. The chunk size is chosen by a grid search
that minimises wasted bytes (chunk capacity not used by parameters).

Inside a chunk the frozen parameters (``requires_grad=False`` when the layout is built: a LoRA
base model, frozen embeddings) come first and the trainable ones after them, each group in
execution order, so that the trainable ones form one span: the only part of the chunk with a
master copy, gradients and Adam states ([Note: chunk storage] in chunk_format.py).

With block-wise 8-bit moments (``block_aligned``) the first trainable member, and every trainable
member of at least the format's minimum size, start at a multiple of its block: a piece of such a
member on any rank then begins at a block boundary ([Note: optimizer-state formats] in
runtime/state_formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from protrain_core.chunk_format import ALIGN, align
from protrain_core.plan import PlanLimits
from protrain_core.structure.blocks import block_modules, split_paths
from protrain_core.structure.trace import Trace, trace, unit_names

# Chunk sizes tried by the grid search: max_unit * (1 + k / _GRID_STEPS), k = 0.._GRID_STEPS.
_GRID_STEPS = 128


def _alignment_bound(params, block_aligned: tuple[int, int] | None) -> int:
    """The most elements ``block_aligned`` can add to a unit: each aligned member moves on by
    less than a block, and so may the first trainable member of the chunk the unit goes to."""
    if block_aligned is None:
        return 0
    block, smallest = block_aligned
    trainable = [p.numel() for _, p in params if p.requires_grad]
    return (block - ALIGN) * (sum(n >= smallest for n in trainable) + bool(trainable))


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a chunk (sizes and offsets in elements)."""

    name: str  # the first name under which model.named_parameters() yields it
    offset: int
    numel: int
    shape: tuple[int, ...]
    trainable: bool = True  # requires_grad when the layout was built


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    members: tuple[ParamSlot, ...]
    units: tuple[str, ...]  # the units packed into this chunk, in order
    capacity: int  # chunk size in elements

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def waste(self) -> int:
        return self.capacity - self.numel

    @property
    def has_frozen(self) -> bool:
        return not all(m.trainable for m in self.members)

    @property
    def trainable_start(self) -> int:
        """Offset of the trainable span (the capacity when the chunk has no trainable member)."""
        return next((m.offset for m in self.members if m.trainable), self.capacity)

    @property
    def trainable_numel(self) -> int:
        """Elements of the trainable span, from its first trainable member to the end of its last."""
        last = [m for m in self.members if m.trainable]
        return last[-1].offset + last[-1].numel - self.trainable_start if last else 0


@dataclass(frozen=True)
class ChunkLayout:
    chunk_size: int  # elements per chunk
    chunks: tuple[ChunkSpec, ...]
    block_path: str
    n_blocks: int
    order_source: str  # "traced" (meta-device forward) or "registration"
    # Chunks that must be on the device at once: one tuple per stack of units that the trace saw
    # running inside one another (a unit alone included).
    resident_sets: tuple[tuple[int, ...], ...] = ()

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def waste(self) -> int:
        return sum(c.waste for c in self.chunks)

    def limits(self) -> PlanLimits:
        """What a plan must respect for this model ([Note: plan validity] in plan.py)."""
        return PlanLimits(n_chunks=self.n_chunks, n_blocks=self.n_blocks, resident_sets=self.resident_sets)

    def chunk_of(self, name: str) -> int:
        for c in self.chunks:
            if any(m.name == name for m in c.members):
                return c.index
        raise KeyError(name)

    def param_chunks(self, model: nn.Module) -> dict[int, int]:
        """``id(parameter) -> chunk index`` for every managed parameter of ``model``."""
        chunk_of = {m.name: spec.index for spec in self.chunks for m in spec.members}
        return {id(p): chunk_of[n] for n, p in model.named_parameters() if n in chunk_of}

    def summary(self, element_size: int = 4, persistent: frozenset[int] | None = None) -> str:
        """The chunks, their sizes and units (and, given the indices of the persistent ones,
        where each lives)."""
        mib = element_size / 2**20
        total = sum(c.numel for c in self.chunks)
        where_line = "" if persistent is None else f", {len(persistent)} persistent"
        lines = [
            f"ProTrain chunk layout: {self.n_chunks} chunks x {self.chunk_size:,} elements "
            f"({self.chunk_size * mib:.2f} MiB at {element_size} B/element), "
            f"{total:,} parameters, waste {self.waste:,} elements "
            f"({100.0 * self.waste / max(1, self.n_chunks * self.chunk_size):.1f}%){where_line}; "
            f"order {self.order_source}",
            f"{'chunk':>5}  {'where':<10} {'params':>7} {'elements':>12} {'waste':>10}  units",
        ]
        for c in self.chunks:
            where = "" if persistent is None else "persistent" if c.index in persistent else "streamed"
            units = c.units[0] if len(c.units) == 1 else f"{c.units[0]} .. {c.units[-1]} ({len(c.units)} units)"
            lines.append(f"{c.index:>5}  {where:<10} {len(c.members):>7} {c.numel:>12,} {c.waste:>10,}  {units}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _units(model: nn.Module, block_path: str, module_order: tuple[str, ...]):
    """Units in execution order: (unit name, [(param name, param)])."""
    modules = dict(model.named_modules())
    unplaced = {id(p): n for n, p in model.named_parameters()}
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    # Each block list's prefix and length (an encoder-decoder has two lists).
    stacks = [(f"{path}." if path else "", len(model.get_submodule(path))) for path in split_paths(block_path)]
    for mod_name in module_order:
        unit = mod_name
        for prefix, length in stacks:
            if mod_name.startswith(prefix):
                head = mod_name[len(prefix):].split(".", 1)[0]
                if head.isdigit() and int(head) < length:
                    unit = f"{prefix}{head}"
                    break
        for p in modules[mod_name].parameters(recurse=False):
            if id(p) in unplaced:  # (a tied parameter belongs to the unit of its first use)
                units.setdefault(unit, []).append((unplaced.pop(id(p)), p))
    return list(units.items())


def pack(unit_sizes: list[int], chunk_size: int, owners: list[int | None] | None = None) -> list[list[int]]:
    """Units (by size, in order) -> chunks (lists of unit indices), filling each chunk in turn.
    ``owners``: each unit's optimizer (None: it has no parameter an optimizer updates); a chunk
    never holds the units of two optimizers."""
    chunks: list[list[int]] = [[]]
    used, owner = 0, None
    for i, size in enumerate(unit_sizes):
        unit_owner = None if owners is None else owners[i]
        if chunks[-1] and (used + size > chunk_size or None not in (owner, unit_owner) and owner != unit_owner):
            chunks.append([])
            used, owner = 0, None
        chunks[-1].append(i)
        used += size
        owner = unit_owner if unit_owner is not None else owner
    return chunks


def search_chunk_size(unit_sizes: list[int], owners: list[int | None] | None = None) -> int:
    """Chunk size (elements) in [max_unit, 2 * max_unit] with the least waste; ties -> smaller."""
    smallest = align(max(unit_sizes))
    total = sum(unit_sizes)
    best, best_waste = smallest, None
    for k in range(_GRID_STEPS + 1):
        size = align(int(smallest * (1 + k / _GRID_STEPS)))
        waste = len(pack(unit_sizes, size, owners)) * size - total
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
    return best


def build_layout(
    model: nn.Module,
    block_path: str,
    n_blocks: int,
    *,
    example_inputs=None,
    chunk_size: int | None = None,
    block_aligned: tuple[int, int] | None = None,
    owners: dict[int, int] | None = None,
) -> ChunkLayout:
    """The layout of ``model``'s parameters in chunks (``chunk_size``: None searches it), its
    transformer blocks the ``n_blocks`` modules of the ``nn.ModuleList`` at ``block_path``
    (``find_blocks``), in the execution order traced on ``example_inputs`` (on the meta device).
    ``block_aligned``: (block, minimum size) of 8-bit moments (the module's docstring).
    ``owners``: parameter id -> the index of the optimizer that updates it, when there are
    several: each chunk holds one optimizer's parameters."""
    traced = trace(model, block_path, example_inputs)
    units = _units(model, block_path, traced.order)
    unit_sizes = [sum(align(p.numel()) for _, p in params) + _alignment_bound(params, block_aligned)
                  for _, params in units]
    if not units:
        raise ValueError(f"{type(model).__name__} has no parameters to manage.")
    unit_owners = None if owners is None else [_owner(unit, params, owners) for unit, params in units]
    if chunk_size is None:
        chunk_size = search_chunk_size(unit_sizes, unit_owners)
    elif chunk_size < max(unit_sizes):
        biggest = units[max(range(len(units)), key=unit_sizes.__getitem__)][0]
        raise ValueError(
            f"chunk_size={chunk_size:,} elements is smaller than the unit {biggest!r} "
            f"({max(unit_sizes):,} elements); a unit never straddles chunks. Use at least "
            f"{max(unit_sizes):,} or leave chunk_size=None for the automatic search."
        )
    chunks = []
    for index, unit_ids in enumerate(pack(unit_sizes, chunk_size, unit_owners)):
        params = [(name, p) for u in unit_ids for name, p in units[u][1]]
        members, offset = [], 0
        for name, p in sorted(params, key=lambda np: np[1].requires_grad):  # stable: frozen first, then trainable
            if block_aligned is not None and p.requires_grad and (
                    p.numel() >= block_aligned[1] or not any(m.trainable for m in members)):
                offset = align(offset, block_aligned[0])
            members.append(ParamSlot(name=name, offset=offset, numel=p.numel(), shape=tuple(p.shape),
                                     trainable=p.requires_grad))
            offset += align(p.numel())
        chunks.append(
            ChunkSpec(index=index, members=tuple(members), units=tuple(units[u][0] for u in unit_ids), capacity=chunk_size)
        )
    layout = ChunkLayout(chunk_size=chunk_size, chunks=tuple(chunks), block_path=block_path, n_blocks=n_blocks,
                         order_source=traced.source)
    return _with_resident_sets(layout, model, traced)


def _owner(unit: str, params, owners: dict[int, int]) -> int | None:
    """The one optimizer that updates the unit's parameters (None: none does)."""
    found = {owners[id(p)] for _, p in params if id(p) in owners}
    if len(found) > 1:
        raise ValueError(
            f"The unit {unit!r} (a transformer block, or a module outside the blocks) has parameters in optimizers "
            f"{sorted(found)}. ProTrain moves a unit's parameters as one chunk and steps each optimizer's chunks "
            "alone, so one unit's parameters belong to one optimizer: give that module's parameters to one of them.")
    return next(iter(found), None)


def unit_chunks(model: nn.Module, layout: ChunkLayout) -> dict[nn.Module, tuple[int, ...]]:
    """The modules the runtime hooks (``unit_names``: each transformer block as a whole, and
    every module outside the blocks that owns parameters) -> the chunks their forward needs."""
    index = layout.param_chunks(model)
    blocks = {id(b) for b in block_modules(model, layout.block_path)}
    modules = dict(model.named_modules())
    units: dict[nn.Module, tuple[int, ...]] = {}
    for module in (modules[name] for name in unit_names(model, layout.block_path)):
        idxs = tuple(sorted({index[id(p)] for p in module.parameters(recurse=id(module) in blocks) if id(p) in index}))
        if idxs:
            units[module] = idxs
    return units


def _with_resident_sets(layout: ChunkLayout, model: nn.Module, traced: Trace) -> ChunkLayout:
    by_module = unit_chunks(model, layout)
    modules = dict(model.named_modules(remove_duplicate=False))
    sets = {}
    for stack in traced.stacks:
        chunks = sorted({c for unit in stack for c in by_module.get(modules[unit], ())})
        if chunks:
            sets[tuple(chunks)] = None
    return replace(layout, resident_sets=tuple(sets))
