"""Exporting a wrapped Hugging Face model: its master weights (fp32, or bf16 in bf16-true: what
``Engine.state_dict`` returns) and their dtype in its config, where the model's own
``save_pretrained`` would write the compute copies and theirs (``Engine.save_pretrained``)."""

from __future__ import annotations

from pathlib import Path


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
        try:
            model.save_pretrained(save_directory, state_dict=state, **kwargs)
            if hasattr(config, "save_pretrained") and (Path(save_directory) / "config.json").exists():
                # The model's save_pretrained wrote the compute copies' dtype: say the masters'.
                config.dtype = str(engine.precision.master_dtype).removeprefix("torch.")
                config.save_pretrained(save_directory)
        finally:
            if config is not None:
                config.dtype = before
    engine.sharding.barrier()


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
