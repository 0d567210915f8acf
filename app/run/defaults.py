"""What ``cli.py`` adds to every run: the default callbacks (chosen from the task's ``spec``) and loggers. The same for
runs built in Python with ``lightning.Trainer``::

    from lightning.pytorch import Trainer, seed_everything
    from app.run.defaults import last_checkpoint, trainer_defaults

    if __name__ == "__main__":  # ddp_spawn and the horovod self-launch import this script in new processes
        seed_everything(42)
        model, data = MyModel(), MyData()
        trainer = Trainer(**trainer_defaults(model, "runs"), strategy="ddp", devices=2, max_epochs=3)
        trainer.fit(model, data, ckpt_path=last_checkpoint("runs"))  # None the first time: starts fresh

``trainer_defaults`` gives the default callbacks (the same list ``cli.py`` builds from the model's ``spec``: the
checkpoint ranked by its monitored metric plus ``last.ckpt``, Preemption, Elastic, the run report, ...), the
RankWatchdog, the atomic ``weights_only`` checkpoint IO, and loggers writing into a freshly claimed
``ROOT/lightning_logs/version_N`` (no other run can take it). What stays with the CLI: its one-line errors for
bad input, the ``--ckpt_path`` rule (a checkpoint's network settings win), and launching under torchrun's restarts.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.loggers import CSVLogger

from app.callbacks import RankWatchdog
from app.callbacks.stop_plan import in_order
from app.checkpoints.io import SafeCheckpointIO
from app.checkpoints.run_folders import claim_versions
from app.checkpoints.storage import run_path
from app.errors import UserError
from app.launch import startup
from app.run.loggers import TensorBoardLogger
from app.run.resume import newest_last_ckpt
from app.strategies import register as register_strategies
from app.task import DEFAULT_SPEC, TaskSpec, import_class, spec_of

__all__ = ["default_callbacks", "default_loggers", "last_checkpoint", "trainer_defaults"]


def trainer_defaults(
    model: Any,
    default_root_dir: str | Path = ".",
    *,
    callbacks: list | None = None,
    drop_callbacks: tuple[str, ...] = (),
    logger: bool = True,
    watchdog_timeout: float | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that give a run what ``cli.py`` gives it.

    Args:
        model: The LightningModule to train (its ``spec`` picks the checkpoint's metric).
        default_root_dir: Where ``lightning_logs/version_N`` goes.
        callbacks: Your own callbacks; one of the same kind as a default (a ModelCheckpoint, a progress bar)
            replaces that default, as in ``cli.py``.
        drop_callbacks: Default callbacks to leave out, by class name (``cli.py``'s ``--drop_callbacks``).
        logger: False: no loggers and no run folder (checkpoints go into ``ROOT/checkpoints``).
        watchdog_timeout: ``--watchdog.timeout``: seconds without a sign of life before a rank counts as lost
            (default: the callback's, as in ``cli.py``; it was 60 here while ``cli.py`` gave 15).

    It also does what ``cli.py``'s ``main`` does first, for a script that never runs it: installs the template's
    warning filters and exit hook (:func:`app.launch.startup.install`) and registers the strategy names
    (:func:`app.strategies.register`), so ``Trainer(**trainer_defaults(model), strategy="dp")`` works. Both are
    no-ops when done already.
    """
    startup.install()
    register_strategies()
    own = list(callbacks or [])
    settings = {"logger": logger or None}
    built = default_callbacks(settings, own, list(drop_callbacks), spec_of(model))
    kwargs: dict[str, Any] = {
        "default_root_dir": str(default_root_dir),
        "callbacks": [
            *in_order(built, own),  # a default that must follow one of the run's own goes after it (stop_plan.ORDER)
            RankWatchdog() if watchdog_timeout is None else RankWatchdog(watchdog_timeout),
        ],
        "plugins": [SafeCheckpointIO()],
        "logger": False,
    }
    if logger:
        configs = [
            Namespace(class_path=c["class_path"], init_args=Namespace(**c["init_args"]))
            for c in default_loggers(str(default_root_dir))
        ]
        claim_versions(configs)
        kinds = {
            "lightning.pytorch.loggers.CSVLogger": CSVLogger,
            "app.run.loggers.TensorBoardLogger": TensorBoardLogger,
        }
        kwargs["logger"] = [kinds[c.class_path](**vars(c.init_args)) for c in configs]
    return kwargs


def last_checkpoint(default_root_dir: str | Path = ".") -> str | None:
    """The newest ``last.ckpt`` under the root, whatever run wrote it (``cli.py``'s ``--ckpt_path last`` prefers a
    run with the same settings), or None when there is none."""
    root = run_path(default_root_dir)
    found = newest_last_ckpt(root / "lightning_logs", root)
    return None if found is None else str(found)


# Added to every fit/validate/test/predict, beside the run's own callbacks (a YAML ``trainer.callbacks:`` list or
# ``--trainer.callbacks+=``), unless the run gives a callback of the same kind (its own ModelCheckpoint, progress
# bar, ...), turns the feature off (``--trainer.logger=false``, ``--trainer.enable_checkpointing=false``,
# ``enable_progress_bar``, ``enable_model_summary``), or names it in ``--drop_callbacks``.
DEFAULT_CALLBACKS = [
    {"class_path": "app.callbacks.ProgressBar"},
    {"class_path": "app.callbacks.RichModelSummary", "init_args": {"max_depth": 2}},  # its forward compiles nothing
    {"class_path": "app.callbacks.LearningRateMonitor"},  # Lightning's, one row per optimizer step
    {"class_path": "app.callbacks.ModelCheckpoint"},  # its settings come from the task's spec: checkpoint_options
    {"class_path": "app.callbacks.RunReport"},
    {"class_path": "app.callbacks.PredictionWriter"},
    # Elastic before Preemption: its record of each step's state must be taken before Preemption's collective (the
    # stop flag's all-reduce, waited for in the same hook) can fail on a lost rank, else the survivor saves nothing.
    # Checked for every trainer when the callbacks join its stop plan (app/callbacks/stop_plan.py: ORDER).
    {"class_path": "app.callbacks.Elastic"},
    {"class_path": "app.callbacks.Preemption"},
    {"class_path": "app.callbacks.RandomState"},  # generators seeded at each batch from the seed: exact resume
    {"class_path": "app.callbacks.ResumeSettings"},  # a resume's changed optimizer settings go over the restored
    {"class_path": "app.callbacks.StopOnNonFinite"},
    {"class_path": "app.callbacks.TrackerRuns"},  # each tracker logger's run id in every checkpoint: a resume goes on
]


# A run's own callback that is an instance of the kind replaces the default.
_KIND = {
    "ProgressBar": "lightning.pytorch.callbacks.ProgressBar",
    "RichModelSummary": "lightning.pytorch.callbacks.ModelSummary",
    "LearningRateMonitor": "lightning.pytorch.callbacks.LearningRateMonitor",
    "ModelCheckpoint": "lightning.pytorch.callbacks.ModelCheckpoint",
    "PredictionWriter": "lightning.pytorch.callbacks.BasePredictionWriter",
}


DEFAULT_CALLBACK_NAMES = [c["class_path"].rsplit(".", 1)[-1] for c in DEFAULT_CALLBACKS]


def checkpoint_options(spec: TaskSpec) -> dict:
    """The default ModelCheckpoint's settings for a task: the best by its monitored metric (``epoch=3-val_loss=0.3871
    .ckpt``), or without one the newest epoch's; ``last.ckpt`` always."""
    options = {"save_last": True, "auto_insert_metric_name": False}
    if spec.monitor is None:
        return {**options, "filename": "epoch={epoch}-step={step}"}
    safe = re.sub(r"[^\w.-]", "_", spec.monitor)  # val/loss -> val_loss: no folder in the file name
    filename = f"epoch={{epoch}}-{safe}={{{spec.monitor}:.4f}}"
    return {**options, "monitor": spec.monitor, "mode": spec.mode, "filename": filename}


def default_callbacks(trainer_config: dict, own: list, drop: list[str], spec: TaskSpec = DEFAULT_SPEC) -> list:
    """The default callbacks (built) that a run with these trainer settings and own callbacks gets."""
    for name in drop:
        if name not in DEFAULT_CALLBACK_NAMES:
            close = difflib.get_close_matches(name, DEFAULT_CALLBACK_NAMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            names = ", ".join(DEFAULT_CALLBACK_NAMES)
            raise UserError(f"--drop_callbacks: {name!r} is not a default callback{hint}; they are {names}")
    logger = trainer_config.get("logger")
    switched_off = {
        "ProgressBar": trainer_config.get("enable_progress_bar") is False,
        "RichModelSummary": trainer_config.get("enable_model_summary") is False,
        "LearningRateMonitor": logger is False or logger is None or logger == [],
        "ModelCheckpoint": trainer_config.get("enable_checkpointing") is False,
    }
    built = []
    for entry, name in zip(DEFAULT_CALLBACKS, DEFAULT_CALLBACK_NAMES, strict=True):
        kind = import_class(_KIND.get(name, entry["class_path"]))
        if name in drop or switched_off.get(name) or any(isinstance(c, kind) for c in own):
            continue
        options = checkpoint_options(spec) if name == "ModelCheckpoint" else entry.get("init_args", {})
        built.append(import_class(entry["class_path"])(**options))
    return built


def default_loggers(save_dir: str = ".") -> list[dict]:
    """CSV always (metrics.csv); TensorBoard too when it is installed (:mod:`app.run.loggers`: accuracy and loss first).
    Both write to lightning_logs/version_N."""
    csv = {"save_dir": save_dir, "name": "lightning_logs"}
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": csv}]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    tb = {"save_dir": save_dir, "name": "lightning_logs", "default_hp_metric": False}
    return loggers + [{"class_path": "app.run.loggers.TensorBoardLogger", "init_args": tb}]
