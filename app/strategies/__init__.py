"""The strategies Lightning 2.x removed, brought back and registered under their old names, and the two kinds of
model parallelism: sharded data parallel that runs on CPU too, and pipeline stages.

:func:`register` puts them in Lightning's ``StrategyRegistry``, so ``--trainer.strategy=dp``, ``horovod``, ``fsdp``,
``pipeline``, YAML configs and ``Trainer(strategy="dp")`` work; ``cli.py``'s ``main`` and
:func:`app.run.defaults.trainer_defaults` call it (importing this package registers nothing). ``ddp`` and
``ddp_spawn`` are Lightning's own with two defaults that save work (``app/strategies/ddp.py``); ``fsdp`` takes the
name over from Lightning's GPU-only FSDP1 strategy (still there by class path,
``lightning.pytorch.strategies.FSDPStrategy``). Each class registers its own names in its ``register_strategies``,
as Lightning's do.
"""

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from app.strategies.ddp import DDPStrategy
from app.strategies.dp import DataParallelStrategy
from app.strategies.fsdp import FSDPStrategy
from app.strategies.horovod import HorovodStrategy
from app.strategies.pipeline import PipelineStrategy

__all__ = ["DDPStrategy", "DataParallelStrategy", "FSDPStrategy", "HorovodStrategy", "PipelineStrategy", "register"]


def register(registry: Any = StrategyRegistry) -> None:
    """Register the template's strategy names in ``registry`` (Lightning's by default); calling it again changes
    nothing."""
    for strategy in (DDPStrategy, DataParallelStrategy, HorovodStrategy, FSDPStrategy, PipelineStrategy):
        strategy.register_strategies(registry)
