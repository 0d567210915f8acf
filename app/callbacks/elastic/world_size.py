"""A resume at another world size, the first of :class:`~app.callbacks.Elastic`'s three jobs.

The training loader deals the epoch's remaining samples out over the new ranks (:mod:`app.loader`); this part lines
Lightning's batch count up with the new loader, and keeps the global batch (per-device batch x devices x
``accumulate_grad_batches``) by changing ``accumulate_grad_batches`` when the new device count divides it; otherwise
it keeps the per-device batch and scales the learning rate by the linear scaling rule (:class:`~app.callbacks.LRWarmup`
with ``scale_lr`` does its own scaling, so then it is left to it). Settings counted in batches per process
(``limit_train_batches``, ``limit_val_batches``, ``val_check_interval`` as whole numbers) are rescaled to cover what
they covered on the devices they were given for, or refused in one line when the new count of devices cannot share
them evenly. One line says what changed, and the config file the start saved says it too.
"""

from __future__ import annotations

import re
import warnings

from lightning.pytorch.utilities import rank_zero_info

from app.checkpoints.atomic import write_text
from app.checkpoints.storage import run_path
from app.errors import TemplateWarning, UserError
from app.launch.restarts import is_restart
from app.lightning_internals import batch_count, shift_batch_count
from app.loader import TEMPLATE_LOADERS, ResumableLoader, StreamLoader, data_parallel_size, devices_per_batch
from app.parallelism import parallelism

# Settings Lightning counts in batches per process (when given as a whole number)
BATCH_COUNTS = ("limit_train_batches", "limit_val_batches", "val_check_interval")


def train_loader(trainer):
    loader = trainer.train_dataloader
    while isinstance(loader, list | tuple) and loader:
        loader = loader[0]
    return loader


def rescale_batch_counts(trainer, before: int, now: int) -> None:
    """Lightning counts these in batches per process: at another number of devices the same count covers another
    share of the epoch (a 2-process run's ``limit_train_batches=8`` resumed on 1 trained half an epoch). Each
    becomes the count that covers what it covered, or the change is refused in one line."""
    changed = []
    for name in BATCH_COUNTS:
        value = getattr(trainer, name)
        if isinstance(value, bool) or not isinstance(value, int):
            continue  # a fraction of the epoch (or None) means the same at any world size
        total = value * before
        if total % now:
            raise UserError(
                f"--trainer.{name}={value} counts batches per device, {total} over the {before} devices the "
                f"run started on, which {now} devices cannot share evenly; give a fraction of the epoch (such "
                f"as --trainer.{name}=0.5) or resume on a number of devices that divides {total}"
            )
        setattr(trainer, name, total // now)
        changed.append(f"{name} {value} -> {total // now}")
    if changed:
        rank_zero_info(f"{before} -> {now} devices: {', '.join(changed)} keep the batches of an epoch")


class WorldSizeChange:
    """The run's shape (devices, per-device batch, accumulation, batch counts; the first start's too), saved in
    every checkpoint, and what a start at another shape changes to train on as the run started."""

    def __init__(self, keep_global_batch: bool) -> None:
        self.keep_global_batch = keep_global_batch
        self.shape: dict | None = None  # devices, per-device batch and accumulation of this run
        self.counts: dict | None = None  # the batch counts as given, and the devices they were given for
        self.started_as: dict | None = None  # the run's first shape, for a restart that has no state to resume from
        self.changes: list[str] = []  # what this start changed to keep the global batch, said in one line each

    def fit_start(self, trainer, restored: dict | None) -> None:
        """Before the loops read them: batch counts given for another world size are rescaled to this one."""
        devices = data_parallel_size(trainer) * devices_per_batch(trainer.strategy)
        given = {name: getattr(trainer, name) for name in BATCH_COUNTS}
        counts = (restored or self.started_as or {}).get("counts")
        if counts and counts.get("given") == given and counts["devices"] != devices:
            rescale_batch_counts(trainer, counts["devices"], devices)
        elif counts and counts.get("given") == given:
            pass  # the same world size
        else:  # a fresh run, or counts given anew on purpose: they mean this world size
            counts = {"devices": devices, "given": given}
        self.counts = counts

    def train_start(self, trainer, restored: dict | None, restartable: bool) -> bool:
        """Line the batches up and keep the global batch; False when the training loader is not the template's
        (then none of this applies, and a warning says which promise the run loses)."""
        loader = train_loader(trainer)
        if not isinstance(loader, TEMPLATE_LOADERS):
            self._warn_own_loader(trainer, loader, restartable)
            return False
        devices = data_parallel_size(trainer) * devices_per_batch(trainer.strategy)
        device_batch = loader.batch_size // devices_per_batch(trainer.strategy)
        given = {"devices": devices, "device_batch": device_batch, "accumulate": trainer.accumulate_grad_batches}
        # resumed from a checkpoint: also one taken at an epoch's end, which the fit loop does not count as restarting
        resumed = restored if trainer.ckpt_path is not None else None
        if resumed and resumed.get("devices") != devices:
            self._line_up_batches(trainer, loader)
        if self.keep_global_batch and resumed:
            self._keep_global_batch(trainer, resumed, devices, device_batch)
        elif self.keep_global_batch and self.started_as and not restored:  # a restart from the start
            self._keep_global_batch(trainer, {**self.started_as, "fresh": True}, devices, device_batch)
        first = (resumed or self.started_as or {}).get("first") or resumed or self.started_as or given
        self.shape = {
            "devices": devices,
            "device_batch": device_batch,
            "accumulate": trainer.accumulate_grad_batches,
            "counts": self.counts,
            "first": {k: first[k] for k in ("devices", "device_batch", "accumulate")},  # the run's, as it started
        }
        return True

    def record_changes(self, trainer) -> None:
        """hparams.yaml (and TensorBoard's hparams) and, on rank 0, the start's config file say what changed."""
        if not self.changes:
            return
        for logger in trainer.loggers:
            logger.log_hyperparams({"elastic_changes": list(self.changes)})
        if trainer.is_global_zero:
            self._write_changes_into_config(trainer)

    def _warn_own_loader(self, trainer, loader, restartable: bool) -> None:
        """A data module's own training loader keeps none of the loader promises (app/loader.py): say which one
        this run relies on, once, instead of breaking it silently."""
        if loader is None or not trainer.is_global_zero:
            return
        name = type(trainer.datamodule).__name__ if trainer.datamodule is not None else "the model"
        void = []
        if trainer.ckpt_path is not None:
            void.append("a resume from a checkpoint taken mid-epoch starts that epoch over")
        if restartable or is_restart():
            void.append("a restart after a lost node or rank changes neither the order nor the global batch")
        if parallelism(trainer.strategy).devices_per_process > 1:
            void.append(f"dp splits each of its batches over {devices_per_batch(trainer.strategy)} devices")
        if void:
            warnings.warn(
                f"{name}'s training loader is not app.loader.make_loader's: {'; '.join(void)} (docs/fork.md)",
                TemplateWarning,
                stacklevel=2,
            )

    def _line_up_batches(self, trainer, loader: ResumableLoader | StreamLoader) -> None:
        """Lightning counts batches per rank; at another world size the restored count names another position.
        Shift its counters (all by the same amount, so its restart logic reads them as before) to the batch the
        re-dealt epoch starts at, so the epoch still ends at ``len(loader)`` and accumulation windows line up."""
        shift_batch_count(trainer, loader.first_batch() - batch_count(trainer))

    def _keep_global_batch(self, trainer, restored: dict, devices: int, device_batch: int) -> None:
        """Train on with the global batch the run started with (recorded in every checkpoint as ``first``): the
        accumulation that gives it at this number of devices, or, when none does, the accumulation as given and the
        learning rate scaled by the linear scaling rule from the one the checkpoint trained with."""
        given = trainer.accumulate_grad_batches
        first = restored.get("first") or restored  # (a checkpoint from before "first" was recorded: its own shape)
        if first.get("device_batch") != device_batch or first.get("accumulate") != given:
            return  # the batch or the accumulation were changed on purpose: they stand as given
        target = first["devices"] * first["accumulate"]  # per-device batches per optimizer step, as it started
        used = target if restored.get("fresh") else restored["devices"] * restored["accumulate"]
        accumulate = target // devices if target % devices == 0 else given
        factor = devices * accumulate / used
        was = f"{restored['devices']} -> {devices} devices"
        if accumulate != given:
            trainer.accumulate_grad_batches = accumulate
            self._say_change(
                f"{was}: accumulate_grad_batches {given} -> {accumulate} keeps the global batch {target * device_batch}"
            )
        if factor == 1:
            return
        change = (
            f"{was}: the global batch {used * device_batch} -> {devices * accumulate * device_batch} ({target} is not "
            f"a multiple of {devices})"
        )
        if any(getattr(c, "scale_lr", "none") != "none" for c in trainer.callbacks):
            self._say_change(f"{change}; LRWarmup's scaling rule sets the learning rate")
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
        for config in trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]
        self._say_change(f"{change}; learning rate x {factor:.4g} (linear scaling rule)")

    def _say_change(self, line: str) -> None:
        rank_zero_info(line)
        self.changes.append(line)

    def _write_changes_into_config(self, trainer) -> None:
        """Rank 0: the config file this start saved (config.yaml, config.restartN.yaml) says what it trains with:
        the accumulation it uses, and the lines above as comments (a scaled learning rate lives in the optimizer's
        state, not in the config)."""
        from lightning.pytorch.cli import SaveConfigCallback  # jsonargparse: only when a change is recorded

        # trainer.log_dir as Lightning reads it, but without its broadcast: this runs on rank 0 only
        first = trainer.loggers[0] if trainer.loggers else None
        log_dir = getattr(first, "log_dir", None) or getattr(first, "save_dir", None) if first else None
        for callback in trainer.callbacks:
            if not isinstance(callback, SaveConfigCallback) or not callback.save_to_log_dir or log_dir is None:
                continue
            path = run_path(log_dir) / callback.config_filename
            if not path.is_file():
                continue
            text = re.sub(
                r"^(\s+accumulate_grad_batches:) .*$",
                rf"\g<1> {trainer.accumulate_grad_batches}",
                path.read_text(),
                count=1,
                flags=re.MULTILINE,
            )
            header = "".join(f"# Elastic changed this start's settings: {line}\n" for line in self.changes)
            write_text(path, header + text)
