"""The runtime's hooks, registered with PyTorch's public hook APIs: thin, named after the phase,
and forwarding to the scheduler (see [Note: when a chunk is needed] in scheduler.py).

[Note: a unit's backward]
Every forward call of a hooked unit is a ``UnitCall`` that knows the call it runs inside
(``parent``: the enclosing unit call in forward, if any). Its backward *begins* when the
gradient of one of its outputs is complete -- a tensor hook on each output, not on an input the
unit returns unchanged, whose gradient does not flow through it (T5 passes its position bias
through every block); an input the unit changed in place and returns is an output of its own. The runtime keeps the chunks of the *active chain* on the device: the
call whose backward began last and its ancestors. A call that begins while its ancestor is
active extends the chain (an outer module's own work before the inner call in forward comes
after the inner call's backward); an ancestor of the active call that begins later (an outer
module returning the inner module's output: both hooks fire on one tensor, the inner first)
changes nothing; any other call replaces the chain. That a replaced call is finished follows
from the autograd engine's order: a node becomes ready only when every gradient it needs is
complete, and among ready nodes the engine runs the one created last in forward first -- so
the backward nodes of the units after the new call in forward, which are ready by then, have
run. No node is added to the autograd graph (an identity inserted between a unit and its
inputs, as FSDP2 does, would regroup the sums of gradient contributions and change the
results in the last bit). Calls that overlap in backward are the ones nested in forward,
which is what ``PlanLimits`` counts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.scheduler import Scheduler
from protrain_core.utils import iter_tensors


class UnitCall:
    """One forward call of a hooked unit, until its backward is over."""

    __slots__ = ("idxs", "parent", "began", "inputs")

    def __init__(self, idxs: tuple[int, ...], parent: UnitCall | None) -> None:
        self.idxs = idxs
        self.parent = parent  # the unit call this one runs inside, in forward
        self.began = False
        self.inputs: dict[int, int] | None = None  # while it runs: id -> version of its input tensors

    def ancestors(self):
        call = self.parent
        while call is not None:
            yield call
            call = call.parent


class RuntimeHooks:
    def __init__(self, scheduler: Scheduler, units: dict[nn.Module, tuple[int, ...]], chunks: list[Chunk]) -> None:
        """``units``: hooked modules -> the chunks their forward needs. A unit's hooks act while
        one of those chunks is streamed (a re-plan between steps changes which are), so the
        hooks of a call are the same from its forward to the end of its backward."""
        self.scheduler = scheduler
        self.chunks = chunks
        self.handles = []
        self._running: list[UnitCall] = []  # the unit calls whose forward is running, outermost first
        self._units = {id(m) for m in units}  # (a deep copy of the model shares the hooks: ignored)
        for module, idxs in units.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(idxs), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward(idxs), with_kwargs=True,
                                                             always_call=True))
        seen = set()
        for chunk in chunks:
            for i, p in enumerate(chunk.params):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate_grad(chunk, i)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _streams(self, idxs: tuple[int, ...]) -> bool:
        return any(not self.chunks[i].persistent for i in idxs)

    def _pre_forward(self, idxs):
        def hook(module, args, kwargs):
            if id(module) not in self._units or not self._streams(idxs):
                return
            call = UnitCall(idxs, self._running[-1] if self._running else None)
            if torch.is_grad_enabled():  # (inference tensors have no version counter)
                call.inputs = {id(t): t._version for t in iter_tensors((args, kwargs)) if not t.is_inference()}
            self._running.append(call)  # before anything that can raise: the post-hook pops it
            self.scheduler.pre_forward(idxs)

        return hook

    def _post_forward(self, idxs):
        def hook(module, _args, _kwargs, output):
            if id(module) not in self._units or not self._streams(idxs):
                return
            call = self._running.pop()
            self.scheduler.post_forward(idxs)
            if not torch.is_grad_enabled():
                return
            for t in iter_tensors(output):
                if t.requires_grad and call.inputs.get(id(t), -1) != t._version:  # not an input passed through
                    t.register_hook(self._pre_backward(call))
            call.inputs = None

        return hook

    def _pre_backward(self, call: UnitCall):
        def hook(_grad):
            self.scheduler.begin_unit_backward(call)

        return hook

    def _post_accumulate_grad(self, chunk: Chunk, i: int):
        def hook(p: Tensor) -> None:
            self.scheduler.on_grad(chunk, i, p)

        return hook
