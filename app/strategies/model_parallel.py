"""What ``fsdp`` and ``pipeline`` share: launched and connected as ``ddp`` is (Lightning's launcher re-runs the
script per rank, or torchrun/SLURM start them; one process group), but each rank holds only a part of the model,
which the subclass splits in :meth:`SplitModelStrategy.split` instead of wrapping it in DistributedDataParallel,
for training and for evaluation alike (a model that needs splitting to train needs it to test)."""

from __future__ import annotations

from abc import abstractmethod

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from app.errors import UserError


class SplitModelStrategy(DDPStrategy):
    float16_reason = ""  # why 16-mixed cannot work (GradScaler's loss scaling and this strategy's gradients)

    @override
    def _configure_launcher(self) -> None:  # Lightning calls it when the Trainer is made: before any launch
        # A GPU's 16-mixed only: on CPU Lightning has made it bf16-mixed by now (with its own warning), as it does
        # for every strategy, and bf16 needs no loss scaling
        if str(self.precision_plugin.precision) == "16-mixed":
            raise UserError(
                f"--trainer.strategy={self.strategy_name} with --trainer.precision=16-mixed: float16's loss scaling "
                f"does not reach {self.float16_reason}; use bf16-mixed (the same speed on GPUs that have it) or 32-true"
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # As the template's ddp: a rank that fails or is killed before the group forms stops the others in seconds
        from app.launch.startup import install
        from app.strategies.ddp import formation_watched

        install()
        with formation_watched(self):
            super().setup_environment()

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)  # fitting: configure_ddp() splits the model before the optimizers are made
        if trainer.state.fn != TrainerFn.FITTING:  # test / validate / predict
            self.model = self.split(self.model)

    @override
    def configure_ddp(self) -> None:
        self.model = self.split(self.model)  # no DistributedDataParallel, no communication hooks

    @abstractmethod
    def split(self, model: nn.Module) -> nn.Module:
        """Give this rank its part of ``model`` (once; the process group exists), and return the model to train."""
