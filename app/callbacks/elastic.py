"""Carry a run across a change of world size, and across a lost node when the launcher restarts the job.

On by default. Three things, each only where it applies:

- **A resume at another world size** (an elastic restart, or ``--ckpt_path`` with other ``--trainer.devices`` or
  nodes): the training loader deals the epoch's remaining samples out over the new ranks (:mod:`app.loader`);
  this callback lines Lightning's batch count up with the new loader, and keeps the global batch (per-device batch
  x devices x ``accumulate_grad_batches``) by changing ``accumulate_grad_batches`` when the new device count
  divides it; otherwise it keeps the per-device batch and scales the learning rate by the linear scaling rule
  (:class:`~app.callbacks.LRWarmup` with ``scale_lr`` does its own scaling, so then it is left to it). Settings
  counted in batches per process (``limit_train_batches``, ``limit_val_batches``, ``val_check_interval`` as whole
  numbers) are rescaled to cover what they covered on the devices they were given for, or refused in one line when
  the new count of devices cannot share them evenly. One line says what changed.
- **A failure under a restarting launcher** (torchrun ``--max-restarts`` > 0): when a rank dies, the others' next
  collective fails. All ranks hold the same weights and optimizer state after every step, so each survivor writes
  ``last.ckpt`` at that moment, with the loop and loader position of the last completed optimizer step (recorded
  after every step: a few integers), and exits non-zero; the launcher restarts the job, which resumes from it. Only
  the step in flight is done again. Nothing is written per step. Where no collective fails (a cut link or a hung
  host closes no connection, and gloo then waits for good), the rank watchdog's verdict has the state written from
  its own thread, with the training thread held at its next optimizer step. A failure in a validation (or right
  before one) saves the state at that validation's start, with the checkpoint callbacks' state from before it: the
  restart validates the epoch again. The global batch kept is always the one the run started with (``first`` in
  every checkpoint; ``elastic.json`` for a restart that finds no state at all).
- **The restarted run's metrics**: rank 0 puts the rows of the run's earlier ``metrics.csv`` (up to the step it
  resumes from, without those of a validation it does again, with the last step's row if rank 0 died before writing
  it) back in front of the new ones, so the run keeps one ``metrics.csv``. The config file the start saved says the
  accumulation it trains with, and what was changed, as comments.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import re
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.atomic import write_text
from app.callbacks.progress import console_print
from app.callbacks.rank_watchdog import REJOIN, RankWatchdog
from app.checkpoint_io import SafeCheckpointIO
from app.elastic import (
    MARKER,
    METRICS_BEFORE_RESTART,
    TorchrunJob,
    agent_id,
    is_restart,
    mark_run,
    report_saved_state,
    restarts_left,
    restarts_possible,
    run_shape,
    saved_state_announcer,
)
from app.errors import TemplateWarning, UserError
from app.lightning_internals import (
    batch_count,
    fit_loop_state,
    put_fit_loop_state,
    restart_validation,
    resume_into_validation,
    saving_alone,
    shift_batch_count,
    step_row,
    validation_follows,
)
from app.loader import ResumableLoader, data_parallel_size, devices_per_batch
from app.strategies.parallelism import parallelism

# Settings Lightning counts in batches per process (when given as a whole number)
BATCH_COUNTS = ("limit_train_batches", "limit_val_batches", "val_check_interval")


def say(trainer, message: str) -> None:
    """A line from any rank (a survivor may be rank 3): rank 0's above its progress bar, the others' on stderr."""
    if trainer.is_global_zero:
        console_print(trainer, message)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


METRICS_ROWS_TO_KEEP = "metrics.rows-to-keep"


def keep_metrics_rows(trainer, rows: int) -> None:
    """A survivor, failing: the restart puts only the first ``rows`` rows of metrics.csv back (survivors write the
    same number)."""
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            path = Path(logger.log_dir) / METRICS_ROWS_TO_KEEP
            write_text(path, f"{rows}\n")


def _devices_per_process(trainer) -> int:
    """The devices of one data-parallel slice: dp's devices, a pipeline's stages, else 1."""
    return devices_per_batch(trainer.strategy)


def _train_loader(trainer):
    loader = trainer.train_dataloader
    while isinstance(loader, list | tuple) and loader:
        loader = loader[0]
    return loader


class Elastic(Callback):
    def __init__(self, keep_global_batch: bool = True) -> None:
        """
        Args:
            keep_global_batch: On a resume at another number of devices, change ``accumulate_grad_batches`` (or the
                learning rate) so that training goes on with the same global batch. False: leave both as given.
        """
        self.keep_global_batch = keep_global_batch
        self._shape: dict | None = None  # devices, per-device batch and accumulation of this run
        self._restored: dict | None = None  # the same, of the run the checkpoint came from
        self._counts: dict | None = None  # the batch counts as given, and the devices they were given for
        self._last_step: tuple[int, dict] | None = None  # (global step, loops' state after it)
        self._saving_loops: dict | None = None
        self.restartable = False
        self.saved_after_failure: str | None = None  # the last.ckpt this rank wrote when its collective failed
        self.started_as: dict | None = None  # the run's first shape, for a restart that has no state to resume from
        self._rows = 0  # metrics.csv's rows so far, known on every rank (a restarting launcher's run only)
        self._rows_before_validation: int | None = None
        self._checkpointers_before_validation: dict | None = None
        self._validation_started = 0.0  # time.time() at the start of the validation since the last step
        self._changes: list[str] = []  # what this start changed to keep the global batch, said in one line each
        self._step_row: dict | None = None  # the row the loop logs for the last step (step_row)
        self._saving_row: dict | None = None
        # Under a restarting launcher: held from each optimizer step until its position is recorded, and by a save
        # from the watchdog thread, which then holds the training thread at its next step (save_from_watchdog)
        self._step_lock: threading.Lock | None = None
        self._in_step = False
        self._saving: threading.Lock | None = None  # one save after a failure, from whichever thread comes first

    def __getstate__(self) -> dict:
        # the horovod self-launch pickles the trainer into its ranks; locks do not pickle (and are made per start)
        return {**self.__dict__, "_step_lock": None, "_in_step": False, "_saving": None}

    # ---------------------------------------------------------------- the run's shape, saved and restored
    @override
    def state_dict(self) -> dict:
        return dict(self._shape or {})

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = dict(state_dict) or None

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        self.restartable = restarts_possible()
        if self.restartable or is_restart():
            # A restart continues in its run's folder, which holds the checkpoints it resumes from by design.
            warnings.filterwarnings(
                "ignore", message=r"Checkpoint directory .* exists and is not empty", module=r"lightning\.pytorch"
            )
        if self.restartable:
            for logger in trainer.loggers:
                if isinstance(logger, CSVLogger):
                    self._count_rows(logger)

    def _count_rows(self, logger: CSVLogger) -> None:
        """Count metrics.csv's rows (one per ``log_metrics`` call; every rank makes the calls, rank 0's write) so
        that a survivor of a failure in validation, whichever rank, can tell the restart which rows came before it:
        the restart validates again and logs that validation's rows anew."""
        log_metrics = logger.log_metrics

        def counted(*args, **kwargs):
            self._rows += 1
            return log_metrics(*args, **kwargs)

        logger.log_metrics = counted

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.restartable:
            self._rows_before_validation = self._rows
            # What the checkpoint callbacks knew before this validation: a failure in it (in its epoch checkpoint's
            # save, say) restarts it, and their state must not say that its step was saved or which file is best.
            self._checkpointers_before_validation = {
                c.state_key: copy.deepcopy(c.state_dict()) for c in trainer.checkpoint_callbacks
            }
            self._validation_started = time.time()

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        """Before the loops read them: batch counts given for another world size are rescaled to this one."""
        devices = data_parallel_size(trainer) * _devices_per_process(trainer)
        given = {name: getattr(trainer, name) for name in BATCH_COUNTS}
        counts = (self._restored or self.started_as or {}).get("counts")
        if counts and counts.get("given") == given and counts["devices"] != devices:
            self._rescale_batch_counts(trainer, counts["devices"], devices)
        elif counts and counts.get("given") == given:
            pass  # the same world size
        else:  # a fresh run, or counts given anew on purpose: they mean this world size
            counts = {"devices": devices, "given": given}
        self._counts = counts

    def _rescale_batch_counts(self, trainer, before: int, now: int) -> None:
        """Lightning counts these in batches per process: at another number of devices the same count covers
        another share of the epoch (a 2-process run's ``limit_train_batches=8`` resumed on 1 trained half an
        epoch). Each becomes the count that covers what it covered, or the change is refused in one line."""
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

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        loader = _train_loader(trainer)
        if not isinstance(loader, ResumableLoader):
            self._warn_own_loader(trainer, loader)
            return
        devices = data_parallel_size(trainer) * _devices_per_process(trainer)
        device_batch = loader.batch_size // _devices_per_process(trainer)
        given = {"devices": devices, "device_batch": device_batch, "accumulate": trainer.accumulate_grad_batches}
        # resumed from a checkpoint: also one taken at an epoch's end, which the fit loop does not count as restarting
        restored = self._restored if trainer.ckpt_path is not None else None
        if restored and restored.get("devices") != devices:
            self._line_up_batches(trainer, loader)
        if self.keep_global_batch and restored:
            self._keep_global_batch(trainer, restored, devices, device_batch)
        elif self.keep_global_batch and self.started_as and not self._restored:  # a restart from the start
            self._keep_global_batch(trainer, {**self.started_as, "fresh": True}, devices, device_batch)
        first = (restored or self.started_as or {}).get("first") or restored or self.started_as or given
        self._shape = {
            "devices": devices,
            "device_batch": device_batch,
            "accumulate": trainer.accumulate_grad_batches,
            "counts": self._counts,
            "first": {k: first[k] for k in ("devices", "device_batch", "accumulate")},  # the run's, as it started
        }
        if self.restartable:  # a lost peer's verdict waits until this rank saved (on_exception), or saves itself
            self._step_lock, self._in_step, self._saving = threading.Lock(), False, threading.Lock()
            for watchdog in trainer.callbacks:
                if isinstance(watchdog, RankWatchdog):
                    watchdog.expect_save(save_now=lambda wait: self.save_from_watchdog(trainer, wait))
        if self._changes:
            for logger in trainer.loggers:  # hparams.yaml (and TensorBoard's hparams) say it beside the module's lr
                logger.log_hyperparams({"elastic_changes": list(self._changes)})
            if trainer.is_global_zero:
                self._record_changes(trainer)
        restored_rows = self._continue_metrics(trainer) if trainer.is_global_zero else 0
        if self.restartable and trainer.world_size > 1:  # rank 0 put them back (counted there): the others count them
            restored_rows = trainer.strategy.broadcast(restored_rows, src=0)
            if not trainer.is_global_zero:
                self._rows += restored_rows

    def _warn_own_loader(self, trainer, loader) -> None:
        """A data module's own training loader keeps none of the loader promises (app/loader.py): say which one
        this run relies on, once, instead of breaking it silently."""
        if loader is None or not trainer.is_global_zero:
            return
        name = type(trainer.datamodule).__name__ if trainer.datamodule is not None else "the model"
        void = []
        if trainer.ckpt_path is not None:
            void.append("a resume from a checkpoint taken mid-epoch starts that epoch over")
        if self.restartable or is_restart():
            void.append("a restart after a lost node or rank changes neither the order nor the global batch")
        if parallelism(trainer.strategy).devices_per_process > 1:
            void.append(f"dp splits each of its batches over {_devices_per_process(trainer)} devices")
        if void:
            warnings.warn(
                f"{name}'s training loader is not app.loader.make_loader's: {'; '.join(void)} (docs/fork.md)",
                TemplateWarning,
                stacklevel=2,
            )

    def _line_up_batches(self, trainer, loader: ResumableLoader) -> None:
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
        self._changes.append(line)

    def _record_changes(self, trainer) -> None:
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
            path = Path(log_dir) / callback.config_filename
            if not path.is_file():
                continue
            text = re.sub(
                r"^(\s+accumulate_grad_batches:) .*$",
                rf"\g<1> {trainer.accumulate_grad_batches}",
                path.read_text(),
                count=1,
                flags=re.MULTILINE,
            )
            header = "".join(f"# Elastic changed this start's settings: {line}\n" for line in self._changes)
            write_text(path, header + text)

    def _continue_metrics(self, trainer) -> int:
        """Rank 0: the earlier rows back in front of the new ones; returns how many rows were put back."""
        restored = 0
        for logger in trainer.loggers:
            if not isinstance(logger, CSVLogger):
                continue
            kept = Path(logger.log_dir) / METRICS_BEFORE_RESTART
            keep = Path(logger.log_dir) / METRICS_ROWS_TO_KEEP
            rows = []
            if kept.is_file():
                with kept.open(newline="") as f:
                    rows = list(csv.DictReader(f))
            if keep.is_file():  # the run failed in a validation that this one does again: not its rows
                rows = rows[: int(keep.read_text())]
                keep.unlink()
            count = 0
            missing = (self._restored or {}).get("step_row")  # rank 0 died before logging the last step's row
            if missing and any(int(r["step"]) == missing["step"] and r.get(k) for r in rows for k in missing["values"]):
                missing = None  # it was logged
            for row in rows:
                step = int(row.pop("step"))
                if step >= trainer.global_step:
                    continue  # the step in flight when the run failed (its rows name it): this run logs it again
                values = {k: int(float(v)) if k == "epoch" else float(v) for k, v in row.items() if v not in ("", None)}
                if values:
                    logger.log_metrics(values, step=step)
                    count += 1
            if missing and missing["step"] < trainer.global_step:
                logger.log_metrics({**missing["values"], "epoch": missing["epoch"]}, step=missing["step"])
                count += 1
            if kept.is_file():
                logger.save()
                kept.unlink()
            restored = max(restored, count)
        return restored

    # ---------------------------------------------------------------- a failure the launcher restarts from
    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # After the backward (and its gradient all-reduce), before the weights change: from here until the step's
        # position is recorded (on_train_batch_end) a save from the watchdog thread waits; once one has begun, this
        # blocks until the watchdog ends the process.
        if self._step_lock is not None and not self._in_step:
            self._step_lock.acquire()
            self._in_step = True

    def _step_recorded(self) -> None:
        if self._in_step:
            self._in_step = False
            self._step_lock.release()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        try:
            self._record_step(trainer)
        finally:
            self._step_recorded()

    def _record_step(self, trainer) -> None:
        if self.restartable and (self._last_step is None or self._last_step[0] != trainer.global_step):
            # The position after an optimizer step, where Lightning's own step checkpoints are taken: the loops' and
            # the loader's counters, in new dicts (~0.2 ms on a slow 2-core CPU, once per optimizer step). Before a
            # validation (an epoch's last batch), as the state at its start: a restart from there runs it.
            loops = fit_loop_state(trainer)
            if validation_follows(trainer):
                resume_into_validation(loops)
            self._last_step = (trainer.global_step, loops)
            # The row the loop logs for this step right after this hook: if rank 0 dies in between, the restart
            # (which goes on after the step) writes it from a survivor's values.
            self._step_row = step_row(trainer)
            self._rows_before_validation = None  # no validation since this step (yet)
            self._checkpointers_before_validation = None

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._saving_loops is not None:
            put_fit_loop_state(checkpoint, self._saving_loops)
            if self._saving_row is not None:
                checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {})["step_row"] = self._saving_row
            states = checkpoint.setdefault("callbacks", {})
            for key, before in (self._checkpointers_before_validation or {}).items():  # the restart does it again
                now = states.get(key, {})
                # the file being written is last.ckpt, as now (else the restart's save_last writes last-v1.ckpt)
                states[key] = {**copy.deepcopy(before), "last_model_path": now.get("last_model_path", "")}

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not self.restartable or isinstance(exception, UserError | KeyboardInterrupt | SystemExit):
            return  # SystemExit: a preemption, which saved its own checkpoint, or a deliberate stop
        self._step_recorded()  # a step that raised: the watchdog thread must not wait for it
        watchdogs = [c for c in trainer.callbacks if isinstance(c, RankWatchdog)]
        reported = False
        # A save that the watchdog thread began first (it took the lock) ends the process before this goes on.
        with self._saving if self._saving is not None else contextlib.nullcontext():
            try:
                reported = self._save_after_failure(trainer, exception)
            finally:  # the rank watchdog kept this process alive for the save: it may end it now
                for watchdog in watchdogs:
                    watchdog.save_over(reported)

    def save_from_watchdog(self, trainer, wait: float) -> bool:
        """Write the state of the last step from the rank watchdog's thread: a peer is lost and no collective failed
        (a cut link or a hung host: gloo waits for good, and the training thread with it). The training thread is held
        at its next optimizer step meanwhile, so the weights and the optimizer's state stay those of the recorded
        step. False when the training thread is saving already, or has been inside an optimizer step for ``wait``
        seconds (hung there: its weights may be half updated), and nothing is written here."""
        if self._saving is None or not self._saving.acquire(blocking=False):
            return False
        if not self._step_lock.acquire(timeout=wait):
            self._saving.release()
            return False
        return self._save_after_failure(trainer, None)  # the process ends after it, with both locks held

    def _drop_untracked_checkpoints(self, trainer) -> None:
        """Checkpoints written since the validation that the restart does again (its epoch checkpoint, written on
        rank 0 before a peer died in the same save) and that the saved state does not know: the restart writes them
        again, under the same name (left there, Lightning would name its own ``-v1`` and never remove the first)."""
        known = set()
        for state in self._checkpointers_before_validation.values():
            known |= {*state.get("best_k_models", {}), state.get("best_model_path"), state.get("last_model_path")}
        for callback in trainer.checkpoint_callbacks:
            folder = Path(callback.dirpath) if getattr(callback, "dirpath", None) else None
            for path in folder.glob("*.ckpt") if folder and folder.is_dir() else ():
                if path.name.startswith("last") or str(path) in known:
                    continue
                with contextlib.suppress(OSError):  # another survivor may have removed it first
                    if path.stat().st_mtime >= self._validation_started:
                        path.unlink()

    def _save_after_failure(self, trainer, exception: BaseException | None) -> bool:
        """Write ``last.ckpt`` with the state after the last completed step; True when a line said what happened.
        ``exception``: the failed collective's, or None from the watchdog thread (whose line said what failed)."""
        if trainer.state.fn != "fit" or self._last_step is None or trainer.checkpoint_callback is None:
            return False
        step, loops = self._last_step
        if trainer.global_step != step:
            return False  # failed between an optimizer step and its batch's end: the weights are past the position
        if parallelism(trainer.strategy).sharded:  # fsdp, pipeline: no rank holds the whole state, and the
            # lost one's part is gone with it; the restart goes on from the last checkpoint on disk, as a resume would
            written = trainer.checkpoint_callback.last_model_path
            since = f"the last checkpoint written ({written})" if written and Path(written).is_file() else "the start"
            part = "a stage's layers" if parallelism(trainer.strategy).stages > 1 else "a shard"
            failure = f"{type(exception).__name__} after step {step}" if exception else f"After step {step}"
            say(
                trainer,
                f"[rank {trainer.global_rank}] {failure}: under "
                f"{trainer.strategy.strategy_name} each rank holds {part} of the state and the lost rank's is gone, "
                f"so none is saved here; a restart goes on from {since}",
            )
            return True
        if trainer.validating:  # the weights are the last step's; the restart validates this epoch again in full
            loops = fit_loop_state(trainer)
            restart_validation(loops)
        if self._rows_before_validation is not None:
            # a validation ran (or runs) since the step, and the restart does it again: not its rows
            keep_metrics_rows(trainer, self._rows_before_validation)
        if self._checkpointers_before_validation:
            self._drop_untracked_checkpoints(trainer)
        callback = trainer.checkpoint_callback
        metrics = dict(trainer.callback_metrics, epoch=trainer.current_epoch, step=step)
        path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
        callback.last_model_path = path
        strategy = trainer.strategy
        self._saving_loops = loops
        self._saving_row = self._step_row
        # The process group is broken: no barrier after the save, and every survivor writes (rank 0 may be gone).
        # Under the horovod launcher the save is announced to it before the file is in place (saved_state_announcer):
        # a rank that the launcher kills at any moment of the save leaves what the launcher then says.
        announce = saved_state_announcer(trainer.global_rank, str(path))
        checkpoint_io = strategy.checkpoint_io
        with saving_alone(strategy) as captured:
            try:
                trainer.save_checkpoint(path, weights_only=False)
                if announce is not None and isinstance(checkpoint_io, SafeCheckpointIO):
                    checkpoint_io.save_checkpoint(captured["checkpoint"], path, announce=announce)
                else:
                    checkpoint_io.save_checkpoint(captured["checkpoint"], path)
                    report_saved_state(trainer.global_rank, str(path))  # another checkpoint_io: once written
            except Exception as err:  # noqa: BLE001 - the original failure is what the user must see
                say(trainer, f"[rank {trainer.global_rank}] could not save the state after step {step}: {err}")
                return True
            finally:
                self._saving_loops = self._saving_row = None
        self.saved_after_failure = str(path)
        reason = ""  # from the watchdog thread, its own line said what failed
        if exception is not None:  # shortened at a word, not "the remote w."
            reason = f"{type(exception).__name__}: {textwrap.shorten(str(exception), 200, placeholder=' ...')}. "
        if any(w.cut_off for w in trainer.callbacks if isinstance(w, RankWatchdog)):
            then = REJOIN
        elif restarts_left():
            then = "the launcher restarts the job from there"
        else:
            then = "no restart is left: continue with the same command plus --ckpt_path last"
        say(
            trainer,
            f"[rank {trainer.global_rank}] {reason}Saved the state after step {step} to {path}; {then}",
        )
        return True


class ElasticRunFolder(Callback):
    """The run folder of a torchrun job with ``--max-restarts`` > 0; the CLI adds it (it is not one to leave out).

    Every rank decides, before the process group exists, whether its start continues an unfinished run of the job
    (:func:`app.elastic.run_of`). Rank 0 marks a new run's folder only here, once the process group has formed, so
    no rank can find the mark of its own start and take it for an earlier one. The ranks then check that they
    decided alike: a root that the nodes do not share would otherwise have them issue different collectives.
    """

    def __init__(self, job: TorchrunJob, claimed: list[Path], continued: dict[Path, int], ckpt_path: str | None):
        self.job = job
        self.claimed = list(claimed)  # rank 0's new version folders (empty elsewhere and on a continued run)
        self.continued = dict(continued)  # logger root -> the version this start goes on writing
        self.ckpt_path = ckpt_path
        self.agents = [agent_id()]  # the torchrun agents of the job's ranks, gathered once the process group formed
        self._shape_recorded = False

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        mine = {"continues": sorted((str(root), v) for root, v in self.continued.items()), "ckpt": self.ckpt_path}
        rank0 = trainer.strategy.broadcast(mine, src=0)
        if not trainer.strategy.reduce_boolean_decision(mine == rank0, all=True):
            what = ", ".join(f"{root}/version_{v}" for root, v in rank0["continues"]) or "nothing (a new run)"
            raise UserError(
                f"torchrun start: the ranks disagree on the run they continue (rank 0 continues {what}); the runs' "
                "folder (--trainer.default_root_dir) must be one that every node sees, on a shared filesystem"
            )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            agents = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(agents, agent_id())
            self.agents = agents
        if trainer.is_global_zero:
            for folder in self.claimed:
                mark_run(folder, self.job, agents=self.agents)  # for the restarts to find
        if self.ckpt_path is None and self.continued:
            # A restart with no state to resume from (no survivor could save one) trains the run again from its
            # start: with the first start's global batch, not the one this world size gives by itself.
            root, version = next(iter(self.continued.items()))
            shape = run_shape(root / f"version_{version}")
            for elastic in trainer.callbacks:
                if isinstance(elastic, Elastic) and shape:
                    elastic.started_as = shape

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.claimed and trainer.is_global_zero and not self._shape_recorded:
            self._shape_recorded = True  # once: the first start's shape, which the Elastic callback knows by now
            shape = next((c.state_dict() for c in trainer.callbacks if isinstance(c, Elastic)), None)
            for folder in self.claimed:
                mark_run(folder, self.job, agents=self.agents, shape=shape)

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        folders = self.claimed + [root / f"version_{v}" for root, v in self.continued.items()]
        for folder in folders:
            if (folder / MARKER).is_file():
                mark_run(folder, self.job, finished=True, agents=self.agents)  # a later job starts its own run
