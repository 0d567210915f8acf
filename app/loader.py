"""The training loader: a seeded, sharded order that can restart part-way through an epoch, at any world size.

Each epoch has one seeded permutation of the training set for all ranks together; rank ``r`` of ``W`` takes every
W-th index of it, so after each rank has taken ``b`` batches of ``B`` the ranks have consumed exactly the first
``b * B * W`` indices of the permutation. That count, the epoch's *global position*, is what the loader saves
(Lightning checkpoints a loader that has ``state_dict``/``load_state_dict`` with the loop counters). On restore the
rest of the permutation is dealt out again over the ranks of the new run, whatever their number: a run resumed on
another number of devices or nodes (an elastic restart, a preempted job moved to a smaller machine) trains each
sample of the epoch once. With the same number of ranks the order is exactly that of an unbroken run.

The loader also names each batch by ``(epoch, batch)``: augmentation seeds its random numbers from that name
(:meth:`ResumableLoader.batch_seed`), so the random crops of a resumed run are those of an unbroken run without any
random-number state in the checkpoint. Its loaders draw nothing from torch's global generator (which the model's
dropout draws from, and which :class:`app.callbacks.RandomState` seeds at every batch the same way).

A dataset that can only be read in order (an ``IterableDataset``: files read in shards, a stream) gets the same
promises from :class:`StreamLoader`: its items are dealt out as a map-style epoch's indices are (item ``i`` of the
epoch's stream to rank ``i mod W``), so the position saved is again the count of items the ranks consumed together,
and a resume at any world size skips that many items and deals out the rest.

:func:`make_loader` is what a data module calls to get these promises for its own dataset (docs/fork.md).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from typing_extensions import override

from app.lightning_internals import batch_count
from app.parallelism import parallelism


def fit_to_ranks(count: int, ranks: int, drop_last: bool) -> int:
    """How many indices ``count`` become when dealt out evenly: padded up (repeating the first ones) or cut down."""
    return count - count % ranks if drop_last else math.ceil(count / ranks) * ranks


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (seeded shuffle, rank ``r`` takes every N-th index) that can start an epoch part-way.

    ``consumed`` is the epoch's global position to start from: the indices the ranks of an earlier run (any number
    of them) had taken together. The rest of the epoch's order is padded (or cut, with ``drop_last``) to a multiple
    of the ranks, as ``DistributedSampler`` does with a whole epoch. ``len()`` stays that of a whole epoch, as
    Lightning expects of a loader it restores part-way (it counts the batches before the restart as done).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume_at: tuple[int, int] | None = None  # (epoch, global position)
        self.consumed = 0  # where the current epoch starts, in indices of all ranks together

    def resume_at(self, epoch: int, consumed: int) -> None:
        self._resume_at = (epoch, consumed)
        self.set_epoch(epoch)

    @override
    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        resume_epoch, consumed = self._resume_at or (None, 0)
        self.consumed = consumed if epoch == resume_epoch else 0

    def epoch_order(self) -> list[int]:
        """The epoch's indices for all ranks, in the order they are consumed (``DistributedSampler``'s order)."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        return _fit(order, self.num_replicas, self.drop_last)

    def remaining(self) -> int:
        """The indices this rank takes in the current epoch from its starting position."""
        total = fit_to_ranks(len(self.dataset), self.num_replicas, self.drop_last)
        return fit_to_ranks(max(total - self.consumed, 0), self.num_replicas, self.drop_last) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        rest = _fit(self.epoch_order()[self.consumed :], self.num_replicas, self.drop_last)
        self.consumed, self._resume_at = 0, None  # one restart only
        return iter(rest[self.rank :: self.num_replicas])


def _fit(indices: list[int], ranks: int, drop_last: bool) -> list[int]:
    size = fit_to_ranks(len(indices), ranks, drop_last)
    if size <= len(indices):
        return indices[:size]
    return (indices * math.ceil(size / len(indices)))[:size]


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` that Lightning saves and restores with the loops."""

    sampler: ResumableSampler

    def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("generator", torch.Generator())  # seeded per epoch in __iter__
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError("ResumableLoader needs a ResumableSampler")
        self.seed = seed
        self.epoch = 0
        self.batch = 0  # batches of the epoch handed out, counted as Lightning counts them (its batch_idx + 1)
        self.consumed = 0  # the epoch's global position after those batches

    def first_batch(self) -> int:
        """The batch index the (possibly resumed) epoch starts at: the batches of a whole epoch at this world size
        minus those left, so that Lightning's count ends at ``len(loader)`` as in an unbroken epoch."""
        sampler = self.sampler
        whole = fit_to_ranks(len(sampler.dataset), sampler.num_replicas, sampler.drop_last) // sampler.num_replicas
        return self._batches(whole) - self._batches(sampler.remaining())

    def _batches(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        # Counted where batches are handed out (not where workers prefetch them): what training has consumed.
        sampler = self.sampler
        self.epoch, self.batch, self.consumed = sampler.epoch, self.first_batch(), sampler.consumed
        # Starting an iterator draws the workers' base seed from the loader's generator (torch's global one when it
        # has none, which would shift the dropout masks after a resume): one of its own, seeded by the epoch.
        self.generator.manual_seed(hash((self.seed, self.epoch, sampler.rank)) & 0x7FFF_FFFF_FFFF_FFFF)
        left = sampler.remaining()  # of this rank, in this epoch
        for batch in self._fetch():
            self.batch += 1
            taken = min(self.batch_size, left)
            left -= taken
            self.consumed += taken * sampler.num_replicas
            yield batch

    def _fetch(self) -> Iterator[Any]:
        return super().__iter__()

    def batch_seed(self) -> int:
        """A seed that names the current batch: (loader seed, epoch, batch, rank). Same in a resumed run."""
        return hash((self.seed, self.epoch, self.batch, self.sampler.rank)) & 0x7FFF_FFFF_FFFF_FFFF

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batches": self.batch,
            "samples": self.consumed,  # the global position: what a run at any world size resumes from
            "world_size": self.sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Checkpoints written before the global position was saved: their world size was this one.
        consumed = state.get("samples", state["batches"] * self.batch_size * self.sampler.num_replicas)
        self.sampler.resume_at(state["epoch"], consumed)


class DeviceLoader(ResumableLoader):
    """A :class:`ResumableLoader` over a dataset of tensors held on the training device: each epoch, this rank's
    order (the sampler's, so the host loader's batches) is copied to the device once, and every batch is cut there,
    ``dataset[index]`` with a tensor of indices (as ``TensorDataset`` gives). No worker, no pinned
    buffer, no copy per step: the host queues a step's work and moves on (issue 44)."""

    def __init__(self, *args: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device

    @override
    def _fetch(self) -> Iterator[Any]:
        order = torch.tensor(list(iter(self.sampler)), dtype=torch.long).to(self.device)
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            if self.drop_last and len(index) < self.batch_size:
                return
            yield self.dataset[index]


class DealtStream(IterableDataset):
    """One rank's share of a stream, as :class:`StreamLoader` deals it: item ``i`` of the epoch's stream (after the
    ``skip`` items a resumed epoch had consumed) goes to rank ``i mod ranks``; for training only whole rows of
    ``ranks`` items are dealt, so that every rank takes the same number of batches (a rank with one batch more
    would wait for good in its gradient all-reduce). A ``DataLoader`` worker ``k`` of ``n`` yields the batches ``k,
    k + n, ...`` of the rank's share, so that the loader hands them out in the order one process would."""

    def __init__(self, stream: IterableDataset, rank: int, ranks: int, batch_size: int, whole_rows: bool) -> None:
        self.stream, self.rank, self.ranks, self.batch_size = stream, rank, ranks, batch_size
        self.whole_rows = whole_rows
        self.skip = 0  # items of the epoch's stream that an earlier run consumed

    def __len__(self) -> int:
        """The rank's items in a whole epoch (a ``TypeError`` when the stream has no length, as ``len()`` gives)."""
        count = len(self.stream)  # type: ignore[arg-type]
        if self.whole_rows:
            return count // self.ranks
        return max(count - self.rank + self.ranks - 1, 0) // self.ranks

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        items = itertools.islice(iter(self.stream), self.skip, None)
        for taken in itertools.count():
            row = list(itertools.islice(items, self.ranks))
            if len(row) <= self.rank or (self.whole_rows and len(row) < self.ranks):
                return
            if (taken // self.batch_size) % workers == worker:
                yield row[self.rank]


class StreamLoader(DataLoader):
    """The template's loader of an ``IterableDataset`` (:class:`DealtStream` deals it out over the ranks): it saves
    its position in the epoch (the items the ranks consumed together), and a resume at any world size skips that
    many items of the epoch's stream and deals out the rest, so each item of the epoch is trained once and, at the
    same world size, in the order of an unbroken run. The skipped items are read again (a stream cannot seek): a
    resume costs reading the stopped epoch up to its position.

    Before each epoch the stream's ``set_epoch(epoch)`` is called, when it has one (to shuffle its shards per epoch,
    as WebDataset and Hugging Face's datasets do). Its ``len()`` is the rank's batches in a whole epoch when the
    stream has a length, and undefined (Lightning then runs each epoch until the stream ends) when it has none.
    Workers (``num_workers``) are started anew each epoch: each gets the stream as it is then."""

    dataset: DealtStream

    def __init__(
        self,
        stream: IterableDataset,
        *,
        rank: int = 0,
        ranks: int = 1,
        train: bool = True,
        seed: int = 0,
        batch_size: int = 1,
        epoch_of: Callable[[], int] | None = None,
        batches_taken: Callable[[], int] | None = None,
        **options: Any,
    ) -> None:
        options.setdefault("generator", torch.Generator())  # seeded per epoch in __iter__
        options["persistent_workers"] = False  # a persistent worker would keep the first epoch's stream
        super().__init__(
            DealtStream(stream, rank, ranks, batch_size, whole_rows=train), batch_size=batch_size, **options
        )
        self.stream, self.seed, self.train = stream, seed, train
        self._epoch_of = epoch_of  # the epoch about to run (the trainer's), else the count of passes so far
        # the batches of the epoch that training has taken (the trainer's count): a stream without a length is read a
        # batch ahead by Lightning (to know which batch is its last), and that batch is not consumed yet
        self._batches_taken = batches_taken
        self._started_at = (0, 0)  # (batch, global position) where this pass over the epoch began
        self._passes = 0
        self._resume_at: tuple[int, int] | None = None  # (epoch, global position)
        self.epoch = 0
        self.batch = 0  # batches of the epoch handed out, as Lightning counts them
        self.consumed = 0  # the epoch's global position after those batches

    def _next_epoch(self) -> int:
        return self._epoch_of() if self._epoch_of is not None else self._passes

    def _skip(self, epoch: int) -> int:
        resume_epoch, consumed = self._resume_at or (None, 0)
        return consumed if epoch == resume_epoch else 0

    def first_batch(self) -> int:
        """The batch index the (possibly resumed) epoch starts at, at this world size."""
        return self._skip(self._next_epoch()) // (self.batch_size * self.dataset.ranks)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._next_epoch()
        skip, self._passes = self._skip(epoch), self._passes + 1
        self._resume_at = None  # one restart only
        set_epoch = getattr(self.stream, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.dataset.skip = skip
        self.epoch, self.consumed = epoch, skip
        self.batch = skip // (self.batch_size * self.dataset.ranks)
        self._started_at = (self.batch, skip)
        self.generator.manual_seed(hash((self.seed, epoch, self.dataset.rank)) & 0x7FFF_FFFF_FFFF_FFFF)
        for batch in super().__iter__():
            self.batch += 1
            self.consumed += self.batch_size * self.dataset.ranks  # (only an epoch's last batch can be short)
            yield batch

    def batch_seed(self) -> int:
        """A seed that names the current batch: (loader seed, epoch, batch, rank). Same in a resumed run."""
        return hash((self.seed, self.epoch, self.batch, self.dataset.rank)) & 0x7FFF_FFFF_FFFF_FFFF

    def state_dict(self) -> dict[str, int]:
        batch, consumed = self.batch, self.consumed
        if self._batches_taken is not None and self._batches_taken() < batch:  # one fetched ahead, not trained yet
            started_batch, started_at = self._started_at
            batch = self._batches_taken()
            consumed = started_at + (batch - started_batch) * self.batch_size * self.dataset.ranks
        return {"epoch": self.epoch, "batches": batch, "samples": consumed, "world_size": self.dataset.ranks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = (state["epoch"], state["samples"])


TEMPLATE_LOADERS = (ResumableLoader, StreamLoader)  # the training loaders make_loader gives


def _strategy_of(trainer: Any):
    """The trainer's strategy (None without a trainer); a data module passed for the trainer is one line saying so."""
    if trainer is None:
        return None
    if not hasattr(trainer, "strategy"):  # make_loader(self, ...) in a data module
        raise TypeError(
            "make_loader: its first argument is the trainer (self.trainer in a data module's *_dataloader), or None; "
            f"got a {type(trainer).__name__}"
        )
    return trainer.strategy


def make_loader(
    trainer: Any,
    dataset: Dataset,
    *,
    train: bool,
    batch_size: int,
    seed: int = 0,
    on_device: bool = False,
    **options: Any,
) -> DataLoader:
    """The template's loader for any dataset, for a data module's ``*_dataloader`` methods::

        def train_dataloader(self):
            return make_loader(self.trainer, self.train_set, train=True, batch_size=self.hparams.batch_size)

    What it keeps, whichever strategy runs (``trainer`` may be None outside a Trainer):

    - ``batch_size`` is per device: ``dp``, one process over several devices, gets its devices' batches together, and
      so does each ``pipeline`` replica, whose stages all work on its batch;
    - training: one seeded order for all ranks (rank r of N takes every N-th sample of it), so N ranks train on what
      one device trains at N x the batch; the loader saves its position in the epoch with the checkpoint and a
      resume (at any world size, an elastic restart included) trains each remaining sample of the epoch once;
    - evaluation: sharded over the ranks without the padding ``DistributedSampler`` adds (each sample counts once).

    ``options`` go to ``DataLoader`` (``collate_fn``, ``num_workers``, ...); ``pin_memory`` defaults to True on CUDA.

    An ``IterableDataset`` (a stream: shards of files, records read in order) gets a :class:`StreamLoader`: its
    items dealt out over the ranks in turn, whole rows of them in training so that every rank takes as many
    batches; the same position saved and restored at any world size, by skipping what the stopped epoch consumed.

    ``on_device=True`` (training only) gives a :class:`DeviceLoader`: ``dataset`` must already be on the training
    device (``strategy.root_device``) and give a whole batch for a tensor of indices (``dataset[index]``), as
    ``TensorDataset`` does; the batches are the host loader's, cut on the device (``collate_fn`` is not used).
    """
    strategy = _strategy_of(trainer)
    batch_size = batch_size * devices_per_batch(strategy)
    shard = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    on_cuda = strategy is not None and strategy.root_device.type == "cuda"
    options.setdefault("pin_memory", on_cuda)
    # the workers' base seed comes from this generator, not torch's global one (app/callbacks/random_state.py)
    options.setdefault("generator", torch.Generator().manual_seed(seed))
    if isinstance(dataset, IterableDataset):
        if on_device:
            raise ValueError("on_device=True needs a map-style dataset (dataset[index]), not an IterableDataset")
        if getattr(dataset, "__len__", None) is not None:
            # Lightning's warning that a length may count each worker's duplicates: the loader's length is its own
            warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
        epoch_of = (lambda: trainer.current_epoch) if trainer is not None else None
        taken = (lambda: batch_count(trainer)) if trainer is not None and train else None
        return StreamLoader(
            dataset,
            rank=shard.get("rank", 0),
            ranks=shard.get("num_replicas", 1),
            train=train,
            seed=seed,
            batch_size=batch_size,
            epoch_of=epoch_of,
            batches_taken=taken,
            **options,
        )
    if options.get("num_workers", 0) > 0:
        options.setdefault("persistent_workers", True)
    if train:
        sampler = ResumableSampler(
            dataset, num_replicas=shard.get("num_replicas", 1), rank=shard.get("rank", 0), shuffle=True, seed=seed
        )
        if on_device:
            if options.get("num_workers", 0) > 0:
                raise ValueError("on_device=True cuts batches in the training process: num_workers must be 0")
            options.update(pin_memory=False, persistent_workers=False)
            device = strategy.root_device if strategy is not None else torch.device("cpu")
            return DeviceLoader(dataset, sampler=sampler, seed=seed, batch_size=batch_size, device=device, **options)
        return ResumableLoader(dataset, sampler=sampler, seed=seed, batch_size=batch_size, **options)
    if shard:
        sampler = UnrepeatedDistributedSampler(dataset, shard["num_replicas"], shard["rank"], shuffle=False)
    else:
        sampler = None
    return DataLoader(dataset, sampler=sampler, batch_size=batch_size, **options)


def devices_per_batch(strategy) -> int:
    """How many devices share each batch a loader gives: dp's (one process drives them all), a pipeline's stages
    (each stage runs every sample of its replica's batch), else 1. ``--data.batch_size`` is per device, so the
    loader's batch is that many times it, and the global batch is batch_size x devices under every strategy."""
    layout = parallelism(strategy)
    return layout.devices_per_process * layout.stages


def data_parallel_size(trainer) -> int:
    """Into how many slices each global batch is dealt: the processes, or a pipeline's replicas."""
    return parallelism(trainer.strategy).data_parallel_size
