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
5. ``CkptPathRule._parse_ckpt_path`` (:mod:`app.run.resume`) — ``LightningCLI``'s step that reads the checkpoint's
   hyperparameters into the config; overridden to apply the template's ``--ckpt_path`` rule.
6. :func:`take_over_local_ranks` — the ``ddp`` launcher's child-process observer SIGKILLs rank 0 as soon as a
   child rank exits with a non-zero code, which after a preemption (143) or a divergence stop is the planned exit;
   the rank watchdog takes them over when it starts (it names a lost rank and exits 1 instead).
7. The fit loop's counters, which Lightning checkpoints but does not document: :func:`step_row` (the row the loop
   logs after this step), :func:`step_values_read` (is this
   step's logged value read: the loop's last-batch flag, ``val_check_batch``, ``total_batch_idx``),
   :func:`shift_batch_count` (an elastic restart lines the batch count up with the
   re-dealt loader), :func:`fit_loop_state` (the loops' state after a step); and its training loader:
   :func:`apply_loader_position` (a loader built before the restore gets its saved position).
8. The layout of ``checkpoint["loops"]``: :func:`epochs_done`,
   :func:`fit_loop_of`, :func:`restart_validation` (a stop or a lost rank in validation
   restarts it in full), :func:`validation_follows` and :func:`resume_into_validation` (one right before a
   validation runs it), :func:`put_fit_loop_state` (the state of the last completed step).
9. :func:`saving_alone` — ``Trainer.save_checkpoint`` on a broken process group: the strategy's barrier and its
   rank-0-only save, replaced for the duration of one save.
10. :func:`spawned_ranks_launcher` — ``ddp_spawn``'s launcher (the exact class ``_MultiProcessingLauncher``) in the
   launching process, whose SIGTERM the template passes on to the ranks it spawned (:mod:`app.launch.signals`).
11. :func:`free_strategy_name` — Lightning's accelerator connector refuses any strategy registered under a name
   its own ``FSDPStrategy`` registered (``"fsdp"``) unless the accelerator is a GPU; the template's ``fsdp``
   (app/strategies/fsdp.py) runs on CPU too, so the name leaves that list when the template takes it over.
12. :func:`take_over_stop_flag` — Lightning 2.6's training loop broadcasts rank 0's SIGTERM flag and reads it back
   with ``.item()`` at every batch when several processes train (a blocking collective per step, and a host sync
   on GPUs: Lightning issue 21487). While Preemption has the stop signals it is the one agreement per step, and the
   broadcast is skipped.
13. :func:`app.callbacks.run_report.skip_inherited_hooks` — Lightning's ``_call_callback_hooks`` passes by a
   callback's hook that is not callable: the per-step hooks a callback inherits from ``Callback`` are set to None.

Private names of torch, Lightning, torchvision and argparse used elsewhere in the machinery (``app/``) and in
``bench/`` are listed in :data:`PRIVATE_USES`, each with the class or module that has it and why (a task lists its
own, in the same form, as ``PRIVATE_USES`` in its package's ``__init__.py``: a fork that replaces the task replaces
its list): the strategies' launcher protocol, and a
few that no public API replaces (private string keys included: ``"_class_path"``). Library objects whose public
methods or attributes the template patches at run time are listed in :data:`RUN_TIME_PATCHES`.
``tests/test_lightning_internals.py`` reads every file's syntax tree (tests/private_api.py) and fails on a use that
is not listed here, and checks that each listed name still exists where it says.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
from collections.abc import Iterator

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

# (file, private name) -> (where the name lives: "module:Class" or "module", why no public API serves)
PRIVATE_USES: dict[tuple[str, str], tuple[str, str]] = {
    # The launcher protocol: a strategy picks its launcher by overriding _configure_launcher, which sets
    # self._launcher (Lightning's own strategies do the same; there is no public hook).
    ("app/strategies/dp.py", "_configure_launcher"): (
        "lightning.pytorch.strategies:Strategy",
        "no launcher: one process",
    ),
    ("app/strategies/dp.py", "_launcher"): ("lightning.pytorch.strategies:Strategy", "the launcher protocol"),
    ("app/strategies/horovod.py", "_configure_launcher"): (
        "lightning.pytorch.strategies:Strategy",
        "mpirun's launcher, or a self-launch of the ranks under mpirun",
    ),
    ("app/strategies/horovod.py", "_launcher"): ("lightning.pytorch.strategies:Strategy", "the launcher protocol"),
    ("app/strategies/pipeline.py", "_configure_launcher"): (
        "lightning.pytorch.strategies:DDPStrategy",
        "DDP's launcher for the stages' processes (super()._configure_launcher())",
    ),
    ("app/strategies/model_parallel.py", "_configure_launcher"): (
        "lightning.pytorch.strategies:DDPStrategy",
        "DDP's launcher for the model-parallel strategies' processes (super()._configure_launcher())",
    ),
    ("app/strategies/launchers/mpirun.py", "_strategy"): (
        "lightning.pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher",
        "the launcher's strategy, which ResultsLauncher (above) inherits and mpirun's launcher reads",
    ),
    # Lightning's optimizer wrapper: torch's distributed-checkpoint state dicts want the torch optimizer inside.
    ("app/strategies/fsdp.py", "_optimizer"): (
        "lightning.pytorch.core.optimizer:LightningOptimizer",
        "the wrapped optimizer",
    ),
    ("app/strategies/pipeline.py", "_optimizer"): (
        "lightning.pytorch.core.optimizer:LightningOptimizer",
        "the wrapped optimizer",
    ),
    # The keyword arguments DDPStrategy hands DistributedDataParallel (no public accessor); read where we wrap.
    ("app/strategies/ddp.py", "_ddp_kwargs"): (
        "lightning.pytorch.strategies:DDPStrategy",
        "the strategy's DistributedDataParallel arguments, passed on in _setup_model",
    ),
    # Where DDPStrategy wraps the model (configure_ddp calls it): overridden to wrap on the current CUDA stream.
    ("app/strategies/ddp.py", "_setup_model"): (
        "lightning.pytorch.strategies:DDPStrategy",
        "DDP built on the forwards' stream, as torch advises for compiled backward passes",
    ),
    # LightningCLI's step that reads a checkpoint's hyperparameters into the config (item 5 above).
    ("app/run/resume.py", "_parse_ckpt_path"): ("lightning.pytorch.cli:LightningCLI", "the --ckpt_path rule"),
    # jsonargparse keeps its arguments in argparse's list; neither has a public one.
    ("app/run/arguments.py", "_actions"): ("argparse:ArgumentParser", "the flags a bad value or a typo belongs to"),
    # Neither Module.compile() (which sets _compiled_call_impl) nor torch.compile's wrapper (which keeps the module in
    # _orig_mod) leaves a public mark on a module: dp refuses a compiled one.
    ("app/strategies/dp.py", "_compiled_call_impl"): ("torch.nn:Module", "is this module compiled in place"),
    ("app/strategies/dp.py", "_orig_mod"): (
        "torch._dynamo.eval_frame:OptimizedModule",
        "is this torch.compile's wrapper",
    ),
    # Dynamo's counters (graphs compiled, guard failures, graph breaks, CUDA graphs skipped): torch has no public
    # view of what torch.compile did, which the run report prints at the end of training.
    ("app/callbacks/run_report.py", "counters"): ("torch._dynamo.utils", "graphs, graph breaks, CUDA graph skips"),
    ("app/callbacks/run_report.py", "guard_failures"): ("torch._dynamo.utils", "recompiles"),
    # torch's common base of BatchNorm1d/2d/3d and SyncBatchNorm: isinstance over every BatchNorm at once.
    ("app/callbacks/activation_checkpointing.py", "_BatchNorm"): ("torch.nn.modules.batchnorm", "every BatchNorm"),
    ("app/callbacks/sync_batchnorm.py", "_BatchNorm"): ("torch.nn.modules.batchnorm", "every BatchNorm"),
    ("app/strategies/fsdp.py", "_BatchNorm"): ("torch.nn.modules.batchnorm", "every BatchNorm"),
    ("app/callbacks/sync_batchnorm.py", "_check_input_dim"): (
        "torch.nn.modules.batchnorm:_BatchNorm",
        "the input check every BatchNorm's forward calls, overridden to take any dimension >= 2",
    ),
    # Private keys: LightningCLI records the class of a module and of a data module in their hyperparameters under
    # "_class_path"; a checkpoint's writer is read from there. torch's schedulers keep the lr they last set in
    # "_last_lr" of their state dict; a resume does not count it as a changed setting.
    ("app/checkpoints/io.py", "_class_path"): ("lightning.pytorch.cli", "the class that wrote a checkpoint"),
    ("app/run/resume.py", "_class_path"): ("lightning.pytorch.cli", "the data module class that wrote a checkpoint"),
    ("app/callbacks/resume_settings.py", "_last_lr"): (
        "torch.optim.lr_scheduler:LRScheduler",
        "the lr a scheduler last set, in its state dict: not a setting",
    ),
    # The benchmarks: what torch.compile did (as the run report reads it), and the pipeline stage's base class.
    ("bench/cudagraphs.py", "counters"): ("torch._dynamo.utils", "graphs and graph breaks of a probe's variant"),
    ("bench/model_parallel.py", "_PipelineStageBase"): (
        "torch.distributed.pipelining.stage",
        "the stages' common base, whose communication the bench times",
    ),
}

# (file, public name) -> (the library class whose attribute or method is replaced on a live object, and why): each
# is a run-time patch of a library object, which an upgrade can break as silently as a private name.
RUN_TIME_PATCHES: dict[tuple[str, str], tuple[str, str]] = {
    ("app/callbacks/elastic/metrics.py", "log_metrics"): (
        "lightning.fabric.loggers.logger:Logger",
        "each logger's calls counted, so that a restart writes metrics.csv's missing rows once",
    ),
    ("app/callbacks/elastic/world_size.py", "accumulate_grad_batches"): (
        "lightning.pytorch.trainer.trainer:Trainer",
        "a restart on fewer devices keeps the global batch (the loop reads it at every batch)",
    ),
    ("app/callbacks/elastic/world_size.py", "base_lrs"): (
        "torch.optim.lr_scheduler:LRScheduler",
        "the scheduler's base lrs scaled with the lr when the world size changes",
    ),
    ("app/callbacks/elastic/failure.py", "last_model_path"): (
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint",
        "a survivor's save recorded as last.ckpt, as save_last does",
    ),
    ("app/callbacks/preemption.py", "last_model_path"): (
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint",
        "the stop's save recorded as last.ckpt, as save_last does",
    ),
    ("app/strategies/launchers/mpirun.py", "config_filename"): (
        "lightning.pytorch.cli:SaveConfigCallback",
        "a restart writes config.restartN.yaml beside the first start's config.yaml",
    ),
    ("app/strategies/launchers/mpirun.py", "overwrite"): (
        "lightning.pytorch.cli:SaveConfigCallback",
        "a restart writes config.restartN.yaml beside the first start's config.yaml",
    ),
    ("app/strategies/pipeline_stages.py", "log"): (
        "lightning.pytorch.core.module:LightningModule",
        "the step run only to find the network's input logs nothing",
    ),
    ("app/strategies/pipeline_stages.py", "log_dict"): (
        "lightning.pytorch.core.module:LightningModule",
        "the step run only to find the network's input logs nothing",
    ),
}


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


def step_row(trainer) -> dict | None:
    """In ``on_train_batch_end``: the row the loop sends to the loggers right after the hook (this step's logged
    values as numbers, its logger step and epoch), or None when it sends none at this batch."""
    connector = trainer._logger_connector
    accumulating = trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization
    if accumulating or not (connector.should_update_logs or trainer.fast_dev_run):
        return None
    values = {k: float(v) for k, v in connector.metrics["log"].items() if getattr(v, "numel", lambda: 1)() == 1}
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    return {"step": int(values.pop("step", step)), "epoch": trainer.current_epoch, "values": values}


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
    same list object; when a child exits non-zero it SIGKILLs every process, rank 0 included (exit 137, no line of
    ours, no cleanup). The rank watchdog takes the children over when it starts (the observer then ends: it reads an
    empty list as all finished), and so does rank 0 before all ranks stop on purpose with a non-zero code; it then
    waits for them itself. Every call returns all the processes taken so far. Elsewhere (no such launcher) there is
    nothing to take: an empty list.
    """
    launcher = trainer.strategy.launcher
    procs = getattr(launcher, "procs", None)
    if not isinstance(procs, list):
        return []
    taken = getattr(launcher, "_taken_by_template", [])
    taken += procs
    procs.clear()
    launcher._taken_by_template = taken
    return list(taken)


# ---------------------------------------------------------------------------------------- 7. the fit loop's counters
def step_values_read(trainer, batch_idx: int) -> bool:
    """Whether a per-step value logged now is read: Lightning writes the step's values to the loggers (every
    ``log_every_n_steps`` optimizer steps, at a stop, in ``fast_dev_run``), or the loop leaves training after this
    batch (the epoch's last batch, ``max_steps``, a validation), where callbacks read ``callback_metrics``. Every
    other step's value would be overwritten unread. Cases not recognised here count as read. Call it from
    ``on_train_batch_end``.
    """
    loop = trainer.fit_loop.epoch_loop
    every = trainer.log_every_n_steps
    # In on_train_batch_end global_step already counts this batch's optimizer step: it is the "+ 1" of
    # Lightning's own test (batches that stepped so far, this one included).
    if trainer.fast_dev_run or trainer.should_stop or (every and trainer.global_step % every == 0):
        return True
    if loop.batch_progress.is_last_batch or trainer.global_step == trainer.max_steps:
        return True
    every_batches = trainer.val_check_batch  # None: time-based validation; inf: a loader without a length
    if every_batches is None or every_batches == float("inf"):
        return True
    index = loop.total_batch_idx if trainer.check_val_every_n_epoch is None else batch_idx
    return (index + 1) % int(every_batches) == 0


def shift_batch_count(trainer, shift: int) -> None:
    """Move the training batch counters (this epoch's and the total) by ``shift`` batches, all by the same amount."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.current, progress.total):
        tracker.ready += shift
        tracker.started += shift
        tracker.processed += shift
        tracker.completed += shift


def batch_count(trainer) -> int:
    """Training batches of the current epoch that the loop counts as started (its ``ready`` counter)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def apply_loader_position(trainer) -> bool:
    """Hand the training loader the position the checkpoint saved, when the fit loop built the loader before the
    restore and so never did; True when it had to. Call it in ``on_train_start``, before the first batch.

    Lightning 2.6 builds the training loader when the task reads ``trainer.estimated_stepping_batches`` (or calls
    ``trainer.fit_loop.setup_data()`` to read ``len(trainer.train_dataloader)``) in ``setup``,
    ``configure_optimizers`` or ``on_fit_start``, as Lightning's docs recommend for sizing a schedule: before the
    checkpoint is restored. Its fit loop then skips ``setup_data()`` after the restore, where it hands a restarting
    loader its saved state, and the state waits unused: a resume trained the stopped epoch's first batches again.
    Here the loop's own loading step runs late, and the loader's iterator is made anew (the one made early read
    nothing yet, but a prefetching loader may have).
    """
    loop = trainer.fit_loop
    if not (loop.restarting and loop._combined_loader_states_to_load and loop._combined_loader is not None):
        return False  # nothing waits: the loop applied it (and emptied the list), or the run is not mid-epoch
    loop._load_combined_loader_states()
    if loop._data_fetcher is not None:
        iter(loop._data_fetcher)
    return True


def fit_loop_state(trainer) -> dict:
    """The fit loop's state as a checkpoint stores it (new dicts, loader positions included)."""
    return trainer.fit_loop.state_dict()


# ---------------------------------------------------------------------------------- 8. checkpoint["loops"]'s layout
def epochs_done(checkpoint: dict) -> int:
    """Epochs the checkpoint's fit had completed (0 when it holds no loop state)."""
    epochs = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return int(epochs.get("processed", 0))


def restart_validation(fit_loop: dict) -> None:
    """Make a fit loop state taken during validation (``checkpoint["loops"]["fit_loop"]``) resume by validating that
    epoch again from its first batch. Lightning 2.6 resumes such a state by "finishing" the validation: it counts the
    batches already done but restarts the loader, so it would validate the first batches only (or none). These
    counters read as "restarted in validation, no batch done" (the pattern of EvaluationLoop.update_restart_stage);
    test_reliability's validation-stop test and test_elastic's validation-loss test fail if this changes."""
    progress = fit_loop["epoch_loop.val_loop.batch_progress"]
    progress["total"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    progress["current"] = {"ready": 0, "started": 0, "processed": 0, "completed": 0}
    progress["is_last_batch"] = False


def fit_loop_of(checkpoint: dict) -> dict:
    """The fit loop state inside a checkpoint (as :func:`fit_loop_state` gives it), to change before it is saved."""
    return checkpoint["loops"]["fit_loop"]


def validation_follows(trainer) -> bool:
    """In ``on_train_batch_end``: whether a validation runs right after this batch (the epoch's last batch, or a
    ``val_check_interval`` one), by Lightning's own test."""
    loop = trainer.fit_loop
    return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))


def resume_into_validation(fit_loop: dict) -> None:
    """Make a fit loop state taken in ``on_train_batch_end`` of a batch that a validation follows
    (:func:`validation_follows`) resume by running that validation. Lightning resumes such a state by fast-forwarding
    past the validation (at an epoch's end: the epoch then has no validation, no val row, no epoch checkpoint). As
    the state at that validation's start: the batch counts as completed, and the validation restarts in full."""
    progress = fit_loop["epoch_loop.batch_progress"]
    for tracker in ("current", "total"):
        progress[tracker]["completed"] = progress[tracker]["processed"]
    restart_validation(fit_loop)


def put_fit_loop_state(checkpoint: dict, state: dict) -> None:
    """Make the checkpoint resume from ``state`` (a :func:`fit_loop_state`) instead of the loops' present one."""
    checkpoint["loops"]["fit_loop"] = state


# ------------------------------------------------------------------------------------------ 9. a save on a broken group
@contextlib.contextmanager
def saving_alone(strategy) -> Iterator[dict]:
    """While inside: ``trainer.save_checkpoint`` skips the strategy's barrier and hands the checkpoint dict to the
    yielded dict (key ``checkpoint``) instead of writing it on rank 0 only; the caller writes it."""
    captured: dict = {}
    strategy.barrier = lambda *args, **kwargs: None
    strategy.save_checkpoint = lambda checkpoint, *args, **kwargs: captured.update(checkpoint=checkpoint)
    try:
        yield captured
    finally:
        del strategy.barrier, strategy.save_checkpoint  # the class's methods again


def spawned_ranks_launcher(strategy):
    """The launcher of a ``ddp_spawn`` run (Lightning's own: not the horovod self-launch's subclass), or None."""
    launcher = getattr(strategy, "launcher", None)
    return launcher if type(launcher) is _MultiProcessingLauncher else None


def start_method(strategy) -> str | None:
    """How a strategy of Lightning's DDP family starts its ranks (``popen``, ``spawn``, ``fork``, ...), or None: the
    start method is an ``__init__`` argument Lightning keeps only privately."""
    return getattr(strategy, "_start_method", None)


def free_strategy_name(name: str) -> None:
    """``name`` no longer counts as Lightning's GPU-only FSDP strategy in the accelerator connector's check."""
    from lightning.pytorch.strategies import FSDPStrategy

    if name in FSDPStrategy._registered_strategies:
        FSDPStrategy._registered_strategies.remove(name)


# ---------------------------------------------------------------------- 12. Lightning's stop flag and its broadcast
def _no_broadcast() -> None:
    """Nothing: Preemption's all-reduce, started at one step's end and read at the next, is the step's agreement."""


def take_over_stop_flag(trainer) -> bool:
    """Lightning's per-batch broadcast of its SIGTERM flag is skipped until :func:`give_back_stop_flag`, and the flag
    is cleared; returns whether it was set (a SIGTERM came after ``Trainer._run`` registered Lightning's handler, and
    before Preemption replaced it), so that Preemption acts on that signal instead."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast
    connector = trainer._signal_connector
    received, connector.received_sigterm = connector.received_sigterm, False
    return received


def give_back_stop_flag(trainer) -> None:
    """Lightning's per-batch broadcast again (a later fit on the same trainer without Preemption's handlers)."""
    vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)
