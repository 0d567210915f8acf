"""Stop a diverging run: a non-finite training loss ends it with one line and exit 1, and no checkpoint holds it.

With too high a learning rate the loss goes to ``inf`` and then ``nan``, and every later step trains on ``nan``
weights. Lightning carries on silently: the run exits 0, ``last.ckpt`` (and ``--ckpt_path last`` after it) holds
``nan`` weights, and so would an export. This callback

- marks, at every training step, whether the loss is finite, in a flag that stays on the device (reading the loss
  on the host every step would make each GPU step wait for the one before);
- reads that flag every ``check_every_n_steps`` steps, before validation, at the end of each epoch and of training
  (the ranks agree on it, so all stop after the same step), and stops the run with one line naming the step, the
  loss and what to change, exit code 1;
- refuses to write any checkpoint whose weights are not finite (an exception before the file is opened), so the
  checkpoints on disk keep the last finite weights and ``--ckpt_path last`` resumes from them.

Lightning's ``detect_anomaly`` finds the operation that made a ``nan`` (at a large cost per step: use it to debug),
and ``EarlyStopping(check_finite=True)`` looks only at a validation metric, after the checkpoint may be written.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from app.callbacks.preemption import wait_for_local_ranks
from app.errors import Diverged
from app.lightning_internals import take_over_local_ranks
from app.strategies.parallelism import parallelism
from app.task import spec_of

LOSS = "the training loss"  # what training_step returned, whatever the task logs it as


class StopOnNonFinite(Callback):
    def __init__(self, check_every_n_steps: int = 50) -> None:
        """
        Args:
            check_every_n_steps: Read the device-side "loss was not finite" flag this often (each read waits for the
                device); it is read before validation and at the end of each epoch too.
        """
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._bad: torch.Tensor | None = None  # True once a step's loss was inf or nan (on the device)
        self._first_bad: torch.Tensor | None = None  # that step's loss value, kept for the message
        self._steps = 0
        self._local_ranks: list = []  # rank 0 of a ddp launch: the other local ranks, once all stop

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._bad = torch.zeros((), dtype=torch.bool, device=pl_module.device)
        self._first_bad = torch.zeros((), dtype=torch.float32, device=pl_module.device)
        self._steps = 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor) or self._bad is None:
            return
        loss = loss.detach().float().reshape(-1)[0].to(self._bad.device)
        bad = ~torch.isfinite(loss)
        self._first_bad = torch.where(self._bad, self._first_bad, loss)  # the first non-finite value, no sync
        self._bad = self._bad | bad
        self._steps += 1
        if self._steps % self.check_every_n_steps == 0:
            self._check(trainer, pl_module, "training")

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._check(trainer, pl_module, "training")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(trainer, pl_module, "training")

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # Called on every rank while the checkpoint is assembled, before anything is written. Weights are the same
        # on every rank (their gradients were all-reduced), so each rank reaches the same answer without talking;
        # under fsdp and pipeline each rank holds a part of them (a shard; a stage's layers) and the ranks agree.
        held = [p.detach() for p in pl_module.parameters() if not p.is_meta]  # (another stage's: not here)
        held = [p.to_local() if hasattr(p, "to_local") else p for p in held]  # (a shard's own piece)
        finite = bool(torch.stack([torch.isfinite(p).all() for p in held]).all()) if held else True
        if parallelism(trainer.strategy).sharded:
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            self._local_ranks = take_over_local_ranks(trainer)
            raise Diverged(self._message(trainer, "non-finite weights", math.nan), trainer.global_rank)

    def _check(self, trainer: Trainer, pl_module: LightningModule, where: str) -> None:
        if self._bad is None:
            return
        bad = trainer.strategy.reduce_boolean_decision(bool(self._bad), all=False)  # the one read of the device
        if bad:
            self._local_ranks = take_over_local_ranks(trainer)  # before any rank can exit non-zero
            raise Diverged(self._message(trainer, LOSS, float(self._first_bad)), trainer.global_rank)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Diverged):
            wait_for_local_ranks(self._local_ranks)  # all stop at the same step; rank 0 exits after its children

    @staticmethod
    def _message(trainer: Trainer, what: str, value: float) -> str:
        lrs = sorted({group["lr"] for opt in trainer.optimizers for group in opt.param_groups})
        lr = ", ".join(f"{x:g}" for x in lrs) or "?"
        shown = f" became {value}" if what == LOSS and not math.isfinite(value) else ""
        return (
            f"training diverged: {what}{shown} by step {trainer.global_step} (epoch {trainer.current_epoch}); "
            "the run stops without writing these weights (checkpoints already on disk hold finite ones). "
            f"Lower the learning rate (now {lr}: {spec_of(trainer.lightning_module).lr_flag}), or warm it up "
            "(--trainer.callbacks+=app.callbacks.LRWarmup)"
        )
