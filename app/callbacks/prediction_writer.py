"""``python cli.py predict`` writes ``predictions.csv`` into the run's folder (on by default in ``cli.py``).

One row per sample, in dataset order, from every rank: ``index, name, label, pred, ...``. ``name`` is the data
module's ``predict_names[index]`` when it has them (a file name, say; ``TaskSpec.predict_names`` says how to read
them), else the index; ``label`` is the batch's target when it carries one (the second element of a ``(x, y)``
batch, or a dict batch's ``label``/``target``/``y``), else empty. Up to ``show`` predictions (a handful of one's own
images) are also printed as a table. What follows comes from ``predict_step``:

- a tensor: ``pred``, one value per sample (a vector per sample is written as values joined by spaces);
- a dict of tensors: ``pred`` from ``preds`` (or the first entry), ``prob`` as the largest of ``probs`` when given,
  and one more column per other entry.

When the data module names its classes (``TaskSpec.class_names``, app/task.py), integer predictions also get a ``class``
column. With several processes every rank sends its rows to rank 0, which writes the file; a sample that a
distributed sampler gave to two ranks (it pads the last batches so that every rank has as many) is written once.
"""

from __future__ import annotations

import csv
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.callbacks.progress import console_print
from app.checkpoints.atomic import atomic_write
from app.checkpoints.storage import run_path
from app.task import class_names, predict_names

LABEL_KEYS = ("label", "labels", "target", "targets", "y")


class PredictionWriter(BasePredictionWriter):
    def __init__(self, filename: str = "predictions.csv", show: int = 20) -> None:
        """
        Args:
            filename: File name inside the run's folder (``lightning_logs/version_N/``).
            show: Also print the predictions as a table on the terminal when there are at most this many (a
                handful of one's own images); 0: never.
        """
        super().__init__(write_interval="batch")
        self.filename, self.show = filename, show
        self._rows: list[tuple[int, Any, dict[str, Any]]] = []

    @override
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows = []

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        columns = prediction_columns(prediction)
        labels = batch_labels(batch)
        if labels is None or len(labels) != len(batch_indices):
            labels = [None] * len(batch_indices)  # an empty cell: the sample has no label
        for i, index in enumerate(batch_indices):
            self._rows.append((int(index), labels[i], {name: values[i] for name, values in columns.items()}))

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows = self._rows
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, rows)
            rows = [row for part in everyone for row in part]
        rows = sorted({row[0]: row for row in rows}.values(), key=lambda row: row[0])  # one row per sample index
        log_dir = trainer.log_dir  # a collective under ddp: every rank must ask, not only rank 0
        if not trainer.is_global_zero:
            return
        names = predict_names(pl_module, trainer.datamodule)
        header, table = prediction_rows(rows, names, class_names(pl_module, trainer.datamodule))
        folder = run_path(log_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.filename
        with atomic_write(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(table)
        if 0 < len(table) <= self.show:
            console_print(trainer, predictions_table(header, table))
        rank_zero_info(f"Predictions for {len(rows)} samples written to {path}")


def prediction_rows(rows: list[tuple[int, Any, dict[str, Any]]], names, classes) -> tuple[list[str], list[list]]:
    """predictions.csv's header and rows: a ``class`` column when every prediction is a class number and the task
    names its classes, ``prob`` when any row has one, then the other entries of ``predict_step``'s output."""
    extra = list(dict.fromkeys(name for _, _, values in rows for name in values if name not in ("pred", "prob")))
    with_prob = any("prob" in values for _, _, values in rows)
    with_class = bool(classes) and all(isinstance(values.get("pred"), int) for _, _, values in rows)
    header = ["index", "name", "label", "pred"] + ["class"] * with_class + ["prob"] * with_prob + extra
    table = []
    for index, label, values in rows:
        name = names[index] if index < len(names) else str(index)
        pred = values.get("pred")
        row = [index, name, _cell(label), _cell(pred)]
        if with_class:
            row.append(classes[pred] if 0 <= pred < len(classes) else str(pred))
        if with_prob:
            row.append(f"{values['prob']:.4f}" if "prob" in values else "")
        table.append(row + [_cell(values.get(name, "")) for name in extra])
    return header, table


def predictions_table(header: list[str], rows: list[list]):
    """predictions.csv's rows as a rich table, without the columns that say nothing here (the index; an empty
    label column)."""
    from rich.table import Table

    shown = [i for i, name in enumerate(header) if name != "index" and any(row[i] not in ("", None) for row in rows)]
    table = Table(title=f"Predictions ({len(rows)})")
    for i in shown:
        left = header[i] in ("name", "class")
        table.add_column(header[i], justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for row in rows:
        table.add_row(*(str(row[i]) for i in shown))
    return table


def prediction_columns(prediction: Any) -> dict[str, list]:
    """``predict_step``'s output for one batch as columns of per-sample Python values (one read from the device
    per column)."""
    if isinstance(prediction, torch.Tensor):
        return {"pred": _per_sample(prediction)}
    if not isinstance(prediction, dict) or not prediction:
        raise TypeError(
            "PredictionWriter: predict_step must return a tensor or a dict of tensors, one entry per sample; got "
            f"{type(prediction).__name__} (leave the writer out with --drop_callbacks=[PredictionWriter])"
        )
    tensors = {k: v for k, v in prediction.items() if isinstance(v, torch.Tensor)}
    main = "preds" if "preds" in tensors else next(iter(tensors))
    columns = {"pred": _per_sample(tensors[main])}
    if "probs" in tensors and tensors["probs"].dim() == 2:
        columns["prob"] = tensors["probs"].max(dim=1).values.tolist()
    for name, value in tensors.items():
        if name not in (main, "probs"):
            columns[name] = _per_sample(value)
    return columns


def batch_labels(batch: Any) -> list | None:
    """The batch's targets as per-sample values, or None when it carries none that can be found."""
    target = None
    if isinstance(batch, tuple | list) and len(batch) > 1:
        target = batch[1]
    elif isinstance(batch, dict):
        target = next((batch[k] for k in LABEL_KEYS if k in batch), None)
    return _per_sample(target) if isinstance(target, torch.Tensor) and target.dim() >= 1 else None


def _per_sample(values: torch.Tensor) -> list:
    values = values.detach()
    if values.dim() == 0:
        return [values.item()]
    return values.reshape(len(values), -1).squeeze(1).tolist() if values.dim() > 1 else values.tolist()


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return " ".join(str(_cell(v)) for v in value)
    return value
