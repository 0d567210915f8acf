"""The strategies Lightning 2.x removed, brought back and registered under their old names, and the two kinds of
model parallelism: sharded data parallel that runs on CPU too, and pipeline stages.

Importing :mod:`app` registers them, so ``--trainer.strategy=dp``, ``horovod``, ``fsdp``, ``pipeline``, YAML
configs and ``Trainer(strategy="dp")`` work. ``ddp`` and ``ddp_spawn`` are Lightning's own with two defaults that
save work (``app/strategies/ddp.py``); ``fsdp`` takes the name
over from Lightning's GPU-only FSDP1 strategy (still there by class path,
``lightning.pytorch.strategies.FSDPStrategy``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from app.lightning_internals import free_strategy_name
from app.strategies.ddp import DDPStrategy
from app.strategies.dp import DataParallelStrategy
from app.strategies.fsdp import FSDPStrategy
from app.strategies.horovod import HorovodStrategy
from app.strategies.pipeline import PipelineStrategy

__all__ = ["DDPStrategy", "DataParallelStrategy", "FSDPStrategy", "HorovodStrategy", "PipelineStrategy"]

for name, start_method in (("ddp", "popen"), ("ddp_spawn", "spawn")):
    if StrategyRegistry[name]["strategy"] is not DDPStrategy:
        description = (
            StrategyRegistry[name]["description"] + "; gradients as bucket views, no DDP wrapper in a world of one"
        )
        StrategyRegistry.register(name, DDPStrategy, description, override=True, start_method=start_method)
if "dp" not in StrategyRegistry:
    StrategyRegistry.register(
        "dp", DataParallelStrategy, description="torch.nn.DataParallel: one process, the batch split across devices"
    )
if "horovod" not in StrategyRegistry:
    StrategyRegistry.register(
        "horovod", HorovodStrategy, description="Horovod programming model over MPI (horovodrun / mpirun)"
    )
if "fsdp" not in StrategyRegistry or StrategyRegistry["fsdp"]["strategy"] is not FSDPStrategy:
    StrategyRegistry.register(
        "fsdp",
        FSDPStrategy,
        description="FSDP2: parameters, gradients and optimizer state sharded over the ranks (CPU and GPU)",
        override=True,
    )
    free_strategy_name("fsdp")
if "pipeline" not in StrategyRegistry:
    StrategyRegistry.register(
        "pipeline",
        PipelineStrategy,
        description="the network cut into stages, one process each, micro-batches through torch.distributed.pipelining",
    )
