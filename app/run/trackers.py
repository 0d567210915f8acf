"""What ``cli.py`` does for experiment trackers before the loggers are built (see :mod:`app.callbacks.tracker_runs`):
the run folder's CSV logger beside trackers given alone, each new tracker run named after the run folder, and on a
resume each tracker logger pointed at the run its checkpoint saved."""

from __future__ import annotations

from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info

from app.callbacks.tracker_runs import RUN_ARGUMENTS, saved_tracker_runs, tracker_kind


def _key(logger_config) -> str:
    return str(getattr(logger_config, "class_path", "") or "")


def continue_tracker_runs(loggers: list, checkpoint: dict | None, ckpt_path: str | None) -> None:
    """Give each tracker logger config the run its checkpoint saved (unless the command names one)."""
    if not checkpoint:
        return
    saved = saved_tracker_runs(checkpoint)
    seen: dict[str, int] = {}
    for logger in loggers:
        kind = tracker_kind(_key(logger))
        init_args = getattr(logger, "init_args", None)
        if kind is None or init_args is None:
            continue
        index = seen[kind] = seen.get(kind, -1) + 1
        ids = saved.get(kind) or []
        run_argument = RUN_ARGUMENTS[kind][0]
        if index >= len(ids) or not ids[index] or init_args.get(run_argument):
            continue
        init_args[run_argument] = ids[index]
        rank_zero_info(f"{ckpt_path}: {kind.rsplit('.', 1)[-1]} continues its run {ids[index]}")


def name_tracker_runs(loggers: list, folder: Path | None) -> None:
    """Name each new tracker run after the run folder (``root/version_N``), unless the command names it."""
    if folder is None:
        return
    for logger in loggers:
        kind = tracker_kind(_key(logger))
        init_args = getattr(logger, "init_args", None)
        if kind is None or init_args is None:
            continue
        run_argument, name_argument = RUN_ARGUMENTS[kind]
        if not init_args.get(run_argument) and not init_args.get(name_argument):
            init_args[name_argument] = f"{folder.resolve().parent.parent.name}/{folder.name}"


def with_run_folder(loggers: list, folder_logger: dict) -> bool:
    """Put ``folder_logger`` (the run folder's CSV logger) first in ``loggers`` when they are trackers only: the run
    folder (checkpoints, ``config.yaml``, ``metrics.csv``), which ``--ckpt_path last``, a requeued SLURM job and a
    torchrun restart find, stays the same whatever tracker logs beside it. True when it was added."""
    kinds = [tracker_kind(_key(logger)) for logger in loggers]
    if not kinds or None in kinds:
        return False  # no logger, or one of another kind (the run folder's own, or the user's) that places the run
    loggers.insert(
        0, Namespace(class_path=folder_logger["class_path"], init_args=Namespace(**folder_logger["init_args"]))
    )
    return True
