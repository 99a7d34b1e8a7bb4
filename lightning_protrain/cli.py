"""LightningCLI entry point: ``python -m lightning_protrain.cli fit --config examples/config.yaml``.

The model and data classes come from the config (``class_path``); the current directory is
importable, so ``class_path: examples.finetune.CausalLM`` works from the repository root.
``trainer.strategy: protrain`` (or ``class_path: lightning_protrain.ProTrainStrategy`` with
``init_args``) selects ProTrain.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_protrain  # noqa: F401  (registers "protrain")


def main(args=None) -> LightningCLI:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
