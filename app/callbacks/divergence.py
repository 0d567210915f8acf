"""Stop a diverging run: a non-finite training loss ends it with one line and exit 1, and no checkpoint holds it.

With too high a learning rate the loss goes to ``inf`` and then ``nan``, and every later step trains on ``nan``
weights. Lightning carries on silently: the run exits 0, ``last.ckpt`` (and ``--ckpt_path last`` after it) holds
``nan`` weights, and so would an export. This callback

- copies each training batch's loss into a buffer that stays on the device, one copy and no other work per batch
  (reading the loss on the host every step would make each GPU step wait for the one before; a device-side "was it
  finite" flag cost six small operations per batch, host time that a fast GPU step waits for);
- reads that buffer every ``check_every_n_steps`` batches, before validation and at the end of each epoch (the ranks
  agree on it, so all stop after the same step), and stops the run with one line naming the step whose loss was
  not finite, that loss and what to change, exit code 1;
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
from app.parallelism import parallelism
from app.task import lr_flag_of

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
        self._losses: torch.Tensor | None = None  # the losses since the last check, on the device
        self._steps: list[int] = []  # the optimizer step each of them belongs to
        self._step = 0
        self._local_ranks: list = []  # rank 0 of a ddp launch: the other local ranks, once all stop

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._losses = torch.zeros(self.check_every_n_steps, dtype=torch.float32, device=pl_module.device)
        self._steps = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._step = trainer.global_step  # the step this batch trains (metrics.csv's step of its loss)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor) or self._losses is None:
            return
        loss = loss.detach()
        self._losses[len(self._steps)] = loss if loss.dim() == 0 else loss.reshape(-1)[0]  # one copy, no sync
        self._steps.append(self._step)
        if len(self._steps) == self.check_every_n_steps:
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
            raise Diverged(self._message(trainer, "non-finite weights", math.nan, None), trainer.global_rank)

    def _check(self, trainer: Trainer, pl_module: LightningModule, where: str) -> None:
        if self._losses is None:
            return
        losses = self._losses[: len(self._steps)].tolist()  # the one read of the device
        first = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
        bad = trainer.strategy.reduce_boolean_decision(first is not None, all=False)
        if bad:
            self._local_ranks = take_over_local_ranks(trainer)  # before any rank can exit non-zero
            value, step = (math.nan, None) if first is None else (losses[first], self._steps[first])
            raise Diverged(self._message(trainer, LOSS, value, step), trainer.global_rank)
        self._steps = []

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Diverged):
            wait_for_local_ranks(self._local_ranks)  # all stop at the same step; rank 0 exits after its children

    @staticmethod
    def _message(trainer: Trainer, what: str, value: float, step: int | None) -> str:
        """``step``: the optimizer step whose loss was not finite on this rank (None: another rank's, or weights)."""
        lrs = sorted({group["lr"] for opt in trainer.optimizers for group in opt.param_groups})
        lr = ", ".join(f"{x:g}" for x in lrs) or "?"
        flag = lr_flag_of(trainer.lightning_module)
        when = f"became {value} at step {step}" if step is not None else f"by step {trainer.global_step}"
        return (
            f"training diverged: {what} {when} (epoch {trainer.current_epoch}); "
            "the run stops without writing these weights (checkpoints already on disk hold finite ones). "
            f"Lower the learning rate (now {lr}{f': {flag}' if flag else ''}), or warm it up "
            "(--trainer.callbacks+=app.callbacks.LRWarmup)"
        )
