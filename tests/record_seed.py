"""A test-only callback: each rank writes the seed its generators had at its first training batch of this start
(``torch.initial_seed()``, the generator's last seed), with that batch's epoch and index, to ``folder/rank-N.json``."""

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback


class RecordSeed(Callback):
    def __init__(self, folder: str) -> None:
        self.folder, self.done, self.step, self.batch = Path(folder), False, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.step is None:
            self.step = trainer.global_step  # the step this start resumed from
            self.batch = (trainer.current_epoch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.done:  # (the seed is read here: the template's RandomState seeds at the batch's start)
            return
        self.done = True
        self.folder.mkdir(parents=True, exist_ok=True)
        epoch, batch = self.batch
        record = {"rank": trainer.global_rank, "step": self.step, "epoch": epoch, "batch": batch}
        record["seed"] = torch.initial_seed()
        (self.folder / f"rank-{trainer.global_rank}.json").write_text(json.dumps(record))
