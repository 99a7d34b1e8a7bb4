"""Exporting a wrapped Hugging Face model: its master weights (fp32, or bf16 in bf16-true: what
``Engine.state_dict`` returns) and their dtype in its config, where the model's own
``save_pretrained`` would write the compute copies and theirs (``Engine.save_pretrained``);
written beside the directory first and renamed over it ([Note: replacing a checkpoint directory] in
checkpoint.py), so that a failed or killed export leaves the previous one whole."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from protrain_core.checkpoint import recover, replace_directory
from protrain_core.utils import remove_stale_temporaries, temporary_prefix


def save_pretrained(engine, save_directory, *, module: str | None = None, **kwargs) -> None:
    """Write ``engine``'s model with ``save_pretrained`` (Hugging Face or PEFT), from the master
    weights, with their dtype in the config: the wrapped module itself, or the one module inside
    it that has ``save_pretrained`` (a LightningModule's ``self.model``), or the one named
    ``module``. Sharded over several processes, every rank calls it (the weights are gathered
    chunk by chunk) and rank 0 writes. ``kwargs`` go to the model's ``save_pretrained``
    (``safe_serialization``, ``max_shard_size``, ...)."""
    name, model = _exported(engine.module, module)
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise ValueError(f"engine.save_pretrained sets {key}= itself (the master weights; rank 0 writes).")
    prefix = f"{name}." if name else ""
    state = {k.removeprefix(prefix): v for k, v in engine.state_dict().items() if k.startswith(prefix)}
    if engine.rank == 0:  # the others took part in the gathering; the model's save_pretrained would read its parameters
        config = getattr(model, "config", None)
        before = getattr(config, "dtype", None)
        target = Path(save_directory)
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"engine.save_pretrained({str(target)!r}): a file is there; give a directory.")
        target.parent.mkdir(parents=True, exist_ok=True)
        recover(target, mine=lambda entry: _WEIGHTS.fullmatch(entry.name) is not None)
        remove_stale_temporaries(target.parent)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=temporary_prefix(target)))
        try:
            model.save_pretrained(tmp, state_dict=state, **kwargs)
            if hasattr(config, "save_pretrained") and (tmp / "config.json").exists():
                # The model's save_pretrained wrote the compute copies' dtype: say the masters'.
                config.dtype = str(engine.precision.master_dtype).removeprefix("torch.")
                config.save_pretrained(tmp)
            replace_directory(tmp, target, mine=_earlier_weights(tmp))
        finally:
            if config is not None:
                config.dtype = before
            shutil.rmtree(tmp, ignore_errors=True)
    engine.sharding.barrier()


# Weight files of an export (``model.safetensors``, ``model-00001-of-00002.safetensors``, their
# index, ``pytorch_model.bin``, PEFT's ``adapter_model.safetensors``): stem, shard, suffix.
_WEIGHTS = re.compile(r"(?P<stem>[\w.]+?)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _earlier_weights(tmp: Path):
    """What of an earlier export in the directory goes with it: its weight files under the names
    of this one's (in ``tmp``: shards, index), as ``save_pretrained`` removes them; a tokenizer's
    files and weights under other names stay."""
    stems = {(w.parent, m["stem"]) for w in (p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
             if (m := _WEIGHTS.fullmatch(w.name))}
    return lambda entry: (m := _WEIGHTS.fullmatch(entry.name)) is not None and (entry.parent, m["stem"]) in stems


def _exported(root, name: str | None):
    """(name, module) of the model to export: ``name``'s, the root if it has ``save_pretrained``,
    else the one outermost module inside it that has."""
    if name is not None:
        model = root.get_submodule(name)
        if not hasattr(model, "save_pretrained"):
            raise ValueError(f"engine.save_pretrained(module={name!r}): {type(model).__name__} has no save_pretrained "
                             "(not a Hugging Face or PEFT model).")
        return name, model
    if hasattr(root, "save_pretrained"):
        return "", root
    found = [n for n, m in root.named_modules() if n and hasattr(m, "save_pretrained")]
    outer = [n for n in found if not any(n.startswith(f"{o}.") for o in found)]
    if len(outer) == 1:
        return outer[0], root.get_submodule(outer[0])
    if outer:
        raise ValueError(f"{type(root).__name__} holds several models with save_pretrained ({', '.join(outer)}): "
                         f"name the one to export, engine.save_pretrained(directory, module={outer[0]!r}).")
    raise ValueError(
        f"{type(root).__name__} has no save_pretrained and holds no module that has (not a Hugging Face or PEFT "
        "model): save engine.state_dict() with torch.save instead, and load it with model.load_state_dict."
    )
