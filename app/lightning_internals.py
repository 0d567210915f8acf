"""Every use of Lightning's private internals, in one place (written against Lightning 2.6).

Each one is here because Lightning 2.6 has no public way to do the thing, and each says what it is for.
``tests/test_lightning_internals.py`` checks that they still exist with the shape used here, so an upgrade that
moves one fails there, by name, instead of somewhere deep in a run. Everything else in ``app/`` uses public API.

1. :class:`ResultsLauncher` — the launcher protocol (``Strategy._configure_launcher`` sets ``strategy._launcher``),
   and ``ddp_spawn``'s handing of rank 0's weights, trainer state and metrics back to the launching process. The
   horovod strategy's self-launch under ``mpirun`` does what ``ddp_spawn`` does, so it reuses that code. A
   restart of its ranks (:func:`resume_from`) replaces the checkpoint argument of the function it launches
   (``Trainer._fit_impl``), found by its parameter name.
2. :func:`log_step_now` — the logger connector: a training step cut short by a signal logs its values the way
   the loop would have after the callbacks' ``on_train_batch_end``.
3. :func:`refresh_last_checkpoint` — ``ModelCheckpoint`` writes ``last.ckpt`` only when it also writes a top-k
   checkpoint; its own saving code, with its own conditions, refreshes ``last.ckpt`` at every save point.
4. :func:`drop_layer_sync` — ``Trainer(sync_batchnorm=True)`` makes the ddp strategies convert BatchNorm layers
   to ``torch.nn.SyncBatchNorm`` in their set-up, which fails on CPU; the SyncBatchNorm callback converts instead.
5. ``CLI._parse_ckpt_path`` (:mod:`app.cli`) — ``LightningCLI``'s step that reads the checkpoint's
   hyperparameters into the config; overridden to apply the template's ``--ckpt_path`` rule.
6. :func:`take_over_local_ranks` — the ``ddp`` launcher's child-process observer SIGKILLs rank 0 as soon as a
   child rank exits with a non-zero code, which after a preemption (143) or a divergence stop is the planned exit.
"""

from __future__ import annotations

import inspect
import subprocess

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


class ResultsLauncher(_MultiProcessingLauncher):
    """A launcher whose ranks hand rank 0's results to the launching process the way ``ddp_spawn``'s do."""

    def collect_rank_zero_results(self, trainer, results):
        """In a rank: what goes back (rank 0's weights, trainer state, callback metrics; None elsewhere)."""
        return self._collect_rank_zero_results(trainer, results)

    def recover_results(self, worker_output, trainer) -> None:
        """In the launching process: load rank 0's weights, state and metrics into ``trainer`` and its module."""
        self._recover_results_in_main_process(worker_output, trainer)


def resume_from(function, args: tuple, kwargs: dict, ckpt_path: str) -> tuple[tuple, dict]:
    """The arguments of the launched ``function`` (``Trainer._fit_impl``) with its ``ckpt_path`` replaced."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    if "ckpt_path" not in inspect.signature(function).parameters:
        raise RuntimeError(f"{function.__qualname__} takes no ckpt_path: this Lightning version cannot be restarted")
    bound.arguments["ckpt_path"] = ckpt_path
    return bound.args, bound.kwargs


def log_step_now(trainer) -> None:
    """Send this training step's logged values to the loggers now (the loop does it after ``on_train_batch_end``)."""
    trainer._logger_connector.on_batch_end()
    trainer._logger_connector.update_train_step_metrics()


def refresh_last_checkpoint(callback, trainer, at_train_epoch_end: bool) -> None:
    """Write ``callback``'s ``last.ckpt`` at this save point, unless Lightning skips saving here.

    ``at_train_epoch_end`` tells which of the two save points (end of the training epoch, end of validation) this
    is; the callback saves at the one Lightning chose for it. Lightning skips sanity checking, fast_dev_run and a
    step already saved (so a top-k save of this step is not repeated).
    """
    if not callback.save_last or callback._should_save_on_train_epoch_end(trainer) != at_train_epoch_end:
        return
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def drop_layer_sync(strategy) -> None:
    """Stop a ddp strategy from converting BatchNorm layers itself (``Trainer(sync_batchnorm=True)``)."""
    if hasattr(strategy, "_layer_sync"):
        strategy._layer_sync = None


def take_over_local_ranks(trainer) -> list[subprocess.Popen]:
    """In rank 0 of a ``ddp`` launch: the processes of the other local ranks, no longer watched by Lightning.

    The launcher's child-process observer (a thread polling every 5 s) watches the launcher's ``procs`` list, the
    same list object; when a child exits non-zero it SIGKILLs every process, rank 0 included. Before all ranks stop
    on purpose with a non-zero code, rank 0 empties that list (the observer then ends) and waits for the children
    itself. Elsewhere (no such launcher) there is nothing to take: an empty list.
    """
    procs = getattr(trainer.strategy.launcher, "procs", None)
    if not isinstance(procs, list):
        return []
    taken = list(procs)
    procs.clear()
    return taken
