"""The runtime's hooks, registered with PyTorch's public hook APIs: thin, named after the phase,
and forwarding to the scheduler (see [Note: when a chunk is needed] in scheduler.py).

[Note: a unit's backward]
Every forward call of a hooked unit is a ``UnitCall`` that knows the call it runs inside
(``parent``). Its backward *begins* when the gradient of one of its outputs is complete (a
tensor hook on each output; not on an input returned unchanged, whose gradient does not flow
through it). The runtime keeps the chunks of the *active chain* on the device: the call whose
backward began last and its ancestors. A call that begins while its ancestor is active extends
the chain; an ancestor of the active call that begins later changes nothing; any other call
replaces the chain, which is then finished: autograd runs a node only when every gradient it
needs is complete, and among ready nodes the one created last in forward first. No node is
added to the graph (an identity between a unit and its inputs, as FSDP2 inserts, would regroup
the sums of gradient contributions and change the last bit). Calls that overlap in backward
are the ones nested in forward, which is what ``PlanLimits`` counts.

[Note: parameters used outside their units]
User code uses parameters where no unit's hooks run (a LightningModule's own parameter, a
penalty over ``model.parameters()``), while a streamed chunk's parameters point at a placeholder
(NaN: [Note: a pass's placeholders] in chunk.py) or at a host copy the CPU worker may be
rewriting. While the engine is open every managed parameter's class is ``ManagedParameter``,
whose ``__torch_function__`` sees every torch function given one. Functions that read no values
(shapes, hooks; ``.grad``: [Note: gradients read through p.grad] in gradients.py) and uses the
running unit or the backward's active chain covers go straight through. A read whose result
cannot join an autograd graph (``detach``, ``.data``, ``item``, no gradients) waits for the
chunk's copy or update in flight and reads the values where they are, unless at a placeholder.
Any other use is a unit call of its own (``RuntimeHooks.use_outside_units``): the chunks are
resident and pinned for the call, and its outputs begin its backward as a unit's do. Autograd
sums a parameter's gradients from all its uses before its post-accumulate-grad hook, so the
chunk receives plain PyTorch's gradient bit for bit. A parameter the user rebound
(``p.data = t``) is the user's tensor until adopted. With several processes the chunk is whole
on no rank outside its units, so such a use is refused with the fix. What a use returns is safe
to keep (``_kept``); a write into what ``p.data`` (or a copy's ``p.detach()``) returned is taken
into the chunk at the next forward or state read (``Chunk.hand_out``).
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._C import DisableTorchFunctionSubclass

from protrain_core.phase import TrainingPhase
from protrain_core.runtime.chunk import Chunk, ChunkState
from protrain_core.runtime.parking import offloaded_message
from protrain_core.runtime.scheduler import Scheduler
from protrain_core.utils import iter_tensors


@dataclass(eq=False)
class UnitCall:
    """One forward call of a hooked unit, until its backward is over."""

    idxs: tuple[int, ...]
    parent: UnitCall | None  # the unit call this one runs inside, in forward
    began: int = 0  # the backward pass (Scheduler.passes) its backward began in; 0: none yet
    inputs: dict[int, int] | None = None  # while it runs: id -> version of its input tensors

    def ancestors(self):
        call = self.parent
        while call is not None:
            yield call
            call = call.parent


class RuntimeHooks:
    def __init__(self, scheduler: Scheduler, units: dict[nn.Module, tuple[int, ...]], *,
                 onloaded: Callable[[], bool], grad_of: Callable[[Chunk, int], Tensor | None],
                 clear_grads: Callable[[list[tuple[Chunk, int]]], None], on_backward: Callable[[], None]) -> None:
        """``units``: hooked modules -> the chunks their forward needs (its hooks act while one
        of those is streamed); ``onloaded()``: False while the states are offloaded;
        ``grad_of(chunk, i)``: what ``p.grad`` reads (None: the parameter's own);
        ``clear_grads([(chunk, i)])``: ``p.grad = None``; ``on_backward()``: every backward hook's
        first act (backward.py)."""
        self.scheduler, self.chunks = scheduler, scheduler.chunks
        self._onloaded = onloaded
        self.grad_of, self.clear_grads, self._on_backward = grad_of, clear_grads, on_backward
        self.handles = []
        self._running: list[UnitCall] = []  # the unit calls whose forward is running, outermost first
        # Unit calls whose outputs joined an autograd graph; gone with the graph (its tensors' hooks hold them).
        self._graphs: weakref.WeakSet[UnitCall] = weakref.WeakSet()
        self._units = {id(m) for m in units}  # (a deep copy of the model shares the hooks: ignored)
        self._log: list | None = None  # the chunk calls of the forwards being recorded (``recording``)
        for module, idxs in units.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(idxs), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward(idxs), with_kwargs=True,
                                                             always_call=True))
        self._managed = []  # the parameters made ManagedParameter ([Note: parameters used outside their units])
        for c, chunk in enumerate(self.chunks):  # (a tied parameter is one member of one chunk)
            for i, p in enumerate(chunk.params):
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate_grad(c, i)))
                if type(p) is nn.Parameter:
                    p.__class__ = ManagedParameter
                    p.protrain_use = (self, chunk, i)
                    self._managed.append(p)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p in self._managed:
            del p.protrain_use
            p.__class__ = nn.Parameter
        self._managed.clear()
        self._onloaded = self.grad_of = self.clear_grads = self._on_backward = None  # (no cycle keeps the engine)

    @contextlib.contextmanager
    def recording(self):
        """The chunk calls of the units' forwards run inside, into the list it gives (``replay``)."""
        self._log = log = []
        try:
            yield log
        finally:
            self._log = None

    def replay(self, log: list) -> None:
        """The chunk calls of recorded forwards again, running no module: with several processes, a
        rank whose batches ran out takes part in the chunks' all-gathers of another rank's forward
        of the same units, as torch's ``Join`` shadows DDP's collectives (the Trainer's predict:
        [Note: uneven predict batches] in lightning_protrain/strategy.py)."""
        for idxs, entering in log:
            self.scheduler.pre_forward(idxs) if entering else self.scheduler.post_forward(idxs)

    def backward_awaited(self) -> bool:
        """A forward that streamed chunks left an autograd graph whose backward has not begun (a
        GAN's generated batch): chunks must stay where it found them: no re-plan, no offload."""
        return any(not call.began for call in self._graphs)

    def covers(self, chunk: Chunk) -> bool:
        """A use of ``chunk``'s parameters needs nothing of its own: persistent, pinned, or in the active chain."""
        return chunk.persistent or chunk.pins > 0 or (chunk.index in self.scheduler.current
                                                      and chunk.state in (ChunkState.RESIDENT, ChunkState.OFFLOADING))

    def use_outside_units(self, uses: list[tuple[Chunk, int]], func, args, kwargs, *, graph: bool):
        """``func(*args, **kwargs)`` uses members of chunks outside their units ([Note: parameters
        used outside their units]); ``graph``: its result may join an autograd graph."""
        scheduler, chunks = self.scheduler, list({id(c): c for c, _ in uses}.values())
        idxs = tuple(sorted(c.index for c in chunks))
        with DisableTorchFunctionSubclass():
            if not self._onloaded():
                return func(*args, **kwargs)
            if not graph:  # a read: where the values are, once no copy or update writes them
                for c in chunks:
                    scheduler.await_chunk(c)
                if all(c.holds_value(i) for c, i in uses):
                    return _kept(func(*args, **kwargs), func, uses, args)
            if not scheduler.sharding.whole:
                raise RuntimeError(
                    f"ProTrain with {scheduler.sharding.world} processes: a parameter of an offloaded chunk "
                    f"({uses[0][0].spec.members[uses[0][1]].name}{' and others' if len(uses) > 1 else ''}) was used "
                    "outside the module it belongs to. Its chunk is sharded over the ranks and whole on none between "
                    "its module's uses. Use it inside a module's forward (e.g. move a penalty or a logit scale into "
                    "the model), keep its chunk on the device (Plan.persistent_chunks), or read the weights with "
                    "engine.state_dict().")
            if scheduler.phase.phase in (TrainingPhase.BACKWARD, TrainingPhase.RECOMPUTE):
                scheduler.acquire(idxs, pin=False)  # e.g. a tensor hook reading a weight
                return _kept(func(*args, **kwargs), func, uses, args)
            call = UnitCall(idxs, self._running[-1] if self._running else None)
            scheduler.pre_forward(idxs, unit=False)
            try:
                out = _kept(func(*args, **kwargs), func, uses, args)
            finally:
                scheduler.post_forward(idxs)
        if graph:
            self._await_backward(call, [t for t in iter_tensors(out) if t.requires_grad])
        return out

    def _streams(self, idxs: tuple[int, ...]) -> bool:
        return any(not self.chunks[i].persistent for i in idxs)

    def _pre_forward(self, idxs):
        def hook(module, args, kwargs):
            if id(module) not in self._units:
                return
            refuse_compiled()
            if not self._onloaded():
                raise RuntimeError(offloaded_message(f"{type(module).__name__}'s forward"))
            if not self._streams(idxs):
                return
            call = UnitCall(idxs, self._running[-1] if self._running else None)
            if torch.is_grad_enabled():  # (inference tensors have no version counter)
                call.inputs = {id(t): t._version for t in iter_tensors((args, kwargs)) if not t.is_inference()}
            self._running.append(call)  # before anything that can raise: the post-hook pops it
            self.scheduler.pre_forward(idxs)
            if self._log is not None:
                self._log.append((idxs, True))

        return hook

    def _post_forward(self, idxs):
        def hook(module, _args, _kwargs, output):
            if id(module) not in self._units or not self._streams(idxs):
                return
            if not self._running or self._running[-1].idxs is not idxs:
                return  # the pre-hook refused the call before it began
            call = self._running.pop()
            self.scheduler.post_forward(idxs)
            if self._log is not None:
                self._log.append((idxs, False))
            if not torch.is_grad_enabled():
                return
            self._await_backward(call, [t for t in iter_tensors(output)  # (not an input passed through)
                                        if t.requires_grad and call.inputs.get(id(t), -1) != t._version])
            call.inputs = None

        return hook

    def _await_backward(self, call: UnitCall, outputs: list[Tensor]) -> None:
        """``call``'s backward begins when the gradient of one of ``outputs`` is complete."""

        def hook(_grad):
            self.backward_hook()
            self.scheduler.begin_unit_backward(call)

        for t in outputs:
            t.register_hook(hook)
            self._graphs.add(call)

    def backward_hook(self) -> None:
        if self._on_backward is not None:
            self._on_backward()

    def _post_accumulate_grad(self, c: int, i: int):
        # Only a weak reference: autograd keeps a tensor's hooks where the garbage collector cannot
        # see them (a strong one would make an unclosed engine and its model a cycle never freed).
        hooks = weakref.ref(self)

        def hook(p: Tensor) -> None:
            alive = hooks()
            if alive is not None:
                alive.backward_hook()
                alive.scheduler.on_grad(alive.chunks[c], i, p)

        return hook


class _Use(enum.Enum):
    """What a torch function given a managed parameter does with it."""

    NO_VALUES = "no values"  # metadata, hooks, autograd flags: goes straight through
    GRAD = "grad"  # the ``.grad`` getter ([Note: gradients read through p.grad])
    CLEAR_GRAD = "clear grad"  # the ``.grad`` setter (``p.grad = None``: optimizer.zero_grad)
    READ = "read"  # reads values; its result joins no autograd graph
    DATA = "data"  # the ``.data`` getter: a read that may be written in place later (``Chunk.hand_out``)
    USE = "use"  # reads values, and its result may join an autograd graph


# Tensor properties whose getter returns the tensor's values (every other property reads none).
_VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Tensor methods that read no values (metadata, hooks, autograd flags).
_NO_VALUES = frozenset({
    "size", "dim", "numel", "nelement", "ndimension", "stride", "storage_offset", "data_ptr", "untyped_storage",
    "element_size", "is_contiguous", "is_floating_point", "is_complex", "is_pinned", "get_device", "is_inference",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "_is_view", "is_shared",
    "has_names", "__len__", "__hash__", "__reduce_ex__", "__setstate__",
})
# Functions whose result is never part of an autograd graph (conversions, comparisons).
_NO_GRAPH = frozenset({
    "detach", "item", "tolist", "numpy", "__repr__", "__format__", "__str__", "__bool__", "equal", "allclose",
    "isclose", "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "isnan", "isinf", "isfinite", "argmax", "argmin", "count_nonzero",
})
# In-place operators besides the methods named with a trailing underscore (``p.clamp_``).
_IN_PLACE_OPERATORS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
})
_USES: dict = {}  # torch function -> its _Use, classified once (the set of functions a model calls is small)


def _use_of(func) -> _Use:
    try:
        if func not in _USES:
            _USES[func] = _classify(func)
        return _USES[func]
    except TypeError:  # (an unhashable callable)
        return _classify(func)


def _classify(func) -> _Use:
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__", "__delete__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        if name == "__set__" and prop == "grad":
            return _Use.CLEAR_GRAD
        if name != "__get__" or prop not in _VALUE_PROPERTIES | {"grad"}:
            return _Use.NO_VALUES
        return _Use.GRAD if prop == "grad" else _Use.DATA if prop == "data" else _Use.USE
    if name in _NO_VALUES:
        return _Use.NO_VALUES
    return _Use.READ if name in _NO_GRAPH else _Use.USE


# The plain parameter's __torch_function__ (it runs torch functions with subclasses disabled).
_plain = nn.Parameter.__torch_function__


def refuse_pickling(obj, protocol) -> None:
    """``__reduce_ex__`` of what an open engine holds (its parameters, the engine)."""
    raise TypeError(
        "A model wrapped by ProTrain cannot be pickled whole (torch.save(model), or its parameters): its "
        "parameters live in the engine's chunks, with the engine's threads and hooks. Save the weights: "
        "torch.save(model.state_dict(), path) (or engine.state_dict(), engine.save_pretrained); or call "
        "engine.close() first, which gives the model back with plain parameters.")


class ManagedParameter(nn.Parameter):
    """A parameter held in a ProTrain chunk while its engine is open ([Note: parameters used outside
    their units]): the engine sets this class on the model's own parameters (``data``,
    ``requires_grad``: as ``nn.Parameter``'s); nothing else builds one."""

    protrain_use: tuple[RuntimeHooks, Chunk, int]

    __reduce_ex__ = refuse_pickling

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        use = _use_of(func)
        if use is _Use.GRAD:
            owner = getattr(args[0], "protrain_use", None)
            grad = None if owner is None else owner[0].grad_of(owner[1], owner[2])
            if grad is not None:
                return grad
        elif use is _Use.CLEAR_GRAD:
            owner = getattr(args[0], "protrain_use", None)
            if owner is not None and len(args) > 1 and args[1] is None:
                owner[0].clear_grads([owner[1:]])
        elif use is not _Use.NO_VALUES:
            hooks, uses = None, []
            for t in _top_level(args, kwargs or {}):
                owner = getattr(t, "protrain_use", None) if type(t) is ManagedParameter else None
                if owner is not None and not owner[0].covers(owner[1]) and owner[1].points(owner[2]):
                    hooks = owner[0]
                    uses.append(owner[1:])
            if uses:
                graph = use is _Use.USE and torch.is_grad_enabled()
                return hooks.use_outside_units(uses, func, args, kwargs or {}, graph=graph)
            owner = getattr(args[0], "protrain_use", None) if use is _Use.DATA else None
            if owner is not None and owner[1].points(owner[2]):  # p.data of a covered chunk's parameter
                return owner[1].hand_out(owner[2], _plain(func, types, args, kwargs or {}))
        return _plain(func, types, args, kwargs or {})

    def __deepcopy__(self, memo):
        """A plain ``nn.Parameter`` with the value of the moment (an EMA's copy of the model);
        sharded, the value where it is (the module's state-dict hook refuses such a copy)."""
        if id(self) not in memo:
            sharded = not self.protrain_use[0].scheduler.sharding.whole
            with DisableTorchFunctionSubclass() if sharded else contextlib.nullcontext():
                value = self.data.clone(memory_format=torch.preserve_format)  # (data: a read)
            memo[id(self)] = nn.Parameter(value, self.requires_grad)
        return memo[id(self)]

    def __repr__(self, **kwargs) -> str:
        return repr(nn.Parameter(self.detach(), self.requires_grad))  # (not ManagedParameter(...))


def _kept(out, func, uses: list[tuple[Chunk, int]], args):
    """What a use outside the units returns, made safe to keep: an in-place write (``p.clamp_``)
    goes into the chunk (``Chunk.adopt``); a result that views a streamed chunk's device copy
    (``p.view(-1)``) is a copy of its own, since that memory goes with the next release."""
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.startswith("__") or name in _IN_PLACE_OPERATORS:
        for c, i in uses:
            c.adopt([i])
        return out
    homes = {c.storage.device_copy.untyped_storage().data_ptr() for c, _ in uses if c.device_resident} - {0}

    def own(t):
        fetched = isinstance(t, Tensor) and not any(t is a for a in args) and t.untyped_storage().data_ptr() in homes
        return t.clone() if fetched else t

    data = _use_of(func) is _Use.DATA
    if (data or name == "detach") and len(uses) == 1:  # p.data, p.detach(): written in place, they count
        (c, i), kept = uses[0], own(out)
        return c.hand_out(i, kept) if data or kept is not out else kept
    return type(out)(own(t) for t in out) if isinstance(out, (tuple, list)) else own(out)


def _top_level(args, kwargs):
    """The tensors among a torch function's arguments, and in its list or tuple arguments
    (``torch.cat``, the ``_foreach`` functions)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, Tensor))


def refuse_compiled() -> None:
    """Refuses ``torch.compile`` of the wrapped model or of one of its modules *after* ``wrap``
    ([Note: compiled units] in compiled.py): a compiled graph bakes in what a streamed chunk's
    parameters point at between fetches. Under tracing, ``_compiled_call`` (disabled for the
    compiler) is a graph break that runs eagerly, so the user gets its error."""
    if torch.compiler.is_compiling():
        torch.compiler.disable(_compiled_call)()  # (made here: importing dynamo costs every process a second)


def _compiled_call() -> None:
    raise RuntimeError(
        "torch.compile of a ProTrain-wrapped model, or of one of its modules, after wrap is not supported: the "
        "engine moves the parameters between the device and the host around every block, which a graph of the "
        "whole model does not see. Compile before wrap (the engine then compiles each block and the stem and "
        "head on their own), or set ProTrainConfig(compile=True). Under Fabric, which compiles the module again "
        "after setup, pass the model uncompiled and set the strategy's config compile=True. With compile set, a "
        "module that owns parameters outside the blocks and is called inside one cannot be compiled into it: "
        "register it inside the block, or set compile=False."
    )
