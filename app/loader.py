"""The training loader: a seeded, sharded order that can restart part-way through an epoch.

Lightning checkpoints a loader that has ``state_dict``/``load_state_dict`` (its ``_Stateful`` protocol) together
with the loop counters, and restores it before the epoch restarts. :class:`ResumableLoader` stores where it
stands, ``(epoch, batches handed out)``, and on restore :class:`ResumableSampler` drops the samples of those
batches, so a run resumed from a mid-epoch checkpoint (a preemption) sees exactly the batches it had not seen.

The loader also names each batch by ``(epoch, batch)``: augmentation seeds its random numbers from that name
(:meth:`ResumableLoader.batch_seed`), so the random crops of a resumed run are those of an uninterrupted run
without any random-number state in the checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (seeded shuffle, rank ``r`` takes every N-th index) that can skip an epoch's head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume_at: tuple[int, int] | None = None  # (epoch, samples of this rank to skip)
        self.skip = 0

    def resume_at(self, epoch: int, samples: int) -> None:
        self._resume_at = (epoch, samples)
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        resume_epoch, samples = self._resume_at or (None, 0)
        self.skip = samples if epoch == resume_epoch else 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip, self._resume_at = self.skip, 0, None  # one restart only
        return itertools.islice(super().__iter__(), skip, None)


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` that Lightning saves and restores with the loops."""

    sampler: ResumableSampler

    def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError("ResumableLoader needs a ResumableSampler")
        self.seed = seed
        self.epoch = self.batch = 0  # the batch most recently handed out (batch counts from 1; 0 = none yet)

    def __iter__(self) -> Iterator[Any]:
        # Counted where batches are handed out (not where workers prefetch them): what training has consumed.
        self.epoch, self.batch = self.sampler.epoch, self.sampler.skip // self.batch_size
        for batch in super().__iter__():
            self.batch += 1
            yield batch

    def batch_seed(self) -> int:
        """A seed that names the current batch: (loader seed, epoch, batch, rank). Same in a resumed run."""
        return hash((self.seed, self.epoch, self.batch, self.sampler.rank)) & 0x7FFF_FFFF_FFFF_FFFF

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.resume_at(state["epoch"], state["batches"] * self.batch_size)
