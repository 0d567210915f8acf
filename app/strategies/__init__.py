"""The strategies Lightning 2.x removed, brought back and registered under their old names.

Importing :mod:`app` registers them, so ``--trainer.strategy=dp``, ``--trainer.strategy=horovod``, YAML configs and
``Trainer(strategy="dp")`` work. ``ddp`` and ``ddp_spawn`` are Lightning's own.
"""

from lightning.pytorch.strategies import StrategyRegistry

from app.strategies.dp import DataParallelStrategy
from app.strategies.horovod import HorovodStrategy

__all__ = ["DataParallelStrategy", "HorovodStrategy"]

if "dp" not in StrategyRegistry:
    StrategyRegistry.register(
        "dp", DataParallelStrategy, description="torch.nn.DataParallel: one process, the batch split across devices"
    )
if "horovod" not in StrategyRegistry:
    StrategyRegistry.register(
        "horovod", HorovodStrategy, description="Horovod programming model over MPI (horovodrun / mpirun)"
    )
