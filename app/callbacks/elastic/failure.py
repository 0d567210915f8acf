"""A failure under a restarting launcher, the second of :class:`~app.callbacks.Elastic`'s jobs.

With torchrun ``--max-restarts`` > 0 (or the horovod launcher's restarts), when a rank dies the others' next collective
fails. All ranks hold the same weights and optimizer state after every step, so each survivor writes ``last.ckpt`` at
that moment, with the loop and loader position of the last completed optimizer step (recorded after every step: a few
integers), and exits non-zero; the launcher restarts the job, which resumes from it. Only the step in flight is done
again. Nothing is written per step.

Where no collective would fail (a cut link or a hung host closes no connection, and gloo then waits for good), the
rank watchdog's verdict shuts this rank's connections to the lost one down, and the collective fails at once: the
save is always on the training thread. A failure in a validation (or right before one) saves the state at that
validation's start, with the checkpoint callbacks' state from before it: the restart validates the epoch again.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import textwrap
import time

import torch

from app.callbacks.elastic.metrics import MetricsContinuation
from app.callbacks.progress import console_print
from app.callbacks.rank_watchdog import REJOIN
from app.callbacks.stop_plan import stop_plan
from app.checkpoints.io import SafeCheckpointIO, saved_at_step
from app.checkpoints.saved_state import report_saved_state, saved_state_announcer
from app.checkpoints.storage import run_path
from app.errors import UserError
from app.launch.restarts import restart_after_failure, restarts_left
from app.lightning_internals import (
    fit_loop_state,
    put_fit_loop_state,
    restart_validation,
    resume_into_validation,
    saving_alone,
    step_row,
    validation_follows,
)
from app.parallelism import parallelism


def say(trainer, message: str) -> None:
    """A line from any rank (a survivor may be rank 3): rank 0's above its progress bar, the others' on stderr."""
    if trainer.is_global_zero:
        console_print(trainer, message)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


class SaveOnFailure:
    def __init__(self, metrics: MetricsContinuation) -> None:
        self.metrics = metrics  # which rows of metrics.csv a restart keeps, written beside the state
        self.last_step: tuple[int, dict] | None = None  # (global step, loops' state after it)
        self.step_row: dict | None = None  # the row the loop logs for the last step (step_row)
        self.buffers: dict[str, torch.Tensor] = {}  # the module's buffers after the last step (_record_buffers)
        self.saving_loops: dict | None = None  # while saving: what on_save_checkpoint puts in the checkpoint
        self.saving_row: dict | None = None
        self.checkpointers_before_validation: dict | None = None
        self.validation_started = 0.0  # time.time() at the start of the validation since the last step
        self.saved_after_failure: str | None = None  # the last.ckpt this rank wrote when its collective failed

    def arm(self, trainer) -> None:
        """A lost peer's verdict waits until this rank saved (on_exception)."""
        watchdog = stop_plan(trainer).watchdog
        if watchdog is not None:
            watchdog.expect_save()

    def validation_start(self, trainer) -> None:
        # What the checkpoint callbacks knew before this validation: a failure in it (in its epoch checkpoint's
        # save, say) restarts it, and their state must not say that its step was saved or which file is best.
        self.checkpointers_before_validation = {
            c.state_key: copy.deepcopy(c.state_dict()) for c in trainer.checkpoint_callbacks
        }
        self.validation_started = time.time()

    def train_batch_end(self, trainer, restartable: bool) -> None:
        if restartable:
            self._record_step(trainer)

    def _record_step(self, trainer) -> None:
        if self.last_step is None or self.last_step[0] != trainer.global_step:
            # The position after an optimizer step, where Lightning's own step checkpoints are taken: the loops' and
            # the loader's counters, in new dicts (~0.2 ms on a slow 2-core CPU, once per optimizer step). Before a
            # validation (an epoch's last batch), as the state at its start: a restart from there runs it.
            loops = fit_loop_state(trainer)
            if validation_follows(trainer):
                resume_into_validation(loops)
            self.last_step = (trainer.global_step, loops)
            # The row the loop logs for this step right after this hook: if rank 0 dies in between, the restart
            # (which goes on after the step) writes it from a survivor's values.
            self.step_row = step_row(trainer)
            self._record_buffers(trainer.lightning_module)
            self.metrics.step_done()  # no validation since this step (yet)
            self.checkpointers_before_validation = None

    def _record_buffers(self, module) -> None:
        """The buffers after this step. The forward of the step in flight when a collective fails has moved them
        already (BatchNorm's running statistics, its batch count), while the weights are still the last step's: a
        save of the live buffers made the resume count that forward twice (found by a SLURM node gone silent
        mid-all-reduce, tests/test_slurm_training.py). A copy into the same tensors each step: for ResNet-18,
        9,600 floats, no host sync on a GPU."""
        for name, buffer in module.named_buffers():
            kept = self.buffers.get(name)
            if kept is None or kept.shape != buffer.shape:
                self.buffers[name] = buffer.detach().clone()
            else:
                kept.copy_(buffer.detach())

    def save_checkpoint(self, checkpoint: dict, state_key: str) -> None:
        """on_save_checkpoint: a save after a failure writes the last step's position and buffers, not the loops' and
        the module's current ones."""
        if self.saving_loops is None:
            return
        put_fit_loop_state(checkpoint, self.saving_loops)
        weights = checkpoint.get("state_dict", {})
        for name, buffer in self.buffers.items():
            if name in weights:  # a persistent buffer
                weights[name] = buffer.clone()
        if self.saving_row is not None:
            checkpoint.setdefault("callbacks", {}).setdefault(state_key, {})["step_row"] = self.saving_row
        states = checkpoint.setdefault("callbacks", {})
        for key, before in (self.checkpointers_before_validation or {}).items():  # the restart does it again
            now = states.get(key, {})
            # the file being written is last.ckpt, as now (else the restart's save_last writes last-v1.ckpt)
            states[key] = {**copy.deepcopy(before), "last_model_path": now.get("last_model_path", "")}

    def exception(self, trainer, exception: BaseException) -> None:
        if isinstance(exception, UserError | KeyboardInterrupt | SystemExit):
            return  # SystemExit: a preemption, which saved its own checkpoint, or a deliberate stop
        reported = False
        try:
            reported = self._save_after_failure(trainer, exception)
        finally:  # the rank watchdog kept this process alive for the save: it may end it now
            if (watchdog := stop_plan(trainer).watchdog) is not None:
                watchdog.save_over(reported)

    def _drop_untracked_checkpoints(self, trainer) -> None:
        """Checkpoints written since the validation that the restart does again (its epoch checkpoint, written on
        rank 0 before a peer died in the same save) and that the saved state does not know: the restart writes them
        again, under the same name (left there, Lightning would name its own ``-v1`` and never remove the first)."""
        known = set()
        for state in self.checkpointers_before_validation.values():
            known |= {*state.get("best_k_models", {}), state.get("best_model_path"), state.get("last_model_path")}
        for callback in trainer.checkpoint_callbacks:
            folder = run_path(callback.dirpath) if getattr(callback, "dirpath", None) else None
            for path in folder.glob("*.ckpt") if folder and folder.is_dir() else ():
                if path.name.startswith("last") or str(path) in known:
                    continue
                with contextlib.suppress(OSError):  # another survivor may have removed it first
                    if path.stat().st_mtime >= self.validation_started:
                        path.unlink()

    def _save_after_failure(self, trainer, exception: BaseException) -> bool:
        """Write ``last.ckpt`` with the state after the last completed step; True when a line said what happened.
        ``exception``: the failed collective's."""
        if trainer.state.fn != "fit" or self.last_step is None or trainer.checkpoint_callback is None:
            return False
        step, loops = self.last_step
        if trainer.global_step != step:
            return False  # failed between an optimizer step and its batch's end: the weights are past the position
        if parallelism(trainer.strategy).sharded:
            say_nothing_saved(trainer, step, exception)
            return True
        if trainer.validating:  # the weights are the last step's; the restart validates this epoch again in full
            loops = fit_loop_state(trainer)
            restart_validation(loops)
        self.metrics.keep_rows_before_validation(trainer)
        if self.checkpointers_before_validation:
            self._drop_untracked_checkpoints(trainer)
        callback = trainer.checkpoint_callback
        metrics = dict(trainer.callback_metrics, epoch=trainer.current_epoch, step=step)
        path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
        callback.last_model_path = path
        self.saving_loops, self.saving_row = loops, self.step_row
        try:
            newer = save_alone(trainer, path, step)
        except Exception as err:  # noqa: BLE001 - the original failure is what the user must see
            say(trainer, f"[rank {trainer.global_rank}] could not save the state after step {step}: {err}")
            return True
        finally:
            self.saving_loops = self.saving_row = None
        if newer is not None and newer > step:
            saved = f"{path} holds step {newer}, later than this rank's step {step}, and stays as it is"
        elif newer == step and trainer.global_rank != 0:
            saved = f"{path} holds step {step} already, and stays as it is"
        else:
            self.saved_after_failure = str(path)
            saved = f"Saved the state after step {step} to {path}"
        start = saved_line_start(trainer, exception)
        say(trainer, f"{start}{saved}; {what_then(trainer, verdict_said=start.startswith('error:'))}")
        return True


def say_nothing_saved(trainer, step: int, exception: BaseException) -> None:
    """fsdp, pipeline: no rank holds the whole state, and the lost one's part is gone with it; the restart goes on
    from the last checkpoint on disk, as a resume would."""
    written = trainer.checkpoint_callback.last_model_path
    since = f"the last checkpoint written ({written})" if written and run_path(written).exists() else "the start"
    part = "a stage's layers" if parallelism(trainer.strategy).stages > 1 else "a shard"
    failure = f"{type(exception).__name__} after step {step}"
    say(
        trainer,
        f"[rank {trainer.global_rank}] {failure}: under {trainer.strategy.strategy_name} each rank holds {part} of the "
        f"state and the lost rank's is gone, so none is saved here; a restart goes on from {since}",
    )


def save_alone(trainer, path: str, step: int) -> int | None:
    """``trainer.save_checkpoint`` on a broken process group: no barrier after the save, and every survivor writes
    (rank 0 may be gone). Returns the step of a ``last.ckpt`` found in place and kept (a later one, or, on a rank
    other than 0, one of the same step), or None.

    Under the horovod launcher the save is announced to it before the file is in place (saved_state_announcer): a
    rank that the launcher kills at any moment of the save leaves what the launcher then says. A node cut off from a
    shared run folder saves late: the nodes that went on may have written a later last.ckpt by then, which stays
    (checked just before the rename)."""
    strategy, newer = trainer.strategy, None
    checkpoint_io = strategy.checkpoint_io
    with saving_alone(strategy) as captured:
        trainer.save_checkpoint(path, weights_only=False)
        if not isinstance(checkpoint_io, SafeCheckpointIO):
            checkpoint_io.save_checkpoint(captured["checkpoint"], path)
            report_saved_state(trainer.global_rank, str(path))  # another checkpoint_io: once written
            return None

        def later() -> bool:
            nonlocal newer
            newer = saved_at_step(path)
            # the same step written by rank 0 stays too: ranks' BatchNorm statistics are their own under ddp, and an
            # unbroken run saves rank 0's
            return newer is not None and (newer > step or (newer == step and trainer.global_rank != 0))

        announce = saved_state_announcer(trainer.global_rank, str(path))
        checkpoint_io.save_checkpoint(captured["checkpoint"], path, announce=announce, unless=later)
    return newer


def saved_line_start(trainer, exception: BaseException) -> str:
    """What the survivor's line says first: the failed collective's error; nothing more where the watchdog shut the
    connections down, whose own line said what failed (a cut-off node: its verdict, so that verdict and save are one
    line)."""
    watchdog = stop_plan(trainer).watchdog
    if watchdog is not None and watchdog.closed:
        return f"{watchdog.verdict} " if watchdog.verdict else f"[rank {trainer.global_rank}] "
    why = textwrap.shorten(str(exception), 200, placeholder=" ...")  # at a word, not "the remote w."
    return f"[rank {trainer.global_rank}] {type(exception).__name__}: {why}. "


def what_then(trainer, verdict_said: bool) -> str:
    """What comes after the survivor's save: the cut-off node's way back (``verdict_said``: its line already said it
    lost the network), the launcher's restart, or the command."""
    watchdog = stop_plan(trainer).watchdog
    if watchdog is not None and watchdog.cut_off:
        return REJOIN.split(": ", 1)[1] if verdict_said else REJOIN
    if restarts_left():
        return f"{restart_after_failure()} from there"
    return "no restart is left: continue with the same command plus --ckpt_path last"
