"""Exporting a wrapped Hugging Face model: its master weights and a config that says their dtype.

A model's own ``save_pretrained`` reads the parameters, which during training are the compute
copies (bf16 or fp16 in the mixed modes), and writes their dtype into ``config.json``;
``from_pretrained`` then loads the model in that low precision. ``save_pretrained`` here writes
the master weights -- fp32, or bf16 in bf16-true: what ``Engine.state_dict`` returns -- and that
dtype in the config, so that ``from_pretrained(directory)`` rebuilds exactly the trained model
(the same logits as the master weights loaded into the model by hand).
"""

from __future__ import annotations

from pathlib import Path


def save_pretrained(engine, save_directory, **kwargs) -> None:
    """Write ``engine``'s model with ``save_pretrained`` (Hugging Face or PEFT), from the master
    weights, with their dtype in the config. Sharded over several processes, every rank calls
    it (the weights are gathered chunk by chunk) and rank 0 writes. ``kwargs`` go to the model's
    ``save_pretrained`` (``safe_serialization``, ``max_shard_size``, ...)."""
    module = engine.module
    if not hasattr(module, "save_pretrained"):
        raise ValueError(
            f"{type(module).__name__} has no save_pretrained (not a Hugging Face or PEFT model): save "
            "engine.state_dict() with torch.save instead, and load it with model.load_state_dict."
        )
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise ValueError(f"engine.save_pretrained sets {key}= itself (the master weights; rank 0 writes).")
    state = engine.state_dict()
    main = engine.rank == 0
    config = getattr(module, "config", None)
    before = getattr(config, "dtype", None) if config is not None else None
    try:
        if main:  # the others took part in the gathering; the model's save_pretrained would read its parameters
            module.save_pretrained(save_directory, state_dict=state, **kwargs)
        if main and config is not None and hasattr(config, "save_pretrained") and (Path(save_directory) / "config.json").exists():
            # The model's save_pretrained wrote the compute copies' dtype: say the masters'.
            config.dtype = str(engine.precision.master_dtype).removeprefix("torch.")
            config.save_pretrained(save_directory)
    finally:
        if config is not None:
            config.dtype = before
    if engine.sharding is not None:
        engine.sharding.barrier()
