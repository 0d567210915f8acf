"""A test-only callback: each rank appends the training samples of every batch it starts to a file of its own.

Samples are named by their input's bytes, looked up in the data module's training set (a ``TensorDataset``): the
record does not depend on the loader's bookkeeping that the tests check. One JSON line per batch:
``{"rank", "world", "epoch", "step", "ids", "time", "start"}``, where ``step`` is the optimizer step count before the
batch and ``start`` names the launcher start (the rendezvous address and port, new at every start).

Before the batch's backward, a second file of the rank (``loss-*.jsonl``) gets its mean loss, unscaled by gradient
accumulation: ``{"step", "start", "loss", "samples", "time"}``; :func:`step_losses` makes the global loss of each
optimizer step from them, which runs at any world size can be compared by.
"""

import json
import os
import time
from pathlib import Path

import torch.distributed
from lightning.pytorch import Callback


class RecordSamples(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self._ids: dict[bytes, int] = {}
        self._file = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        images = trainer.datamodule.train_set.tensors[0]
        self._ids = {image.numpy().tobytes(): i for i, image in enumerate(images)}
        if len(self._ids) != len(images):
            raise AssertionError("two training inputs are identical: they cannot name samples")
        self.folder.mkdir(parents=True, exist_ok=True)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("TEMPLATE_MPI_RESTART", "0"))
        name = f"restart{restart}-rank{trainer.global_rank}-pid{os.getpid()}.jsonl"
        self._file = (self.folder / name).open("a", buffering=1)
        self._losses = (self.folder / f"loss-{name}").open("a", buffering=1)
        datamodule = trainer.datamodule
        before = datamodule.on_before_batch_transfer
        environment = getattr(trainer.strategy, "cluster_environment", None)
        start = f"{getattr(environment, 'main_address', '')}:{getattr(environment, 'main_port', '')}:{os.getpid()}"
        if trainer.world_size > 1 and torch.distributed.is_initialized():  # one name for all ranks of the start
            names = [None] * trainer.world_size
            torch.distributed.all_gather_object(names, start)
            start = names[0]

        def record(batch, dataloader_idx: int):
            if trainer.training and not trainer.sanity_checking:
                ids = [self._ids[image.float().numpy().tobytes()] for image in batch[0]]  # (64-true: float64)
                line = {"rank": trainer.global_rank, "world": trainer.world_size, "epoch": trainer.current_epoch}
                line.update(step=trainer.global_step, ids=ids, time=time.time(), start=start)
                self._file.write(json.dumps(line) + "\n")
                self._file.flush()
                os.fsync(self._file.fileno())
            return before(batch, dataloader_idx)

        datamodule.on_before_batch_transfer = record
        self._start = start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._step, self._samples = trainer.global_step, len(batch[0])  # the step before this batch's optimizer step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # here, not at the batch's end: a stop (Preemption) ends the run in the last batch's on_train_batch_end
        loss = float(loss.detach()) * trainer.accumulate_grad_batches  # Lightning divides it by the accumulation
        line = {"step": self._step, "start": self._start, "loss": loss, "samples": self._samples, "time": time.time()}
        self._losses.write(json.dumps(line) + "\n")
        self._losses.flush()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._file is not None:
            self._file.close()
            self._losses.close()
            self._file = None


def read_records(folder: Path) -> list[dict]:
    paths = [path for path in sorted(Path(folder).glob("*.jsonl")) if not path.name.startswith("loss-")]
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def step_losses(folder: Path) -> dict[int, float]:
    """Each optimizer step's loss over the global batch (the mean over its samples), from the start that completed
    it (the latest start that trained it: an earlier one that failed in the step had its batches done again)."""
    by_step: dict[int, dict[str, list[dict]]] = {}
    for path in sorted(Path(folder).glob("loss-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).setdefault(record["start"], []).append(record)
    losses = {}
    for step, starts in by_step.items():
        batches = max(starts.values(), key=lambda batch: min(r["time"] for r in batch))
        losses[step] = sum(r["loss"] * r["samples"] for r in batches) / sum(r["samples"] for r in batches)
    return losses
