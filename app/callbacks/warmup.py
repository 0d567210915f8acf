"""Gradual LR warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD") and the linear scaling rule.

    python cli.py fit --trainer.callbacks+=app.callbacks.LRWarmup --trainer.callbacks.warmup_epochs=5 \\
        --trainer.callbacks.scale_lr=linear

How it combines with the main schedule: the LR the optimizer uses at optimizer step t (0-based) is

    lr(t) = main_lr(t) * scale * warmup(t)

- ``main_lr(t)``: the LR the configured optimizer and scheduler (cosine, step, one-cycle, plateau, none) give;
  the main schedule runs as if there were no warmup: it is neither replaced nor shifted, and it sees and stores
  only its own LR. (``LearningRateMonitor``'s ``lr-<Optimizer>`` curve therefore shows ``main_lr``.)
- ``scale``: the scaling rule, ``global_batch / reference_batch`` (``linear``), its square root (``sqrt``) or 1
  (``none``, the default); global batch = per-device batch x devices x nodes x ``accumulate_grad_batches``.
- ``warmup(t)`` for t < T = the warmup steps, and 1 from then on:
  ``linear``: start + (1 - start) * t / T; ``exponential``: start ** (1 - t / T); ``constant``: start.

The factor is applied for the update only (torch's optimizer step hooks: from the end of the step's closure, its
forward and backward, to the end of ``optimizer.step()``), so it works under every strategy, with any optimizer, a
checkpoint written while a step is in flight or after it failed holds ``main_lr``, and it resumes exactly from a
checkpoint: it depends on nothing but ``trainer.global_step``. The LR each step used is logged as ``train/lr``.
"""

from __future__ import annotations

import math
from typing import Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.errors import UserError
from app.loader import data_parallel_size

Schedule = Literal["linear", "exponential", "constant"]
ScaleRule = Literal["none", "linear", "sqrt"]


def warmup_factor(step: int, warmup_steps: int, start_factor: float, schedule: Schedule = "linear") -> float:
    """The warmup multiplier for optimizer step ``step`` (0-based): ``start_factor`` at 0, 1 from ``warmup_steps``."""
    if step >= warmup_steps:
        return 1.0
    progress = step / warmup_steps
    if schedule == "linear":
        return start_factor + (1.0 - start_factor) * progress
    if schedule == "exponential":
        return start_factor ** (1.0 - progress)
    return start_factor


def lr_scale(global_batch: int, reference_batch: int, rule: ScaleRule) -> float:
    """The scaling rule's multiplier for a global batch: linear k, sqrt(k) or 1, with k = global / reference."""
    ratio = global_batch / reference_batch
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


class LRWarmup(Callback):
    def __init__(
        self,
        warmup_epochs: float | None = None,
        warmup_steps: int | None = None,
        start_factor: float = 0.1,
        schedule: Schedule = "linear",
        scale_lr: ScaleRule = "none",
        reference_batch: int = 256,
    ) -> None:
        """
        Args:
            warmup_epochs: Warm up over this many epochs of optimizer steps (default 5 when neither is given).
            warmup_steps: Or over this many optimizer steps. Set only one of the two; 0 turns warmup off.
            start_factor: The multiplier at step 0, in (0, 1]. Goyal et al. start at the unscaled LR, i.e.
                ``reference_batch / global_batch`` with ``scale_lr=linear``.
            schedule: ``linear`` (default), ``exponential`` or ``constant`` from ``start_factor`` to 1.
            scale_lr: Scaling rule: ``none`` (default), ``linear`` or ``sqrt`` in global batch / reference_batch.
            reference_batch: The global batch the configured LR was tuned for (256, as d2l and Goyal et al.).
        """
        if warmup_epochs is not None and warmup_steps is not None:
            raise UserError("LRWarmup: set --trainer.callbacks.warmup_epochs or warmup_steps, not both")
        if warmup_epochs is None and warmup_steps is None:
            warmup_epochs = 5.0
        if (warmup_epochs or 0) < 0 or (warmup_steps or 0) < 0:
            raise UserError("LRWarmup: --trainer.callbacks.warmup_epochs / warmup_steps must be >= 0")
        if not 0.0 < start_factor <= 1.0:
            raise UserError(f"LRWarmup: --trainer.callbacks.start_factor must be in (0, 1], got {start_factor}")
        if schedule not in Schedule.__args__:
            raise UserError(f"LRWarmup: --trainer.callbacks.schedule={schedule!r}: use linear, exponential or constant")
        if scale_lr not in ScaleRule.__args__:
            raise UserError(f"LRWarmup: --trainer.callbacks.scale_lr={scale_lr!r}: use none, linear or sqrt")
        if reference_batch <= 0:
            raise UserError(f"LRWarmup: --trainer.callbacks.reference_batch must be > 0, got {reference_batch}")
        self.warmup_epochs, self.warmup_steps = warmup_epochs, warmup_steps
        self.start_factor, self.schedule = start_factor, schedule
        self.scale_lr, self.reference_batch = scale_lr, reference_batch
        self.total_warmup_steps = 0
        self.scale = 1.0
        self._handles: list = []
        self._saved: dict[int, list] = {}
        self._last_lr: float | None = None

    def factor(self, step: int) -> float:
        """What optimizer step ``step`` multiplies the main schedule's LR by."""
        return self.scale * warmup_factor(step, self.total_warmup_steps, self.start_factor, self.schedule)

    # ---------------------------------------------------------------- set-up
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        accumulate = trainer.accumulate_grad_batches
        steps_per_epoch = math.ceil(trainer.num_training_batches / accumulate)
        if self.warmup_steps is not None:
            self.total_warmup_steps = self.warmup_steps
            how = f"{self.warmup_steps} steps"
        else:
            self.total_warmup_steps = round(self.warmup_epochs * steps_per_epoch)
            how = f"{self.warmup_epochs:g} epochs x {steps_per_epoch} steps = {self.total_warmup_steps} steps"
        message = f"LRWarmup: {self.schedule} warmup over {how}, from {self.start_factor:g} x lr"
        run_steps = trainer.estimated_stepping_batches
        if math.isfinite(run_steps) and self.total_warmup_steps > run_steps:  # a short trial run, a resume near its end
            message += f" (longer than this run's {int(run_steps)} steps: the lr stays below its target throughout)"
        if self.scale_lr != "none":
            per_process = _loader_batch_size(trainer)
            global_batch = per_process * data_parallel_size(trainer) * accumulate
            devices = trainer.num_devices * trainer.num_nodes
            per_device = global_batch // (devices * accumulate)
            self.scale = lr_scale(global_batch, self.reference_batch, self.scale_lr)
            message += (
                f"; {self.scale_lr} scaling rule: global batch {global_batch} = {per_device} per device"
                f" x {devices} devices x {accumulate} accumulation, / reference {self.reference_batch}"
                f" -> lr x {self.scale:.4g}"
            )
        rank_zero_info(message)
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._make_pre_hook(trainer)))
            self._handles.append(optimizer.register_step_post_hook(self._restore))

    def _make_pre_hook(self, trainer: Trainer):
        def apply(optimizer, args, kwargs):
            self._restore(optimizer, args, kwargs)  # a step that raised in its update left the factor on
            factor = self.factor(trainer.global_step)
            closure = kwargs.get("closure", args[0] if args else None)
            if closure is None:  # the forward and backward ran already (AMP's grad scaler, manual optimization)
                self._scale(optimizer, factor)
                return None

            # Lightning's step runs the forward and backward in the closure, inside optimizer.step(): the factor goes
            # on once the closure returned, so that a step that fails in them (a lost rank's collective) leaves no
            # scaled lr in the optimizer, and a checkpoint written meanwhile (the Elastic callback's survivor save,
            # from the watchdog's thread) holds the main schedule's lr, which a resume would scale again.
            def closure_then_scale():
                result = closure()
                if id(optimizer) not in self._saved:  # once (LBFGS calls its closure again)
                    self._scale(optimizer, factor)
                return result

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_scale}
            return (closure_then_scale, *args[1:]), kwargs

        return apply

    def _scale(self, optimizer, factor: float) -> None:
        self._saved[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        self._last_lr = float(optimizer.param_groups[0]["lr"])

    def _restore(self, optimizer, args, kwargs) -> None:
        for group, lr in zip(optimizer.param_groups, self._saved.pop(id(optimizer), ()), strict=False):
            group["lr"] = lr

    # ---------------------------------------------------------------- logging and clean-up
    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if self._last_lr is not None:
            pl_module.log("train/lr", self._last_lr, on_step=True, on_epoch=False, batch_size=1)
            self._last_lr = None

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _loader_batch_size(trainer: Trainer) -> int:
    """Samples per step in this process: the train loader's batch size (under dp, all of its devices' batches)."""
    loader = trainer.train_dataloader
    while isinstance(loader, (list, tuple)) and loader:
        loader = loader[0]
    if isinstance(loader, dict) and loader:
        loader = next(iter(loader.values()))
    size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not size:
        raise UserError("LRWarmup: scale_lr needs the train DataLoader's batch_size, and this loader has none")
    return int(size)
