"""The engine ``wrap`` returns: the runtime's engine with the verbs that write and read files.

Checkpoints (checkpoint.py) and the Hugging Face export (export.py) sit above the runtime, which
does not import them (tests/test_architecture.py); this class makes them methods of the engines
``wrap`` builds (the profiler's engines need neither).
"""

from __future__ import annotations

from protrain_core.checkpoint import load_sharded, save_sharded
from protrain_core.export import save_pretrained
from protrain_core.runtime.engine import RuntimeEngine


class Engine(RuntimeEngine):
    """A training engine (``wrap`` builds it): forward through ``engine.module``, then
    ``backward``, ``step``, ``zero_grad`` (runtime/engine.py), and the checkpoint and export
    verbs."""

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Export a Hugging Face (or PEFT) model with the master weights and their dtype in
        ``config.json``, so that ``from_pretrained`` loads exactly the trained model (export.py).
        Use it instead of the model's own ``save_pretrained`` while the engine is open, which
        writes the compute copies (bf16 / fp16 in the mixed modes)."""
        self.step_state.check_open()
        save_pretrained(self, save_directory, **kwargs)

    def save_sharded(self, path, meta: dict | None = None) -> None:
        """Write the weights and optimizer state as a sharded ``torch.distributed.checkpoint``
        directory: every rank writes its own shards, nothing is gathered ([Note: sharded
        checkpoints] in checkpoint.py). Every rank calls it."""
        self.step_state.check_open()
        self.states.check_between_steps()
        self.states.adopt_rebound()
        save_sharded(self, path, meta)

    def load_sharded(self, path, *, model: bool = True, optimizer: bool = True, strict: bool = True) -> None:
        """Load a directory of ``save_sharded`` written by any number of processes: the weights
        (``model``), Adam's state and hyper-parameters (``optimizer``)."""
        self.step_state.check_open()
        load_sharded(self, path, model=model, optimizer=optimizer, strict=strict)
