"""``engine.states``: reading and writing one engine's model, optimizer and loss-scaler states
(checkpoint.py and export.py are built on it). Every read waits for the updates in flight first,
and a sharded read gathers chunk by chunk. The module's own ``state_dict()`` is watched here too,
and parameters the user rebound (``p.data = t``) are written back into their chunks.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from protrain_core.phase import StepState, TrainingPhase
from protrain_core.precision import LossScaler, Precision
from protrain_core.runtime.chunk import Chunk
from protrain_core.runtime.optim import ChunkOptimizer
from protrain_core.runtime.scheduler import Scheduler, device_bytes_bound
from protrain_core.utils import plain_parameters


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, as ``nn.Module.load_state_dict`` does."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateAccess:
    """The states of one engine's model, optimizer and loss scaler, in torch's formats."""

    def __init__(self, module: nn.Module, chunks: list[Chunk], optim: ChunkOptimizer, scaler: LossScaler | None,
                 scheduler: Scheduler, state: StepState, *, precision: Precision, rank: int, world_size: int) -> None:
        self._module, self._chunks, self._optim, self._scaler = module, chunks, optim, scaler
        self._scheduler, self._state, self._precision = scheduler, state, precision
        self._rank, self._world_size = rank, world_size
        self._slot_of: dict[int, tuple[Chunk, int]] = {id(p): (c, i) for c in chunks for i, p in enumerate(c.params)}
        # One process: else streamed chunks' parameters point at NaN at rest (``Chunk.point_at_rest``).
        self._whole = all(c.storage.fmt.whole for c in chunks)
        self._reading = False  # model() is reading the module's own entries
        self._managed = {id(m) for m in module.modules()}
        # model.state_dict() (save_pretrained, torch.save) reads the parameters: wait for their updates.
        # Every module's: a LightningModule's self.model.state_dict() does not run the root's hooks.
        self._hooks = [m.register_state_dict_pre_hook(_ModuleHook(self, m)) for m in module.modules()]

        def before_load(m, *args) -> None:  # model.load_state_dict(): not between a backward and its step
            if id(m) in self._managed:  # (not a deep copy's)
                self.check_between_steps("load")

        self._hooks += [m.register_load_state_dict_pre_hook(before_load) for m in module.modules()]
        # Quantised frozen members have no value at rest ([Note: quantised frozen chunks]).
        self._quantised = [c for c in chunks if c.storage.frozen is not None]
        self._depth = 0  # state_dict() calls of managed modules in progress (they nest)
        self._formats = self._trainables()  # what the chunks' formats were built for
        if self._quantised:
            def after(*args) -> None:  # (torch marks the hook it is given: not a bound method)
                self._after_module_state_dict(*args)

            self._hooks += [m.register_state_dict_post_hook(after) for m in module.modules()]

    def __deepcopy__(self, memo) -> StateAccess:
        """Not a value: the engine's (``_ModuleHook``, ``Engine.__deepcopy__``)."""
        memo[id(self)] = self
        return self

    # ----- the model ------------------------------------------------------------------------
    def model(self, *, rank0_only: bool = True) -> dict[str, Tensor]:
        """Master weights (frozen ones in the master dtype too) and buffers under the model's own
        names, on the CPU. Sharded, every rank calls it (the chunks are gathered one at a time),
        and (``rank0_only``) only rank 0 keeps the result. Tied weights are one tensor."""
        self.check_between_steps()
        self.adopt_rebound()
        self._scheduler.wait_all()
        keep = not rank0_only or self._rank == 0
        out, seen = {}, {}
        gathered: tuple[Chunk | None, list] = (None, [])  # the last chunk's whole values
        for key, t in self.module_tensors().items():
            if id(t) not in seen:  # (on every rank: the gathers must be the same everywhere)
                slot = self._slot_of.get(id(t))
                if slot is not None and gathered[0] is not slot[0]:
                    gathered = slot[0], slot[0].values.gathered_values()
                # a chunk's member in the master dtype (a frozen member's compute copy too)
                value, dtype = (t, None) if slot is None else (gathered[1][slot[1]], self._precision.master_dtype)
                seen[id(t)] = value.detach().to("cpu", dtype=dtype, copy=True) if keep else None
            if keep:
                out[key] = seen[id(t)]
        return out

    def check_between_steps(self, verb: str = "read") -> None:
        """Refuse a state read (or load) where a backward updated offloaded chunks and its step has
        not run: the weights and moments would mix two steps (plain PyTorch's are the last step's)."""
        updated = [c.index for c in self._chunks if c.applied]
        if updated and self._state.phase is not TrainingPhase.STEP:
            what = "a checkpoint, state_dict()" if verb == "read" else "load_state_dict()"
            raise RuntimeError(
                f"A state {verb} ({what}) after or inside a backward whose step has not run: ProTrain already updated "
                f"offloaded chunks {updated[:8]} with this step's gradients during backward (the CPU update overlaps "
                f"backward), and the others wait for the step, so the state would mix two steps. {verb.title()} it "
                "after engine.step() (Fabric: optimizer.step()), or, after a backward that raised, after step() or "
                f"zero_grad(); to {verb} between backward and step, call engine.clipping.expect_late() before training "
                "(every update then waits for step()).")

    def load_model(self, state_dict: dict[str, Tensor], strict: bool = True) -> IncompatibleKeys:
        """Write ``state_dict`` (the model's own names) into the chunks and buffers, as
        ``nn.Module.load_state_dict`` would: nothing changes where it raises ``RuntimeError``
        (keys, with ``strict``; shapes), and it returns the missing and unexpected keys."""
        self._state.check_open()
        self.check_between_steps("load")
        expected = self.module_tensors()
        keys = IncompatibleKeys(missing_keys=[k for k in expected if k not in state_dict],
                                unexpected_keys=[k for k in state_dict if k not in expected])
        errors = [f"size mismatch for {k}: copying a param with shape {v.shape} from checkpoint, the shape in "
                  f"current model is {expected[k].shape}." for k, v in state_dict.items()
                  if k in expected and v.shape != expected[k].shape]
        for what, names in (("Unexpected", keys.unexpected_keys), ("Missing", keys.missing_keys)):
            if strict and names:
                errors.insert(0, f"{what} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in names) + ". ")
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self._module).__name__}:\n\t" +
                               "\n\t".join(errors))
        self._scheduler.release_all()  # (it waits for the updates in flight first)
        with torch.no_grad():
            for key, value in state_dict.items():
                t = expected.get(key)  # (None: an unexpected key, not strict)
                slot = self._slot_of.get(id(t))
                if slot is not None:
                    slot[0].values.set_member(slot[1], value)
                elif t is not None:
                    t.copy_(value)
        return keys

    def module_tensors(self) -> dict[str, Tensor]:
        """The module's own state-dict entries (parameters and buffers as they are: keep_vars)."""
        self._reading = True
        try:
            return self._module.state_dict(keep_vars=True)
        finally:
            self._reading = False

    @plain_parameters
    def _trainables(self) -> tuple:
        """Which parameters train (``requires_grad``) and which the optimizers update, by group."""
        params = [p for c in self._chunks for p in c.params]
        groups = [[id(p) for p in g["params"]] for o in self._optim.optimizers for g in o.param_groups]
        return tuple(p.requires_grad for p in params), groups

    def trainables_changed(self) -> str | None:
        """What changed since the chunks' formats were built (a parameter's ``requires_grad``, the
        optimizer's param groups); None: nothing. A parameter the optimizer updates that stops
        requiring gradients (``toggle_optimizer``) keeps its states: no change."""
        (trainable, groups), (now, now_groups) = self._formats, self._trainables()
        if now != trainable:
            updated = {i for g in groups for i in g}
            params = [(c.spec.members[i].name, p) for c in self._chunks for i, p in enumerate(c.params)]
            changed = [n for (n, p), a, b in zip(params, trainable, now) if a != b and not (a and id(p) in updated)]
            if changed:
                return (f"requires_grad of {changed[0]}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} "
                        "changed")
        if now_groups != groups:
            return "the optimizer's param groups changed"
        return None

    def slot_of(self, p: nn.Parameter) -> tuple[Chunk, int]:
        """The chunk holding parameter ``p``, and its member index there."""
        return self._slot_of[id(p)]

    def adopt_rebound(self) -> None:
        """Parameters whose ``.data`` the user rebound between steps (``p.data = tensor``), or
        wrote in place, keep the new values: written into their chunks before the next forward
        and every state dict."""
        if self._state.closed or not self._state.idle:
            return
        rebound = [c for c in self._chunks if c.handed or c.rebound()]
        if not rebound:
            return
        self._scheduler.wait_all()
        for c in rebound:
            c.adopt_rebound()

    # ----- the optimizer and the loss scaler -------------------------------------------------
    def optimizer(self, *, rank0_only: bool = True, of: torch.optim.Optimizer | None = None) -> dict:
        """The optimizer state in ``torch.optim.AdamW.state_dict()`` format, on the CPU (sharded: on
        rank 0 only unless not ``rank0_only``); ``of``: one of several optimizers (None: all)."""
        self.check_between_steps()
        self._scheduler.wait_all()
        return self._optim.state_dict(self._slot_of, keep=not rank0_only or self._rank == 0, optimizer=of)

    def load_optimizer(self, state_dict: dict, *, of: torch.optim.Optimizer | None = None) -> None:
        """Load an ``AdamW.state_dict()`` (of the unwrapped optimizer, or of ``optimizer()``);
        ``of``: the optimizer it belongs to, with several (see ``optimizer``)."""
        self._state.check_open()
        self.check_between_steps("load")
        self._scheduler.wait_all()
        self._optim.load_state_dict(state_dict, self._slot_of, optimizer=of)

    @property
    def chunk_optimizer(self) -> ChunkOptimizer:
        """Where the chunks' optimizer states are named and kept (the sharded checkpoint's view)."""
        return self._optim

    def scaler(self) -> dict | None:
        """The fp16 loss scaler's state (None: this precision scales no loss)."""
        return None if self._scaler is None else self._scaler.state_dict()

    def load_scaler(self, state_dict: dict) -> None:
        if self._scaler is None:
            raise ValueError("This engine does not use loss scaling (precision is not '16-mixed').")
        self._scaler.load_state_dict(state_dict)

    # ----- life --------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    def before_state_dict(self, module: nn.Module, *_) -> None:
        """``state_dict()`` of the model or of any module in it reads the parameters: wait for
        their updates. Sharded, an offloaded chunk's parameters are whole on no rank: refused."""
        if id(module) not in self._managed:  # a deep copy's module: its own tensors
            return
        if not self._reading and self._holds_unwhole(module, recurse=True):
            name = "model" if module is self._module else f"{type(module).__name__} (a module of the wrapped model)"
            raise RuntimeError(
                f"state_dict() of the {name}, sharded over {self._world_size} processes: the parameters of "
                "offloaded chunks are not whole on any rank, so its values would be wrong. Call "
                "engine.state_dict() (gathered chunk by chunk to rank 0; under Lightning "
                "trainer.strategy.engine.state_dict()) or engine.save_pretrained(directory) on every rank instead."
            )
        if not self._reading:
            self.check_between_steps()
            self.adopt_rebound()
        self._scheduler.wait_all()
        if self._quantised and not self._reading:
            if self._depth == 0:  # the chunks of this module's parameters
                for c in {self._slot_of[id(p)][0] for p in module.parameters() if id(p) in self._slot_of}:
                    c.materialise()
            self._depth += 1

    def check_copy(self, module: nn.Module) -> None:
        """``copy.deepcopy`` of a module holding the parameters of offloaded sharded chunks (NaN
        between steps): refused, as its ``state_dict()`` is."""
        if id(module) in self._managed and self._holds_unwhole(module, recurse=False):
            name = next(n for n, m in self._module.named_modules() if m is module)
            what = "the wrapped model" if module is self._module else f"the wrapped model's {name!r} ({type(module).__name__})"
            raise RuntimeError(
                f"copy.deepcopy reached {what}, which holds parameters of offloaded chunks sharded over "
                f"{self._world_size} processes: they are not whole on any rank, so the copy's values would be wrong. "
                "Keep engine.state_dict(rank0_only=False) instead (the weights, gathered chunk by chunk; under "
                "Lightning trainer.strategy.engine), or train with a plan that keeps every chunk on the device."
            )

    def _holds_unwhole(self, module: nn.Module, *, recurse: bool) -> bool:
        """Sharded, ``module`` (``recurse``: or a submodule) holds an offloaded chunk's parameter."""
        return not self._whole and any(not self._slot_of[id(p)][0].persistent
                                       for p in module.parameters(recurse=recurse) if id(p) in self._slot_of)

    def _after_module_state_dict(self, module: nn.Module, *_) -> None:
        """The outermost ``state_dict()`` is over: the quantised members go back to rest."""
        if id(module) not in self._managed or self._reading or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            for c in self._quantised:
                if not c.persistent and not c.device_resident:
                    c.point_at_rest()


class _ModuleHook:
    """The state-dict hook of one managed ``module`` (``access.before_state_dict``). A deep copy of
    the model copies every module's hooks: this one stays itself (a bound method would copy every
    chunk of the engine), and refuses the copy of a module whose values no rank holds."""

    def __init__(self, access: StateAccess, module: nn.Module) -> None:
        self._access, self._module = access, weakref.ref(module)

    def __call__(self, module: nn.Module, *args) -> None:
        self._access.before_state_dict(module, *args)

    def __deepcopy__(self, memo) -> _ModuleHook:
        module = self._module()
        if module is not None:
            self._access.check_copy(module)
        memo[id(self)] = self
        return self


class StateMemory:
    """``engine.memory``: where one engine's model states are now, in bytes."""

    def __init__(self, chunks: list[Chunk], scheduler: Scheduler) -> None:
        self._chunks, self._scheduler = chunks, scheduler

    def device_bytes(self) -> int:
        """Device memory held by model states right now (persistent chunks + chunk buffers)."""
        return sum(c.storage.device_bytes() for c in self._chunks)

    def device_bound(self) -> int:
        """What the plan lets them hold at most: the persistent chunks and ``n_buffer`` buffers."""
        return device_bytes_bound(self._scheduler)

    def host_bytes(self) -> int:
        """Host memory of the streamed chunks' model states (their exact-size buffers)."""
        return sum(c.storage.host_bytes for c in self._chunks)

    def cached_bytes(self) -> int:
        """Device memory kept for reuse, not in ``device_bytes`` ([Note: a CPU device's block cache])."""
        blocks = self._scheduler.ctx.blocks
        return 0 if blocks is None else blocks.nbytes

    def host_locked_bytes(self) -> int:
        """Of ``host_bytes``, those page-locked ([Note: what is page-locked] in host_pool.py)."""
        return sum(c.storage.host_locked_bytes for c in self._chunks)

    def describe(self) -> str:
        mib, cached = 2**20, self.cached_bytes()
        return (f"device model-state bytes now {self.device_bytes() / mib:.2f} MiB "
                f"(bound {self.device_bound() / mib:.2f} MiB"
                f"{f'; {cached / mib:.2f} MiB of freed gradient buffers kept for reuse' if cached else ''}); "
                f"host {self.host_bytes() / mib:.2f} MiB ({self.host_locked_bytes() / mib:.2f} MiB of it page-locked)")
