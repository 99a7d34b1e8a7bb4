"""Execution-order chunk layout (paper §3.1 and appendix B.1; PatrickStar).

Parameters are packed into equal-size flat chunks in the order the forward pass first uses
them. All parameters of one transformer block form one *unit* and a unit never straddles two
chunks; every module outside the blocks (embeddings, final norm, head) is a unit of its own. A
tied parameter belongs to the unit of its first use. The chunk size is chosen by a grid search
that minimises wasted bytes (chunk capacity not used by parameters).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call

# Parameter offsets inside a chunk are multiples of ALIGN elements (>= 16-byte aligned views
# in every dtype we use), so vectorised kernels see aligned rows.
ALIGN = 16
# Chunk sizes tried by the grid search: max_unit * (1 + k / _GRID_STEPS), k = 0.._GRID_STEPS.
_GRID_STEPS = 128


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a chunk (sizes and offsets in elements)."""

    name: str  # the first name under which model.named_parameters() yields it
    offset: int
    numel: int
    shape: tuple[int, ...]


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


@dataclass(frozen=True)
class ChunkLayout:
    chunk_size: int  # elements per chunk
    chunks: tuple[ChunkSpec, ...]
    block_path: str
    order_source: str  # "traced" (meta-device forward) or "registration"
    n_persist: int = 0  # set by the engine from its plan

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def waste(self) -> int:
        return sum(c.waste for c in self.chunks)

    def is_persistent(self, index: int) -> bool:
        return index < self.n_persist

    def chunk_of(self, name: str) -> int:
        for c in self.chunks:
            if any(m.name == name for m in c.members):
                return c.index
        raise KeyError(name)

    def summary(self, element_size: int = 4) -> str:
        mib = element_size / 2**20
        total = sum(c.numel for c in self.chunks)
        lines = [
            f"ProTrain chunk layout: {self.n_chunks} chunks x {self.chunk_size:,} elements "
            f"({self.chunk_size * mib:.2f} MiB at {element_size} B/element), "
            f"{total:,} parameters, waste {self.waste:,} elements "
            f"({100.0 * self.waste / max(1, self.n_chunks * self.chunk_size):.1f}%), "
            f"{self.n_persist} persistent; order {self.order_source}",
            f"{'chunk':>5}  {'where':<10} {'params':>7} {'elements':>12} {'waste':>10}  units",
        ]
        for c in self.chunks:
            where = "persistent" if self.is_persistent(c.index) else "streamed"
            units = c.units[0] if len(c.units) == 1 else f"{c.units[0]} .. {c.units[-1]} ({len(c.units)} units)"
            lines.append(f"{c.index:>5}  {where:<10} {len(c.members):>7} {c.numel:>12,} {c.waste:>10,}  {units}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _meta_inputs(example_inputs):
    def to_meta(x):
        return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x

    if isinstance(example_inputs, dict):
        return (), {k: to_meta(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(to_meta(v) for v in example_inputs), {}
    return (to_meta(example_inputs),), {}


def _is_hf_lm(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "vocab_size")


def _inner_hf_lm(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The one outermost Hugging Face language model inside ``model``, if there is exactly one."""
    found = [(n, m) for n, m in model.named_modules() if n and _is_hf_lm(m)]
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
    return outer[0] if len(outer) == 1 else None


def execution_order(model: nn.Module, example_inputs=None) -> tuple[list[str], str]:
    """Names of the modules that own parameters directly, in order of first call.

    The order is traced by running the forward pass on the meta device (no memory, no compute):
    ``functional_call`` substitutes meta tensors for every parameter and buffer. Without
    ``example_inputs``, a Hugging Face model gets ``input_ids`` of shape (1, 8) (and a cache). If tracing is
    impossible the module registration order is used, with a warning.
    """
    owners = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if not _is_hf_lm(model):
        inner = _inner_hf_lm(model)
        if inner is not None:
            # A wrapper (a LightningModule, a user's module) around one Hugging Face causal LM:
            # trace the LM with its own default inputs (the wrapper's inputs, a training batch,
            # need not be the LM's); the wrapper's own parameters come after it.
            name, lm = inner
            order, how = execution_order(lm, None)
            called = [f"{name}.{n}" if n else name for n in order]
            return called + [n for n in owners if n not in set(called)], how
    if _is_hf_lm(model):
        # use_cache=True: without a cache, Hugging Face's mask code checks position_ids for packed
        # sequences, a data-dependent test that cannot run on meta tensors. The loss (labels) does
        # not use parameters in an order of its own.
        if example_inputs is None:
            example_inputs = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "use_cache": True}
        elif isinstance(example_inputs, dict):
            example_inputs = {k: v for k, v in example_inputs.items() if k != "labels"}
            example_inputs.setdefault("use_cache", True)
    if example_inputs is None:
        return owners, "registration"

    called: list[str] = []
    seen: set[str] = set()
    modules = dict(model.named_modules())

    def record(name):
        def hook(_module, _args):
            if name not in seen:
                seen.add(name)
                called.append(name)

        return hook

    handles = [modules[n].register_forward_pre_hook(record(n)) for n in owners]
    metas = {
        n: torch.empty_like(t, device="meta")
        for n, t in list(model.named_parameters()) + list(model.named_buffers())
    }
    args, kwargs = _meta_inputs(example_inputs)
    try:
        with torch.no_grad():
            functional_call(model, metas, args, kwargs, tie_weights=True, strict=False)
    except Exception as e:  # noqa: BLE001 - any failure falls back to registration order
        warnings.warn(
            f"Could not trace the execution order of {type(model).__name__} on the meta device "
            f"({type(e).__name__}: {e}); using module registration order for the chunk layout. "
            "Pass example_inputs= to protrain_core.wrap to trace it.",
            stacklevel=3,
        )
        return owners, "registration"
    finally:
        for h in handles:
            h.remove()
    # Modules never called in the trace keep their registration order, after the called ones.
    return called + [n for n in owners if n not in seen], "traced"


def _units(model: nn.Module, block_path: str, n_blocks: int, module_order: list[str]):
    """Units in execution order: (unit name, [(param name, param)])."""
    modules = dict(model.named_modules())
    canonical = {id(p): n for n, p in model.named_parameters()}
    placed: set[int] = set()
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    prefix = block_path + "." if block_path else ""
    for mod_name in module_order:
        unit = mod_name
        if mod_name.startswith(prefix):
            head = mod_name[len(prefix):].split(".", 1)[0]
            if head.isdigit() and int(head) < n_blocks:
                unit = f"{prefix}{head}"
        for _, p in modules[mod_name].named_parameters(recurse=False):
            if id(p) in placed:
                continue
            placed.add(id(p))
            units.setdefault(unit, []).append((canonical[id(p)], p))
    return list(units.items())


def _pack(unit_sizes: list[int], chunk_size: int) -> list[list[int]]:
    chunks: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(unit_sizes):
        if used + size > chunk_size and chunks[-1]:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += size
    return chunks


def search_chunk_size(unit_sizes: list[int]) -> int:
    """Chunk size (elements) in [max_unit, 2 * max_unit] with the least waste; ties -> smaller."""
    smallest = _align(max(unit_sizes))
    total = sum(unit_sizes)
    best, best_waste = smallest, None
    for k in range(_GRID_STEPS + 1):
        size = _align(int(smallest * (1 + k / _GRID_STEPS)))
        waste = len(_pack(unit_sizes, size)) * size - total
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
) -> ChunkLayout:
    module_order, source = execution_order(model, example_inputs)
    units = _units(model, block_path, n_blocks, module_order)
    unit_sizes = [sum(_align(p.numel()) for _, p in params) for _, params in units]
    if not units:
        raise ValueError(f"{type(model).__name__} has no parameters to manage.")
    if chunk_size is None:
        chunk_size = search_chunk_size(unit_sizes)
    elif chunk_size < max(unit_sizes):
        biggest = units[max(range(len(units)), key=unit_sizes.__getitem__)][0]
        raise ValueError(
            f"chunk_size={chunk_size:,} elements is smaller than the unit {biggest!r} "
            f"({max(unit_sizes):,} elements); a unit never straddles chunks. Use at least "
            f"{max(unit_sizes):,} or leave chunk_size=None for the automatic search."
        )
    chunks = []
    for index, unit_ids in enumerate(_pack(unit_sizes, chunk_size)):
        members, offset = [], 0
        for u in unit_ids:
            for name, p in units[u][1]:
                members.append(ParamSlot(name=name, offset=offset, numel=p.numel(), shape=tuple(p.shape)))
                offset += _align(p.numel())
        chunks.append(
            ChunkSpec(index=index, members=tuple(members), units=tuple(units[u][0] for u in unit_ids), capacity=chunk_size)
        )
    return ChunkLayout(chunk_size=chunk_size, chunks=tuple(chunks), block_path=block_path, order_source=source)


def unit_chunks(model: nn.Module, layout: ChunkLayout) -> dict[nn.Module, tuple[int, ...]]:
    """The modules the runtime hooks (each transformer block as a whole, and every module
    outside the blocks that owns parameters) -> the chunks their forward needs."""
    chunk_of = {m.name: spec.index for spec in layout.chunks for m in spec.members}
    index = {id(p): chunk_of[n] for n, p in model.named_parameters() if n in chunk_of}
    blocks = {id(b) for b in model.get_submodule(layout.block_path)}
    units: dict[nn.Module, tuple[int, ...]] = {}

    def visit(module: nn.Module) -> None:
        if id(module) in blocks:
            params = list(module.parameters())
        else:
            params = list(module.parameters(recurse=False))
            for child in module.children():
                visit(child)
        idxs = tuple(sorted({index[id(p)] for p in params if id(p) in index}))
        if idxs:
            units[module] = idxs

    visit(model)
    return units


def with_persistence(layout: ChunkLayout, n_persist: int) -> ChunkLayout:
    return replace(layout, n_persist=n_persist)
