"""A restarted run's metrics, the third of :class:`~app.callbacks.Elastic`'s jobs.

Rank 0 puts the rows of the run's earlier ``metrics.csv`` (up to the step it resumes from, without those of a
validation it does again, with the last step's row if rank 0 died before writing it) back in front of the new ones,
so the run keeps one ``metrics.csv``. Every rank counts the rows (rank 0 writes them), so that a survivor of a failure
in validation, whichever rank, can tell the restart which rows came before it (:func:`keep_metrics_rows`).
"""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger

from app.checkpoints.atomic import write_text
from app.checkpoints.run_folders import METRICS_BEFORE_RESTART
from app.checkpoints.storage import run_path

METRICS_ROWS_TO_KEEP = "metrics.rows-to-keep"


def keep_metrics_rows(folders: list[Path], rows: int) -> None:
    """A survivor, failing: the restart puts only the first ``rows`` rows of the ``metrics.csv`` in each of
    ``folders`` (rank 0's CSV run folders) back; survivors write the same number."""
    for folder in folders:
        write_text(run_path(folder) / METRICS_ROWS_TO_KEEP, f"{rows}\n")


class MetricsContinuation:
    def __init__(self) -> None:
        self.rows = 0  # metrics.csv's rows so far, known on every rank (a restarting launcher's run only)
        self.rows_before_validation: int | None = None  # None: no validation since the last step
        # rank 0's CSV run folders, on every rank of a restartable job: a logger's own ``log_dir`` on another rank
        # is a folder of its own picking (the next free version_N, on a node where rank 0 claimed none)
        self.folders: list[Path] = []

    def count_rows(self, trainer) -> None:
        """Count metrics.csv's rows (one per ``log_metrics`` call; every rank makes the calls, rank 0's write)."""
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                log_metrics = logger.log_metrics

                def counted(*args, _log_metrics=log_metrics, **kwargs):
                    self.rows += 1
                    return _log_metrics(*args, **kwargs)

                logger.log_metrics = counted

    def validation_start(self) -> None:
        self.rows_before_validation = self.rows

    def step_done(self) -> None:
        self.rows_before_validation = None

    def keep_rows_before_validation(self, trainer) -> None:
        """A survivor's save: a validation ran (or runs) since the step, and the restart does it again: not its rows."""
        if self.rows_before_validation is not None:
            keep_metrics_rows(self.folders, self.rows_before_validation)

    def train_start(self, trainer, restored: dict | None, restartable: bool) -> None:
        restored_rows, folders = 0, []
        if trainer.is_global_zero:
            restored_rows = self._continue_metrics(trainer, restored)
            folders = [logger.log_dir for logger in trainer.loggers if isinstance(logger, CSVLogger)]
        if restartable and trainer.world_size > 1:  # rank 0 put them back (counted there): the others count them
            restored_rows, folders = trainer.strategy.broadcast((restored_rows, folders), src=0)
            if not trainer.is_global_zero:
                self.rows += restored_rows
        self.folders = [run_path(folder) for folder in folders]

    def _continue_metrics(self, trainer, restored: dict | None) -> int:
        """Rank 0: the earlier rows back in front of the new ones; returns how many rows were put back."""
        put_back = 0
        for logger in trainer.loggers:
            if not isinstance(logger, CSVLogger):
                continue
            kept = run_path(logger.log_dir) / METRICS_BEFORE_RESTART
            rows = _rows_before_restart(kept, run_path(logger.log_dir) / METRICS_ROWS_TO_KEEP)
            missing = (restored or {}).get("step_row")  # rank 0 died before logging the last step's row
            if missing and any(int(r["step"]) == missing["step"] and r.get(k) for r in rows for k in missing["values"]):
                missing = None  # it was logged
            count = _log_again(logger, rows, trainer.global_step)
            if missing and missing["step"] < trainer.global_step:
                logger.log_metrics({**missing["values"], "epoch": missing["epoch"]}, step=missing["step"])
                count += 1
            if kept.is_file():
                logger.save()
                kept.unlink()
            put_back = max(put_back, count)
        return put_back


def _rows_before_restart(kept: Path, keep: Path) -> list[dict]:
    """The rows of metrics.csv that the run before the restart wrote (``kept``), up to the number ``keep`` names
    when the run failed in a validation that this one does again (not its rows)."""
    rows = []
    if kept.is_file():
        with kept.open(newline="") as f:
            rows = list(csv.DictReader(f))
    if keep.is_file():
        rows = rows[: int(keep.read_text())]
        keep.unlink()
    return rows


def _log_again(logger: CSVLogger, rows: list[dict], before_step: int) -> int:
    """The earlier run's rows of the steps before ``before_step`` logged again; how many. The step in flight when
    the run failed (its rows name it) is left out: this run logs it again."""
    count = 0
    for row in rows:
        step = int(row.pop("step"))
        values = {k: int(float(v)) if k == "epoch" else float(v) for k, v in row.items() if v not in ("", None)}
        if step < before_step and values:
            logger.log_metrics(values, step=step)
            count += 1
    return count
