"""Preemption: on SIGTERM or SIGINT, every rank finishes its step, ``last.ckpt`` is written, and the run exits 143/130.

Clusters stop jobs with SIGTERM (``docker stop``, Kubernetes, SLURM) and people with Ctrl-C (SIGINT). Lightning
2.6 exits 0 on SIGTERM without a checkpoint, so a restart policy reads a preempted run as finished, and its
handler broadcasts from inside the signal handler, which deadlocks when a rank other than 0 gets the signal.
This callback replaces it for training:

- The handler only records the signal (and prints one line; while a progress bar is live in the terminal, the line
  waits for the end of the step and prints above the bar, which would draw over it); nothing runs inside it.
- After each training step and each validation batch the ranks agree whether any of them got a signal: a
  one-number all-reduce on a gloo group of its own, issued without waiting and read one batch later, so it never
  stalls the GPU. All ranks therefore stop after the same batch, at most two batches after the signal, in
  training and in validation alike (a container gets 10 s between SIGTERM and SIGKILL, Kubernetes 30 s).
- Then ``last.ckpt`` is written (atomically: :mod:`app.checkpoints.io`) with the loop and loader state, so
  ``python cli.py fit ... --ckpt_path last`` continues with the next batch, and every rank exits with
  ``128 + signal`` (143 for SIGTERM, 130 for SIGINT). A stop in validation keeps the weights of the last
  training step, and the resumed run validates that epoch again from its first batch.
- With gradient accumulation, a stop agreed inside a window waits for the window's last batch (its optimizer step):
  the gradients of the window so far are in no checkpoint, and stopping there lost them.
- A second signal stops at once, without a checkpoint (same exit code); one after the checkpoint is written (SLURM
  stops the job it requeues) changes nothing.
- In a SLURM batch job, SIGUSR1 stops the same way too: it is the warning ``#SBATCH --signal=USR1@SECONDS`` sends
  before the time limit. After the save, rank 0 asks SLURM to requeue the job (``scontrol requeue``), and so after
  a SIGTERM at the time limit; the requeued job's next start goes on from ``last.ckpt`` in the same run folder, with
  no flag added (app/launch/slurm.py). A SIGTERM of ``scancel`` saves and ends the job.
- A resumed ``--trainer.precision=64-true`` run takes the checkpoint's float64 weights as they were saved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.callbacks.progress import console_print, live_bar_console
from app.callbacks.stop_plan import stop_plan
from app.callbacks.tracker_runs import end_tracker_runs
from app.checkpoints.storage import run_path
from app.errors import Preempted
from app.launch.early_signals import catch_early_signals, take_early_signals
from app.launch.launcher import SLURM_WARNING_SIGNAL, slurm_job
from app.launch.restarts import torchrun_restarts_possible
from app.launch.slurm import after_stop
from app.lightning_internals import (
    fit_loop_of,
    give_back_stop_flag,
    log_step_now,
    restart_validation,
    resume_into_validation,
    take_over_local_ranks,
    take_over_stop_flag,
    validation_follows,
)

# SLURM sends a job's tasks SIGTERM twice, about 50 ms apart, at its time limit and on a preemption: a repeat within
# this time is one stop, not the second signal that stops at once without a checkpoint
SLURM_REPEAT_S = 1.0
WAIT_FOR_RANKS_S = 25  # rank 0 waits this long for its local ranks to exit after a preemption, then kills them


def wait_for_local_ranks(processes: list[subprocess.Popen]) -> None:
    """Rank 0 of a ``ddp`` launch started the other local ranks: when all ranks stop together, it returns only after
    they have exited too (or kills them after ``WAIT_FOR_RANKS_S``), so the job's exit is the whole run's exit.
    ``processes`` come from :func:`take_over_local_ranks`, taken before any rank can exit."""
    for process in processes:
        try:
            process.wait(timeout=WAIT_FOR_RANKS_S)
        except subprocess.TimeoutExpired:
            process.kill()


def _how_to_continue(trainer, signum: int) -> str:
    # torchrun stops the workers with SIGTERM to take in a node that joins, then restarts
    if torchrun_restarts_possible():
        return "torchrun resumes from it when it restarts the job; after the job ended, the same command continues it"
    job = slurm_job()
    if job is not None and trainer.is_global_zero:  # one rank asks SLURM, once the state is saved
        if signum == SLURM_WARNING_SIGNAL:  # it reached the ranks alone (wandb-core ignores it); the requeue will not
            end_tracker_runs(trainer, exit_code=128 + signum)
        return after_stop(job, signum)
    return "Continue with the same command plus --ckpt_path last"


class Preemption(Callback):
    stop_role = "preemption"  # in the trainer's stop plan (app/callbacks/stop_plan.py)

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGINT")) -> None:
        """
        Args:
            signals: The signals that stop training with a checkpoint.
        """
        self.signals = tuple(signal.Signals[name] for name in signals)
        self.received = 0  # the first signal number received by this process, 0 for none
        self._saved = False  # the stop's checkpoint is written: a later signal changes nothing
        self.received_at = 0.0  # its time.monotonic()
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._previous: dict[int, object] = {}
        self._rank = 0
        self._stopping_in_validation = False
        self._stopping_before_validation = False  # stopped after a batch that a validation follows
        self._trainer: Trainer | None = None
        self._announce = ""  # the "received" line, waiting for the next step's end while a bar is live
        self._local_ranks: list[subprocess.Popen] = []
        self._decided = 0  # a stop agreed inside an accumulation window, carried out at the window's end
        self._step_seen = -1  # the optimizer step count at the last training batch's end

    def __setstate__(self, state: dict) -> None:
        # Unpickled in a rank that a launcher started (ddp_spawn's, the horovod self-launch's): a stop signal that
        # comes before the handlers are installed is remembered and acted on then, not the end of the rank (the
        # launching process passes SIGTERM on as soon as it gets it: app/launch/signals.py).
        self.__dict__.update(state)
        if threading.current_thread() is threading.main_thread():
            catch_early_signals(self.signals)

    # ---------------------------------------------------------------- setup
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        stop_plan(trainer).join(trainer, self)  # the rank watchdog reads the signal received
        if stage != "fit":
            return
        if str(trainer.precision).startswith("64"):
            # Lightning restores a checkpoint's weights (after this hook) before its precision plugin makes the
            # module float64: they were copied into float32 parameters first, and a resumed float64 run drifted from
            # an unbroken one (6.7e-4). Made float64 now, the module takes them as saved; the plugin's own
            # conversion later is a no-op. (The checkpoint to resume from is not known yet here.)
            trainer.precision_plugin.convert_module(pl_module)
        self._rank, self._trainer = trainer.global_rank, trainer
        self._decided = 0
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # all ranks call setup together; CPU, so no GPU sync
        if trainer.checkpoint_callback is None:
            rank_zero_info("Preemption: checkpointing is off, so a SIGTERM/SIGINT stops training without a checkpoint")

    @override
    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._install()

    # validate, test and predict: after Lightning registered its own SIGTERM handler (in Trainer._run)
    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            self._install_evaluation_stop(trainer)

    @override
    def on_test_start(self, trainer, pl_module) -> None:
        self._install_evaluation_stop(trainer)

    on_predict_start = on_test_start

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._step_seen = trainer.global_step  # restored by now, on a resumed run
        self._install()

    def _stop_signals(self) -> tuple[signal.Signals, ...]:
        """The signals handled: the configured ones, and in a SLURM job SLURM's warning before the time limit
        (instead of Lightning's handler for it, which saves from inside the handler, on rank 0's own)."""
        if slurm_job() is not None and SLURM_WARNING_SIGNAL not in self.signals:
            return (*self.signals, SLURM_WARNING_SIGNAL)
        return self.signals

    def _install(self) -> None:
        # After Lightning registered its own SIGTERM handler (in Trainer._run); Lightning restores the originals.
        if not self._previous:
            for signum in self._stop_signals():
                self._previous[signum] = signal.signal(signum, self._handle)
            early = take_early_signals(self._stop_signals())
            # Lightning's SIGTERM handler is replaced, so its flag's broadcast at every batch goes: one agreement per
            # step, this callback's (a flag it set since Trainer._run began is a signal received while starting)
            if signal.SIGTERM in self._previous and take_over_stop_flag(self._trainer):
                early = early or [(signal.SIGTERM, time.monotonic())]
            if early and not self.received:  # sent while the rank was starting: acted on now
                self._handle(early[0][0], None, while_starting=early[0][1])

    def _install_evaluation_stop(self, trainer) -> None:
        """validate, test and predict have nothing to save: a stop signal ends every rank at once, as it ends any
        program (exit 143 for SIGTERM; Ctrl-C raises KeyboardInterrupt where Python's handler had it, else 130).
        Before, a signal kept since a rank started (ddp_spawn's and the horovod self-launch's ranks) was never acted
        on, so Ctrl-C was ignored to the end of the evaluation; and under ddp a SIGTERM to rank 0 stopped it alone
        and left rank 1 waiting for it."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        stage = trainer.state.fn.value  # validate, test, predict

        def stop(signum: int, frame) -> None:
            if trainer.global_rank == 0:
                os.write(2, f"{signal.Signals(signum).name}: {stage} stopped (nothing to save)\n".encode())
            for process in take_over_local_ranks(trainer):  # ddp's other local ranks, started by this one
                with contextlib.suppress(OSError):
                    process.send_signal(signum)
            if self._previous.get(signum) is signal.default_int_handler:  # Python's own Ctrl-C (a notebook's too)
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # this process ends of it, as without a handler

        for signum in self.signals:  # (not SLURM's warning before the time limit: nothing to do for it here)
            if signal.getsignal(signum) != signal.SIG_IGN:  # (ignored: a background job's SIGINT stays ignored)
                self._previous.setdefault(signum, signal.signal(signum, stop))
        early = take_early_signals(self.signals)
        if early:  # sent while the rank was starting
            stop(early[0][0], None)

    def _handle(self, signum: int, frame, while_starting: float = 0.0) -> None:
        """The signal handler; ``while_starting``: the ``time.monotonic()`` of a signal kept since the rank started."""
        if self._saved:  # the state is written and the rank is on its way out (SLURM stops a job it requeues)
            return
        repeat = self.received == signum == signal.SIGTERM and time.monotonic() - self.received_at < SLURM_REPEAT_S
        if repeat and slurm_job() is not None:  # SLURM's own repeat (time limit, preemption): one stop
            return
        if self.received:  # a second signal: stop now
            name = signal.Signals(signum).name
            os.write(2, f"[rank {self._rank}] second {name}: stopping now, without a checkpoint\n".encode())
            raise Preempted(signum, checkpointed=False)
        self.received, self.received_at = signum, while_starting or time.monotonic()
        name = signal.Signals(signum).name
        # (a checkpoint needs every rank: a launcher that lost one worker sends the others SIGTERM, torchrun does)
        if signum == SLURM_WARNING_SIGNAL and signum not in self.signals:
            name += " (SLURM's warning before the time limit)"
        if while_starting:  # kept since the process's first lines (app/launch/early_signals.py)
            name += " while starting"
        message = f"[rank {self._rank}] received {name}: stopping after this step, with a checkpoint if every rank "
        message += "finishes it"
        message += " (Ctrl-C again: stop now)" if signum == signal.SIGINT else ""
        if self._trainer is not None and live_bar_console(self._trainer) is not None:
            self._announce = message  # printed above the bar after this step: a line written now would be drawn over
        else:
            os.write(2, f"{message}\n".encode())  # not print(): the signal may have interrupted a print

    def _say_received(self, trainer) -> None:
        if self._announce:
            console_print(trainer, self._announce)
            self._announce = ""

    # ---------------------------------------------------------------- the decision, once per step
    def _agreed_signal(self, trainer) -> int:
        """The signal to stop on, the same on every rank (0: go on)."""
        if self._group is None and trainer.world_size > 1:  # no torch.distributed (horovod's own backend)
            stop = trainer.strategy.reduce_boolean_decision(bool(self.received), all=False)
            return (self.received or signal.SIGTERM) if stop else 0
        if self._group is None:
            return self.received
        decided = self._collect()
        flag = torch.tensor([self.received], dtype=torch.int64)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return decided

    def _collect(self) -> int:
        if self._pending is None:
            return 0
        work, flag = self._pending
        work.wait()
        self._pending = None
        return int(flag.item())

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._say_received(trainer)
        signum = self._decided or self._agreed_signal(trainer)
        stepped = trainer.global_step != self._step_seen  # this batch ended a gradient-accumulation window
        self._step_seen = trainer.global_step
        if not signum:
            return
        if not stepped:
            # Inside an accumulation window: its gradients so far are in no checkpoint, so a stop here would drop
            # them. Every rank decided on the same batch and sees the same steps: all train on to the window's end.
            self._decided = signum
            return
        self._collect()  # every rank issued this step's reduction: finish it before leaving
        self._local_ranks = take_over_local_ranks(trainer)  # before any rank can exit 143
        # The loop will not come back to this batch: do what it would do after the callbacks' hook (the module's
        # hook logs this step's train/loss, then the values go to the loggers), so no logged value is lost. The
        # checkpoint is then taken where Lightning's own step checkpoints are (before the batch counts as completed).
        pl_module.on_train_batch_end(outputs, batch, batch_idx)
        log_step_now(trainer)
        self._stopping_before_validation = validation_follows(trainer)  # the resumed run must run it
        path = self._save(trainer)
        name = signal.Signals(signum).name
        console_print(
            trainer,
            f"{name}: stopped after step {trainer.global_step} (epoch {trainer.current_epoch}); saved {path}. "
            f"{_how_to_continue(trainer, signum)}. Exit code {128 + signum}.",
        )
        raise Preempted(signum)

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if trainer.state.fn != "fit":
            return
        self._say_received(trainer)
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        if trainer.sanity_checking and signum == SLURM_WARNING_SIGNAL:
            # the time limit is still ahead: train the first step and stop there, with a checkpoint and a requeue
            # (the reduction just issued stays pending: the first step's hook reads it)
            return
        self._collect()
        self._local_ranks = take_over_local_ranks(trainer)
        if trainer.sanity_checking:  # before the first step: nothing to save
            console_print(trainer, f"{signal.Signals(signum).name}: stopped before training. Exit code {128 + signum}.")
            raise Preempted(signum, checkpointed=False)
        self._stopping_in_validation = True
        path = self._save(trainer)
        console_print(
            trainer,
            f"{signal.Signals(signum).name}: stopped in the validation after step {trainer.global_step} (epoch "
            f"{trainer.current_epoch}); saved {path}. {_how_to_continue(trainer, signum)}, which validates this "
            f"epoch again. Exit code {128 + signum}.",
        )
        raise Preempted(signum)

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._stopping_in_validation:
            restart_validation(fit_loop_of(checkpoint))  # the resumed run validates the epoch in full
        elif self._stopping_before_validation:
            resume_into_validation(fit_loop_of(checkpoint))

    def _save(self, trainer) -> Path | None:
        callback = trainer.checkpoint_callback
        if callback is None:
            return None
        metrics = dict(trainer.callback_metrics, epoch=trainer.current_epoch, step=trainer.global_step)
        path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
        callback.last_model_path = path  # part of the checkpoint's callback state, as Lightning's save_last does
        # every rank calls it; rank 0 writes, then all wait at a barrier
        trainer.save_checkpoint(path, weights_only=False)
        if getattr(trainer.strategy, "background", None) is not None:  # fsdp's async_save: written before it is said
            trainer.strategy.background.settle(wait=True)
        self._saved = True
        return run_path(path)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, Preempted):
            return
        if exception.checkpointed:
            wait_for_local_ranks(self._local_ranks)  # they stop after the same batch
        else:  # a second signal: stop now, the other local ranks too
            for process in self._local_ranks:
                process.kill()

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        self._collect()  # the last step's reduction, issued by every rank

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._handle or stage != "fit":  # (evaluation's handler: a closure)
                signal.signal(signum, handler)
        self._previous.clear()
        if stage == "fit":
            give_back_stop_flag(trainer)
        if self._group is not None:
            self._pending = None
            self._group = None
