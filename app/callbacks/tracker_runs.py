"""Experiment trackers (MLflow, Weights & Biases) beside the run folder: one tracker run per training.

A tracker's logger opens a run of its own on the tracker (MLflow's run id, W&B's run id). Lightning's loggers open a
new one at every start unless told which to continue (``MLFlowLogger(run_id=...)``, ``WandbLogger(id=...)``), so a
training stopped and resumed with ``--ckpt_path last``, requeued by SLURM or restarted by torchrun became two or more
tracker runs, the first left FAILED. Here:

- :class:`TrackerRuns` (a default callback) writes the id of each tracker run into every checkpoint;
- ``cli.py`` (:mod:`app.run.trackers`, before the loggers are built) gives each tracker logger the id its checkpoint
  saved when a run resumes from one: the resume, the requeued job's start and torchrun's restart log into the same
  tracker run. Its steps go on from the checkpoint's, so each step is logged once when the checkpoint is the stop's
  own (a stop, a requeue, a survivor's save); after a hard loss, the steps trained again after the last checkpoint
  are logged again, with the same values (the resume is bitwise). A new tracker run is named after its run folder
  (``runs/version_3``): MLflow draws its names from Python's ``random``, which the run's seed makes the same for
  every run. Trackers given alone get the run folder's CSV logger first: checkpoints and ``config.yaml`` stay where
  ``--ckpt_path last``, a requeued job and a restart find them.

Which loggers are trackers, and the arguments that name their runs, is :data:`RUN_ARGUMENTS`; a fork's own tracker
logger that subclasses one of them is one too.
"""

from __future__ import annotations

from lightning.pytorch import Callback
from typing_extensions import override

from app.callbacks.rank_watchdog import EXIT_CODE
from app.callbacks.stop_plan import stop_plan
from app.task import import_class

WANDB = "lightning.pytorch.loggers.WandbLogger"

# logger class -> (the argument that names the tracker run to continue, the argument that names a new run).
# (Lightning's WandbLogger passes wandb's resume="allow" itself: an id continues that run.)
RUN_ARGUMENTS: dict[str, tuple[str, str]] = {
    "lightning.pytorch.loggers.MLFlowLogger": ("run_id", "run_name"),
    WANDB: ("id", "name"),
}


def _kind_of_class(cls) -> str | None:
    for kind in RUN_ARGUMENTS:
        if isinstance(cls, type) and issubclass(cls, import_class(kind)):
            return kind
    return None


def tracker_kind(class_path: str | None) -> str | None:
    """The tracker logger class (a key of :data:`RUN_ARGUMENTS`) that ``class_path`` is or subclasses, else None."""
    if not class_path:
        return None
    try:
        return _kind_of_class(import_class(class_path))
    except (ImportError, AttributeError, ValueError):
        return None  # (the CLI reports a class path that cannot be imported)


def run_id_of(logger) -> tuple[str, str | None] | None:
    """(tracker kind, the id of the run ``logger`` writes to) for a tracker logger on rank 0, else None."""
    kind = _kind_of_class(type(logger))
    if kind is None:
        return None
    if kind.endswith("MLFlowLogger"):
        return kind, logger.run_id
    return kind, None if logger.version is None else str(logger.version)


class TrackerRuns(Callback):
    """Writes the id of each tracker logger's run into every checkpoint (``cli.py`` continues them on a resume).

    Only rank 0's loggers hold the runs; the ids are broadcast when training starts, so that a checkpoint any rank
    writes (a survivor's save after rank 0 was lost) names them too."""

    def __init__(self) -> None:
        self._runs: dict[str, list[str | None]] = {}

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        runs: dict[str, list[str | None]] = {}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if (found := run_id_of(logger)) is not None:
                    runs.setdefault(found[0], []).append(found[1])
        self._runs = trainer.strategy.broadcast(runs, src=0)
        if WANDB in runs:  # a rank that lost a peer is ended by the rank watchdog (os._exit), which skips W&B's exit
            stop_plan(trainer).before_exit.append(lambda: end_tracker_runs(trainer, exit_code=EXIT_CODE))

    @override
    def state_dict(self) -> dict:
        return {"runs": dict(self._runs)} if self._runs else {}


def end_tracker_runs(trainer, exit_code: int) -> None:
    """End this rank's W&B runs now, with ``exit_code``: before the job asks SLURM for its requeue. The requeue stops
    every process of the job, W&B's own service (``wandb-core``, which rank 0's logger talks to) too, and killed it
    drops the records it has not written out yet (a ``.wandb`` file is written in 32 KiB blocks). Ended first, the
    start's offline segment is whole; the requeued start continues the run. MLflow's client writes each call at once:
    nothing to do."""
    wandb_runs = [logger.experiment for logger in trainer.loggers if _kind_of_class(type(logger)) == WANDB]
    for run in wandb_runs:
        run.finish(exit_code=exit_code)
    if wandb_runs:  # and the service too: at exit, W&B's own teardown would find it stopped (a traceback)
        import wandb

        wandb.teardown(exit_code)


def saved_tracker_runs(checkpoint: dict) -> dict[str, list[str | None]]:
    """``{tracker logger class: [run id, ...]}`` that a checkpoint's :class:`TrackerRuns` saved (in logger order)."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("TrackerRuns") and isinstance(state, dict):
            return dict(state.get("runs") or {})
    return {}
