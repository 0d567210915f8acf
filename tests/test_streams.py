"""Iterable datasets through ``app.loader.make_loader`` (:class:`app.loader.StreamLoader`): every rank gets its share,
as many batches on each rank, workers keep the order one process gives, and a stop part-way resumes into the rest of
the epoch at any world size."""

import itertools
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from app.loader import StreamLoader, make_loader
from tests.record_samples import read_records
from tests.test_as_users_run_it import noise
from tests.test_reliability import (
    DROPOUT,
    STRATEGIES,
    assert_same_weights,
    fit,
    last_ckpt,
    metrics,
    stop_and_resume,
    versions,
)
from tests.tiny import TinyData

BATCH = 4


class Numbers(IterableDataset):
    """0, 1, ..., size - 1, shuffled per epoch by ``set_epoch`` (as a stream of shards shuffles its shards); no
    length."""

    def __init__(self, size: int) -> None:
        self.size, self.epoch = size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        yield from (torch.tensor(i) for i in epoch_order(self.size, self.epoch))


class SizedNumbers(Numbers):
    def __len__(self) -> int:
        return self.size


def loaders(world: int, size: int, state: dict | None = None, epoch: int = 3, **options) -> list[StreamLoader]:
    made = []
    for rank in range(world):
        loader = StreamLoader(SizedNumbers(size), rank=rank, ranks=world, batch_size=BATCH, seed=7, **options)
        loader._passes = epoch  # the epoch about to run (the trainer's current_epoch under Lightning)
        if state is not None:
            loader.load_state_dict(state)
        made.append(loader)
    return made


def take(made: list[StreamLoader], batches: int | None = None) -> list[list[int]]:
    """Each rank's items of ``batches`` batches (all when None), rank by rank, as the ranks of a step take them."""
    iterators = [iter(loader) for loader in made]
    taken = [[] for _ in made]
    for _ in range(batches) if batches is not None else itertools.count():
        got = [next(iterator, None) for iterator in iterators]
        if all(batch is None for batch in got):
            break
        assert None not in got, "a rank ran out of batches before the others"  # it would hang in its all-reduce
        for rank, batch in enumerate(got):
            taken[rank] += batch.tolist()
    return taken


def epoch_order(size: int, epoch: int = 3) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(epoch)).tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_takes_every_worlds_item_in_turn_and_as_many_batches_as_the_others(world):
    size = 50  # not divisible by 3 or by 4 x 3: the last row (of 2 items) is left out, as drop_last would
    made = loaders(world, size)
    taken = take(made)
    order = epoch_order(size)
    rows = size // world
    assert taken == [order[rank : rows * world : world] for rank in range(world)]
    assert [len(loader) for loader in made] == [-(-rows // BATCH)] * world


def test_evaluation_takes_every_item_once_however_uneven():
    made = [StreamLoader(SizedNumbers(10), rank=rank, ranks=3, batch_size=BATCH, train=False) for rank in range(3)]
    taken = [sum((batch.tolist() for batch in loader), []) for loader in made]
    assert sorted(sum(taken, [])) == list(range(10))
    assert [len(t) for t in taken] == [4, 3, 3] and [len(loader) for loader in made] == [1, 1, 1]


@pytest.mark.slow  # 4 DataLoader worker processes: 0.6 to 1.2 CPU-s (over the fast tests' 1 under load)
def test_workers_hand_out_the_batches_one_process_would():
    alone = take(loaders(2, 64))
    assert take(loaders(2, 64, num_workers=2)) == alone


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 1), (1, 2), (2, 3)])
def test_a_stop_part_way_resumes_into_the_rest_of_the_epoch_at_any_world_size(before, after):
    size = 96
    first = loaders(before, size)
    head = take(first, batches=3)
    state = first[0].state_dict()
    assert state == {"epoch": 3, "batches": 3, "samples": 3 * BATCH * before, "world_size": before}
    second = loaders(after, size, state)
    assert second[0].first_batch() == 3 * BATCH * before // (BATCH * after)
    rest = take(second)
    assert sorted(sum(head, []) + sum(rest, [])) == list(range(size))  # each item once
    if before == after:  # and in an unbroken run's order
        whole = take(loaders(before, size))
        assert [h + r for h, r in zip(head, rest, strict=True)] == whole


def test_the_next_epoch_after_a_resumed_one_is_whole_and_reshuffled():
    first = loaders(2, 32)
    take(first, batches=2)
    second = loaders(2, 32, first[0].state_dict())
    take(second)  # the rest of epoch 3
    fourth = take(second)  # epoch 4: whole, in set_epoch(4)'s order
    assert fourth == take(loaders(2, 32, epoch=4))
    assert sorted(sum(fourth, [])) == list(range(32))


def test_a_stream_without_a_length_runs_until_it_ends():
    made = [StreamLoader(Numbers(20), rank=rank, ranks=2, batch_size=BATCH) for rank in range(2)]
    with pytest.raises(TypeError):
        len(made[0])
    assert sorted(sum(take(made), [])) == list(range(20))


def test_make_loader_gives_a_stream_loader_and_refuses_on_device():
    assert isinstance(make_loader(None, SizedNumbers(8), train=True, batch_size=2), StreamLoader)
    assert isinstance(make_loader(None, SizedNumbers(8), train=False, batch_size=2), StreamLoader)
    with pytest.raises(ValueError, match="on_device=True needs a map-style dataset"):
        make_loader(None, SizedNumbers(8), train=True, batch_size=2, on_device=True)


# ---------------------------------------------------------------- a data module that streams, through cli.py
class TensorStream(IterableDataset):
    """A data module's own stream: the samples of a ``TensorDataset`` read in order, in another order each epoch
    (``set_epoch``), as shards of files are; ``tensors`` as the data set's (tests/record_samples.py reads them)."""

    def __init__(self, dataset: TensorDataset, seed: int, sized: bool) -> None:
        self.tensors, self.seed, self.sized, self.epoch = dataset.tensors, seed, sized, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream of unknown length")  # what len() of an object without __len__ raises
        return len(self.tensors[0])

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        for index in torch.randperm(len(self.tensors[0]), generator=generator).tolist():
            yield tuple(tensor[index] for tensor in self.tensors)


class StreamedTinyData(TinyData):
    """tests/tiny.py's data, its training set read as a stream through ``make_loader``."""

    def __init__(self, sized: bool = True, workers: int = 0, **kwargs) -> None:
        """
        Args:
            sized: Whether the stream has a length.
            workers: The training loader's ``num_workers``.
        """
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_set = TensorStream(self.train_set, self.hparams.seed, self.hparams.sized)

    def train_dataloader(self):
        h = self.hparams
        return make_loader(
            self.trainer, self.train_set, train=True, batch_size=h.batch_size, seed=h.seed, num_workers=h.workers
        )


STREAMED = "--data=tests.test_streams.StreamedTinyData"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "task"),
    [
        ("ddp, a stream with a length, dropout", (STREAMED, *STRATEGIES["ddp"], *DROPOUT)),
        ("one device, no length, 2 workers", (STREAMED, "--data.sized=false", "--data.workers=2", *DROPOUT)),
        # whole epochs of a stream without a length: Lightning reads a batch ahead of training (to know the last one)
        (
            "ddp, no length, whole epochs",
            (STREAMED, "--data.sized=false", *STRATEGIES["ddp"], *DROPOUT, "--trainer.limit_train_batches=1.0"),
        ),
    ],
)
def test_a_streamed_run_stopped_mid_epoch_resumes_bitwise_an_unbroken_one(tmp_path, name, task):
    (tmp_path / "unbroken").mkdir()
    unbroken = fit(tmp_path / "unbroken", *task)
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    assert noise(unbroken.stderr) == [], unbroken.stderr[-3000:]
    [expected] = versions(tmp_path / "unbroken")
    resumed = stop_and_resume(tmp_path / "stopped", task, task)
    assert_same_weights(last_ckpt(resumed), last_ckpt(expected))
    assert metrics(*versions(tmp_path / "stopped"))["train/loss"] == metrics(expected)["train/loss"]


@pytest.mark.slow
def test_a_streamed_epoch_stopped_on_two_ranks_and_resumed_on_one_trains_each_item_once(tmp_path):
    """The stop after step 5 of 8 on 2 ranks (160 items of the epoch's stream); the resume on one device skips
    them and trains the rest of what the unbroken run's epoch 0 trained (tiny.yaml's 8 batches a rank: 256 items)."""

    def record(folder: Path) -> str:
        spec = {"class_path": "tests.record_samples.RecordSamples", "init_args": {"folder": str(folder)}}
        return "--trainer.callbacks+=" + json.dumps(spec)

    one_epoch = (STREAMED, "--trainer.max_epochs=1")
    (tmp_path / "unbroken").mkdir()
    unbroken = fit(tmp_path / "unbroken", *one_epoch, *STRATEGIES["ddp"], record(tmp_path / "unbroken-samples"))
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    stop = (*one_epoch, *STRATEGIES["ddp"], record(tmp_path / "samples"))
    resumed = stop_and_resume(tmp_path / "stopped", stop, (*one_epoch, record(tmp_path / "samples")))
    assert last_ckpt(resumed)["global_step"] > 0
    trained = [i for r in read_records(tmp_path / "samples") for i in r["ids"]]
    expected = [i for r in read_records(tmp_path / "unbroken-samples") for i in r["ids"]]
    assert len(expected) == 8 * 16 * 2
    assert sorted(trained) == sorted(expected)  # each once, none of another part of the stream


def test_make_loader_given_a_data_module_for_the_trainer_says_so():
    """make_loader(self, ...) in a data module (self.trainer meant): one line, not an AttributeError from inside."""
    with pytest.raises(TypeError, match=r"first argument is the trainer \(self.trainer in .*got a SizedNumbers"):
        make_loader(SizedNumbers(8), SizedNumbers(8), train=True, batch_size=2)
