"""Finding the repeated transformer blocks of a model."""

from __future__ import annotations

import warnings

from torch import nn

from protrain_core.utils import is_compile_wrapper

# Dotted paths of the block list in Hugging Face causal LMs, tried in order.
_KNOWN_BLOCK_PATHS = (
    "transformer.h",  # GPT-2, GPT-J, GPT-Neo
    "model.layers",  # LLaMA, Mistral, Qwen2, Gemma, Phi-3
    "model.decoder.layers",  # OPT
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "transformer.blocks",  # MPT
    "layers",  # a bare decoder (e.g. LlamaModel)
    "h",  # a bare GPT2Model
    "decoder.layers",  # a bare OPTModel
)

# Encoder-decoder models: both stacks are blocks, the encoder's first (it runs first).
_KNOWN_STACK_PAIRS = (
    ("encoder.block", "decoder.block"),  # T5, mT5, UMT5
    ("model.encoder.layers", "model.decoder.layers"),  # BART, mBART, Marian, Pegasus
    ("encoder.layers", "decoder.layers"),  # a bare BartModel-like encoder-decoder
)
SEP = "+"  # joins the dotted names of several block lists in one block path


def split_paths(block_path: str) -> list[str]:
    """The dotted names of the block lists in ``block_path`` (one, or several joined by "+")."""
    return block_path.split(SEP) if block_path else []


def block_modules(model: nn.Module, block_path: str) -> list[nn.Module]:
    """The blocks of ``block_path``, in order: every list's blocks, the lists in order."""
    return [b for path in split_paths(block_path) for b in model.get_submodule(path)]


def is_hf_lm(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "vocab_size")


def inner_hf_lm(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The one outermost Hugging Face language model inside ``model``, if there is exactly one."""
    found = [(n, m) for n, m in model.named_modules() if n and is_hf_lm(m)]
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
    return outer[0] if len(outer) == 1 else None


def _get_submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _candidates(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]


def _describe(model: nn.Module) -> str:
    lines = []
    for name, ml in _candidates(model):
        classes = sorted({type(b).__name__ for b in ml})
        n_params = sum(p.numel() for p in ml.parameters())
        lines.append(f"  {name!r}: {len(ml)} x {'/'.join(classes)} ({n_params:,} parameters)")
    return "\n".join(lines) if lines else "  (the model has no non-empty nn.ModuleList)"


def find_blocks(model: nn.Module, blocks=None) -> tuple[str, list[nn.Module]]:
    """Return ``(block_path, blocks)``: the dotted name of the model's transformer block list
    (several lists joined by "+": an encoder-decoder's two stacks) and the blocks, in order.

    ``blocks`` overrides discovery: a ModuleList that is part of ``model``, its dotted name, or a
    list of those (several stacks, in execution order). Discovery tries the block paths of the
    Hugging Face families we support (both stacks of an encoder-decoder), then a ModuleList
    whose children are of a class named in the model's ``_no_split_modules``, then the only
    ModuleList of two or more same-class children. Otherwise the error lists the candidates.
    A name returned is the list's name in ``model.named_modules()`` (a wrapper such as a PEFT
    model resolves ``transformer.h`` through attribute forwarding; the canonical name is
    ``base_model.model.transformer.h``).
    """
    given = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    try:
        found = (_stacks(model) if blocks is None else None) or [_discover(model, b) for b in given]
    except _NoBlocks as e:  # (discovery only) any nn.Module trains: its modules are the chunks' units
        warnings.warn(str(e), stacklevel=2)
        return "", []
    empty = [b for b, lst in zip(given, found) if not len(lst)]
    if blocks is not None and empty:
        raise ValueError(f"blocks={empty[0]!r} is an empty nn.ModuleList: name the list that holds the model's "
                         "repeated blocks. Candidates:\n" + _describe(model))
    named = {id(m): n for n, m in model.named_modules()}
    if any(id(lst) not in named for lst in found):
        raise ValueError("blocks= is an nn.ModuleList that is not a submodule of the model.")
    names = [named[id(lst)] for lst in found]
    uncalled = sorted({type(b).__name__ for lst in found for b in lst
                       if type(b).forward is nn.Module.forward and not is_compile_wrapper(b)})  # (torch.compile's: called)
    if uncalled:  # (an nn.ModuleDict of layers that the model calls one by one)
        raise ValueError(
            f"The blocks in {SEP.join(names)!r} are {', '.join(uncalled)} without a forward of their own: the model "
            "calls the modules inside them, never a block, so ProTrain would not see a block run (it fetches a "
            "block's chunks and keeps, checkpoints or swaps its activations around the block's forward). Give the "
            "block class a forward that the model calls, or name a list of modules that the model calls: "
            "ProTrainConfig(planning={'blocks': ...}). Candidates:\n" + _describe(model))
    return SEP.join(names), [b for lst in found for b in lst]


def _stacks(model: nn.Module) -> list[nn.ModuleList] | None:
    """Both block lists of an encoder-decoder (possibly inside a wrapper), or None."""
    prefixes = [""] + [f"{n}." for n, m in model.named_modules() if n and is_hf_lm(m)]
    for prefix in prefixes:
        for pair in _KNOWN_STACK_PAIRS:
            found = [_get_submodule(model, prefix + p) for p in pair]
            if all(isinstance(f, nn.ModuleList) and len(f) > 0 for f in found):
                return found
    return None


def _discover(model: nn.Module, blocks) -> nn.ModuleList:
    if isinstance(blocks, str):
        found = _get_submodule(model, blocks)
        if not isinstance(found, nn.ModuleList):
            raise ValueError(
                f"blocks={blocks!r} does not name an nn.ModuleList of the model. Candidates:\n"
                + _describe(model)
            )
        return found
    if isinstance(blocks, nn.ModuleList):
        return blocks
    if blocks is not None:
        raise ValueError(f"blocks= must be an nn.ModuleList or its dotted name, got {type(blocks).__name__}")

    inner = inner_hf_lm(model)  # a wrapper (a LightningModule, a user's module) around one Hugging Face model
    for prefix in [""] + ([f"{inner[0]}."] if inner else []):
        for path in _KNOWN_BLOCK_PATHS:
            found = _get_submodule(model, prefix + path)
            if isinstance(found, nn.ModuleList) and len(found) > 0:
                return found

    no_split = set(getattr(model, "_no_split_modules", None) or ())
    candidates = _candidates(model)
    if no_split:
        for _, ml in candidates:
            if all(type(b).__name__ in no_split for b in ml):
                return ml
    homogeneous = [ml for _, ml in candidates if len(ml) >= 2 and len({type(b) for b in ml}) == 1]
    if len(homogeneous) == 1:
        return homogeneous[0]
    name_them = ("config=ProTrainConfig(planning={'blocks': '<dotted name>'}) to protrain_core.wrap, "
                 "ProTrainStrategy or ProTrainFabricStrategy (from Python, the nn.ModuleList itself). "
                 "Candidate ModuleLists:\n" + _describe(model))
    if candidates:  # lists of modules that may be the blocks: the user chooses
        raise ValueError(f"Could not tell which nn.ModuleList holds the repeated blocks of {type(model).__name__}. "
                         f"Name it: {name_them}")
    raise _NoBlocks(
        f"ProTrain found no repeated blocks in {type(model).__name__}: it trains with the model's modules as the "
        "units of its chunks and keeps every activation (nothing to checkpoint or swap, no plan to search). For "
        f"a model built of repeated blocks, name them: {name_them}"
    )


class _NoBlocks(ValueError):
    """Discovery found no block list (``find_blocks`` then trains without blocks, with a warning)."""
