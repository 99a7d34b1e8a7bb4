"""torch.compile under the engine: each unit's own computation compiled, the runtime outside.

[Note: compiled units]
``ProTrainConfig(compile=...)`` compiles, per module as torchtitan does, each transformer block
and each unit outside the blocks that has no submodules (the stem and head): a compiled unit gets
an instance ``forward`` that runs ``torch.compile`` of its own (``remove()`` restores it), so
what the runtime does at unit boundaries (chunk fetch and release, gradient and activation
hooks, the checkpoint wrapper) runs outside the compiled regions. Inside a running unit its
chunks are resident and pinned, so the compiled call runs with ``ManagedParameter``'s
``__torch_function__`` off: the parameters are plain tensors to the compiler, inputs of the
graph, and a streamed chunk's parameters pointing at another buffer each step changes no guard.
A unit given another unit's parameter as an argument runs that call uncompiled (the parameter's
use fetches its chunk) and says so once; a module with ProTrain's hooks called from inside a
compiled unit is refused. A unit compiles at its first call with gradients (under live
profiling the second training step: [Note: live profiling]), and again per activation mode, per
batch shape until dynamo marks it dynamic, and under ``no_grad``; Hugging Face blocks read their
own layer index, so each compiles its own graph, and dynamo's recompilation limits are raised.
A model that comes compiled (``torch.compile(model)``, or a submodule) is compiled this way
instead: while the engine is open torch.compile's wrappers run their modules eagerly, and the
units are compiled with the options the wrapper was made with as Lightning records them (else
torch's defaults), or with ``ProTrainConfig.compile`` where that is True or a dict. The wrappers
and their names (``_orig_mod.``) stay; ``remove()`` makes them compile again.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections import Counter

import torch
from torch import nn

from protrain_core.structure.blocks import block_modules
from protrain_core.structure.layout import unit_chunks
from protrain_core.utils import is_compile_wrapper, restore_forward

# torch.compile's keyword arguments that ProTrainConfig.compile may set.
COMPILE_ARGS = ("backend", "mode", "options", "dynamic", "fullgraph")
# Compilations of one unit's forward that its activation modes (a checkpointed block's first run
# and recomputation), a no_grad pass and new batch shapes may need.
COMPILES_PER_UNIT = 16


def compile_options(value) -> dict | None:
    """``ProTrainConfig.compile`` (``value``) as ``torch.compile``'s keyword arguments: None (off)
    for False, ``{}`` (torch's defaults) for True, else the dict (its keys among ``COMPILE_ARGS``)."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(COMPILE_ARGS))
        if unknown:
            raise ValueError(f"ProTrainConfig.compile has {unknown[0]!r}, which torch.compile does not take per "
                             f"module here; give a dict of {', '.join(COMPILE_ARGS)}, or True for torch's defaults.")
        return dict(value)
    raise ValueError(f"ProTrainConfig.compile must be True, False or a dict of torch.compile's arguments "
                     f"({', '.join(COMPILE_ARGS)}), got {type(value).__name__}.")


def compile_fingerprint(value) -> dict | None:
    """``ProTrainConfig.compile`` as data that compares alike across processes (a callable
    backend by its name), or None where it is off: for the profile key and the ranks' agreement."""
    options = compile_options(value)
    if options is None:
        return None
    return {k: getattr(v, "__qualname__", type(v).__qualname__) if callable(v) else v for k, v in options.items()}


def check_compile(value) -> None:
    """Raise ``ValueError`` unless ``torch.compile`` takes ``ProTrainConfig.compile`` (its mode,
    backend and options are checked when a function is compiled, before anything runs)."""
    options = compile_options(value)
    if options is None:
        return
    try:
        torch.compile(lambda: None, **options)
    except Exception as e:  # (torch raises RuntimeError, ValueError, or the backend's own)
        raise ValueError(f"ProTrainConfig.compile={value!r}: torch.compile refuses it: {e}") from e


def compile_setting(model: nn.Module, configured):
    """``ProTrainConfig.compile`` for ``model``: ``configured`` where it is on; else the options of
    the first torch.compile wrapper in it (as Lightning records them; True: torch's), if any."""
    if compile_options(configured) is not None:
        return configured
    wrapper = next((m for m in model.modules() if is_compile_wrapper(m)), None)
    if wrapper is None:
        return configured
    recorded = getattr(wrapper, "_compile_kwargs", None) or {}
    return {k: v for k, v in recorded.items() if k in COMPILE_ARGS} or True


def compile_units(root: nn.Module, layout, setting) -> CompiledUnits | None:
    """``root``'s units compiled as ``setting`` (``ProTrainConfig.compile``) says, or None where
    it is off: the transformer blocks, then the runtime's other units (``unit_chunks``) that have
    no submodules (before the activation manager wraps checkpointed blocks' forwards)."""
    options = compile_options(setting)
    if options is None:
        return None
    blocks = block_modules(root, layout.block_path)
    inside = {id(b) for b in blocks}
    others = [m for m in unit_chunks(root, layout) if id(m) not in inside and next(m.children(), None) is None]
    return CompiledUnits(blocks + others, options, root)


class CompiledUnits:
    """``modules``' forwards compiled with ``options``, and torch.compile's wrappers in ``root``
    running eagerly, until ``remove()`` ([Note: compiled units])."""

    def __init__(self, modules: list[nn.Module], options: dict, root: nn.Module) -> None:
        wrappers = [m for m in root.modules() if is_compile_wrapper(m)]
        self._originals = [(m, m.__dict__.get("forward")) for m in wrappers + modules]
        for w in wrappers:  # (the wrapper's forward is its compiled call of the module's __call__)
            w.forward = w._orig_mod.__call__
        self._options, self._count = options, len(modules)
        dynamo = torch._dynamo.config  # (its recompilation limits raised to what the units need, never lowered)
        sharing = max(Counter(type(m).forward for m in modules).values(), default=0)
        dynamo.recompile_limit = max(dynamo.recompile_limit, COMPILES_PER_UNIT * sharing)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, COMPILES_PER_UNIT * len(modules))
        for m in modules:
            m.forward = types.MethodType(_compiled_forward(m, m.forward, options), m)

    def describe(self) -> str:
        """What is compiled and when it compiles, for ``engine.summary()``."""
        settings = ", ".join(f"{k}={getattr(v, '__name__', v)!r}" for k, v in self._options.items()) or "torch's defaults"
        return (f"compiled: {self._count} modules (each block, the stem and head) with torch.compile({settings}); "
                "each compiles at its first training call, per activation mode, and per batch shape until dynamo "
                "makes it dynamic")

    def remove(self) -> None:
        """Give every module its forward back (torch.compile's wrappers theirs)."""
        for m, own in reversed(self._originals):  # (a compiled block: its own entry, then its wrapper's)
            restore_forward(m, own)
        self._originals = []


def _compiled_forward(module: nn.Module, forward, options: dict):
    compiled = torch.compile(forward, **options)
    own = {id(p) for p in module.parameters()}
    warned = False

    # (wraps the function, not the bound method: the signature seen through the bound result is
    # the forward's own, which the activation manager reads for cache arguments)
    @functools.wraps(getattr(forward, "__func__", forward))
    def run(self, *args, **kwargs):
        nonlocal warned
        if self is not module:  # a deep copy of the module: its plain forward (a compiled block's: its module's)
            return self._orig_mod(*args, **kwargs) if is_compile_wrapper(self) else type(self).forward(self, *args, **kwargs)
        if any(isinstance(t, nn.Parameter) and id(t) not in own for t in (*args, *kwargs.values())):
            if not warned:  # (another unit's parameter: the eager call fetches its chunk, as without compile)
                warnings.warn(f"{type(module).__name__} is given a parameter of another module; such calls run "
                              "uncompiled (its chunk is fetched for the call).", stacklevel=2)
                warned = True
            return forward(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return compiled(*args, **kwargs)

    return run
