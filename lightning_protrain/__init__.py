"""lightning-protrain: ``Trainer(strategy="protrain")`` and ``Fabric(strategy="protrain")``.

Importing this package registers "protrain" in Lightning's Trainer and Fabric strategy
registries (idempotently). The start-up hook installed with the package
(``_lightning_protrain_pth``) does the same on its own when Lightning is imported, so the
name works in scripts and LightningCLI configs that never import this package.
"""

from lightning_protrain._common import AtomicCheckpointIO
from lightning_protrain.fabric import ProTrainFabricStrategy
from lightning_protrain.strategy import ProTrainPrecision, ProTrainStrategy

__all__ = ["AtomicCheckpointIO", "ProTrainFabricStrategy", "ProTrainPrecision", "ProTrainStrategy", "register"]


def register() -> None:
    """Register "protrain" with the Trainer's and Fabric's strategy registries (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    ProTrainStrategy.register_strategies(StrategyRegistry)
    ProTrainFabricStrategy.register_strategies(STRATEGY_REGISTRY)


register()
