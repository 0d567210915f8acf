"""``python cli.py predict`` writes ``predictions.csv`` into the run's folder (on by default in ``cli.py``).

One row per sample, in dataset order, from every rank: ``index, name, label, pred, class, prob``, where ``name`` is
the image's file name (``--data.predict_dir``) or ``test[i]``, and ``label`` the true class (-1 when unknown).
With several processes every rank sends its rows to rank 0, which writes the file; a sample that a distributed
sampler gave to two ranks (it pads the last batches so that every rank has as many) is written once.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from app.data import CLASSES


class PredictionWriter(BasePredictionWriter):
    def __init__(self, filename: str = "predictions.csv") -> None:
        """
        Args:
            filename: File name inside the run's folder (``lightning_logs/version_N/``).
        """
        super().__init__(write_interval="batch")
        self.filename = filename
        self._rows: list[tuple[int, int, int, float]] = []

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        labels = batch[1].tolist() if isinstance(batch, (tuple, list)) and len(batch) > 1 else [-1] * len(batch_indices)
        preds = prediction["preds"].tolist()
        probs = prediction["probs"].max(dim=1).values.tolist()
        self._rows += zip(batch_indices, labels, preds, probs, strict=True)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows = self._rows
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, rows)
            rows = [row for part in everyone for row in part]
        rows = list({row[0]: row for row in rows}.values())  # one row per sample index
        log_dir = trainer.log_dir  # a collective under ddp: every rank must ask, not only rank 0
        if not trainer.is_global_zero:
            return
        names = getattr(trainer.datamodule, "predict_names", None) or []
        folder = Path(log_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path, partial = folder / self.filename, folder / f".{self.filename}.partial"
        with open(partial, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "name", "label", "pred", "class", "prob"])
            for index, label, pred, prob in sorted(rows):
                name = names[index] if index < len(names) else str(index)
                label_name = CLASSES[pred] if pred < len(CLASSES) else str(pred)
                writer.writerow([index, name, label, pred, label_name, f"{prob:.4f}"])
        os.replace(partial, path)
        rank_zero_info(f"Predictions for {len(rows)} images written to {path}")
