"""DDP gradient compression on any device: PyTorch's DDP communication hooks, chosen by name.

    python cli.py fit --trainer.strategy=ddp --trainer.devices=4 \\
        --trainer.callbacks+=app.callbacks.DDPCommHook --trainer.callbacks.hook=powersgd

- ``fp16`` / ``bf16``: each gradient bucket travels in 16 bits (``default_hooks.fp16_compress_hook``,
  ``bf16_compress_hook``): half the bytes, gradients rounded to 16 bits once.
- ``powersgd``: ``powerSGD_hook``, a rank-``powersgd_rank`` approximation of each gradient matrix with error
  feedback (Vogels et al. 2019); plain allreduce for the first ``powersgd_start_iter`` steps, as PyTorch advises.

Lightning's DDPStrategy takes ``ddp_comm_hook`` but registers it only on CUDA; these hooks run on gloo/CPU too,
so the callback registers the hook itself, on the DDP-wrapped model, before the first training step, with ``ddp``
and ``ddp_spawn``. The horovod strategy has its own ``--trainer.strategy.compression``; ``dp`` communicates
nothing between processes. PowerSGD's error-feedback memory is not checkpointed: a resumed run starts it afresh.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from app.errors import UserError
from app.parallelism import parallelism

Hook = Literal["fp16", "bf16", "powersgd"]


class DDPCommHook(Callback):
    """Register a DDP communication hook (``fp16``, ``bf16`` or ``powersgd``) on CPU and GPU alike."""

    def __init__(self, hook: Hook = "fp16", powersgd_rank: int = 1, powersgd_start_iter: int = 10) -> None:
        """
        Args:
            hook: ``fp16`` or ``bf16`` (gradients travel in 16 bits), or ``powersgd`` (low-rank compression).
            powersgd_rank: Rank of PowerSGD's approximation (higher: more accurate, more bytes).
            powersgd_start_iter: Steps of plain allreduce before PowerSGD starts (at least 2).
        """
        if hook not in Hook.__args__:
            raise UserError(f"--trainer.callbacks.hook={hook!r} must be one of {', '.join(Hook.__args__)}")
        if powersgd_rank < 1:
            raise UserError(f"--trainer.callbacks.powersgd_rank={powersgd_rank} must be >= 1")
        if powersgd_start_iter < 2:  # PyTorch: DDP rebuilds its buckets after the first step
            raise UserError(f"--trainer.callbacks.powersgd_start_iter={powersgd_start_iter} must be >= 2")
        self.hook, self.powersgd_rank, self.powersgd_start_iter = hook, powersgd_rank, powersgd_start_iter

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        several = trainer.world_size > 1 or trainer.num_devices > 1
        refusal = parallelism(trainer.strategy).refusals.get("comm_hook")
        if stage == "fit" and several and refusal:
            name = type(trainer.strategy).__name__
            raise UserError(
                f"app.callbacks.DDPCommHook works with --trainer.strategy=ddp or ddp_spawn, not {name}; {refusal}"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):  # one process: nothing is communicated
            rank_zero_info("DDPCommHook: one process, no gradient communication to compress")
            return
        if self.hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            hook = powerSGD_hook.powerSGD_hook
            model.register_comm_hook(state, one_bucket_at_a_time(hook) if dist.get_backend() == "gloo" else hook)
        else:
            compress = default_hooks.fp16_compress_hook if self.hook == "fp16" else default_hooks.bf16_compress_hook
            model.register_comm_hook(None, compress)
        rank_zero_info(f"DDPCommHook: gradients reduced with the {self.hook} communication hook")


def one_bucket_at_a_time(hook):
    """PowerSGD chains collectives (``future.then``): the next one of a bucket starts when the last completes. On
    gloo those completions come in a different order on each rank, so two buckets' collectives can be issued in
    different orders (seen here: gloo's "Received data size doesn't match expected size" abort). Waiting for each
    bucket inside the hook keeps one order on every rank, at the cost of overlap with the rest of backward."""

    def in_order(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    return in_order
