"""Fashion-MNIST streamed from shards of files: data that need not fit in memory, read in order.

The shards are WebDataset's format: plain tar files in which each sample is the files of one key (``000017.png``,
``000017.cls``). Python's ``tarfile`` reads and writes them, so nothing is added to the template's packages, and
``tar tf`` shows what is inside; WebDataset, ``litdata`` and Hugging Face's datasets read them too. (litdata's own
format needs its package and brings its own loader, which would replace :func:`app.loader.make_loader` and its
exact resume.) Write the training images (the split the example task trains on) into shards, then train on them::

    python cli.py shards --out shards           # 55,000 images, 10,000 to a shard
    python cli.py fit --data=app.fashion_mnist.shards.FashionMNISTShards --data.shards=shards
    python cli.py fit --data=app.fashion_mnist.shards.FashionMNISTShards --data.shards=shards \\
        --trainer.strategy=ddp --trainer.devices=2

The stream (:class:`TarShards`) reads the shards in a new order each epoch, through a seeded shuffle buffer; the
template's loader deals its samples out over the ranks and resumes part-way through an epoch, at any world size
(docs/data.md#streamed-data). Validation and test read the IDX files, as the example task does.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset
from torchvision.io import decode_png, encode_png
from typing_extensions import override

from app.errors import UserError
from app.fashion_mnist.data import DEFAULT_DATA_DIR, FashionMNISTDataModule
from app.loader import make_loader

INDEX = "index.json"  # beside the shards: their samples, and the split they hold


class TarShards(IterableDataset):
    """The samples of a folder of WebDataset-style shards (``*.tar``), as ``(PNG bytes, label)``: still encoded, so
    that the ranks and workers pass over each other's samples without decoding them; :func:`decode` (the loader's
    ``collate_fn``) decodes a batch in the worker that loads it.

    Each epoch (``set_epoch``) reads the shards in an order drawn from ``(seed, epoch)`` and passes the samples
    through a shuffle buffer of ``buffer`` samples seeded the same way: the same epoch is the same stream on every
    rank and in every run, which is what a resume part-way needs."""

    def __init__(self, folder: str | Path, seed: int = 0, buffer: int = 1000) -> None:
        self.folder, self.seed, self.buffer, self.epoch = Path(folder), seed, buffer, 0
        self.index = read_index(self.folder)
        self.paths = [self.folder / name for name in self.index["shards"]]

    def __len__(self) -> int:
        return self.index["samples"]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def samples(self, order: list[Path]) -> Iterator[tuple[bytes, int]]:
        for path in order:
            with tarfile.open(path, "r|") as tar:  # read as a stream: no seek, as from object storage
                files: dict[str, bytes] = {}
                for member in tar:
                    key, _, kind = member.name.partition(".")
                    files[kind] = tar.extractfile(member).read()
                    if "png" in files and "cls" in files:  # the key's files come together (WebDataset's rule)
                        yield files["png"], int(files["cls"])
                        files = {}

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        draw = random.Random(f"{self.seed}/{self.epoch}")
        order = list(self.paths)
        draw.shuffle(order)
        held: list[tuple[bytes, int]] = []
        for sample in self.samples(order):
            if len(held) < self.buffer:
                held.append(sample)
                continue
            pick = draw.randrange(len(held))
            held[pick], sample = sample, held[pick]
            yield sample
        draw.shuffle(held)
        yield from held


def decode(samples: list[tuple[bytes, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of :class:`TarShards` samples as the example task's batches: ``(uint8 images [B, 28, 28], labels)``."""
    images = [decode_png(torch.frombuffer(bytearray(png), dtype=torch.uint8))[0] for png, _ in samples]
    return torch.stack(images), torch.tensor([label for _, label in samples])


def read_index(folder: Path) -> dict:
    try:
        return json.loads((folder / INDEX).read_text())
    except FileNotFoundError:
        raise UserError(
            f"--data.shards={folder}: no {INDEX} there; write the shards with 'python cli.py shards --out {folder}'"
        ) from None


class FashionMNISTShards(FashionMNISTDataModule):
    """The example task's data module, its training images streamed from shards (:class:`TarShards`)."""

    def __init__(self, shards: str = "shards", buffer: int = 1000, **kwargs) -> None:
        """
        Args:
            shards: The folder that ``python cli.py shards --out FOLDER`` wrote.
            buffer: Samples in the shuffle buffer (more: a better shuffle, more memory).
            kwargs: The example data module's arguments (``--data.batch_size``, ``--data.num_workers``, ...); its
                split (``--data.seed``, ``--data.val_size``, ``--data.source``) must be the shards'.
        """
        if kwargs.get("on_device"):
            raise UserError(
                "--data.on_device=true cuts batches from images held on the device; FashionMNISTShards streams them "
                "from --data.shards: drop --data.on_device"
            )
        super().__init__(**kwargs)  # its save_hyperparameters() records this call's arguments too

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        shards = TarShards(self.hparams.shards, seed=self.hparams.seed, buffer=self.hparams.buffer)
        split = {key: self.hparams[key] for key in ("val_size", "seed")}
        split["source"] = self.hparams.resolved_source
        if shards.index["split"] != split:
            raise UserError(
                f"--data.shards={self.hparams.shards} holds the training images of another split "
                f"({shards.index['split']}, this run's is {split}): its validation images would be trained on; write "
                "the shards again with this run's --data flags"
            )
        self.train_set = shards

    @override
    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        self.train_loader = make_loader(
            self.trainer,
            self.train_set,
            train=True,
            batch_size=h.batch_size,
            seed=h.seed,
            num_workers=h.num_workers,
            collate_fn=decode,
        )
        return self.train_loader


def write_shards(out: Path, images: torch.Tensor, labels: torch.Tensor, split: dict, per_shard: int) -> None:
    """``images`` and ``labels`` as shards in ``out``, which must not exist: written into a folder beside it, then
    renamed, so that ``out`` is either whole or absent."""
    if out.exists():
        raise UserError(f"--out {out} exists: the shards are never written over; pick another folder or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        names = []
        for first in range(0, len(labels), per_shard):
            names.append(f"train-{first // per_shard:06d}.tar")
            with tarfile.open(building / names[-1], "w") as tar:
                for key in range(first, min(first + per_shard, len(labels))):
                    _add(tar, f"{key:06d}.png", encode_png(images[key][None]).numpy().tobytes())
                    _add(tar, f"{key:06d}.cls", str(int(labels[key])).encode())
        index = {"samples": len(labels), "shards": names, "split": split}
        (building / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        os.chmod(building, 0o755)
        building.rename(out)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    tar.addfile(member, io.BytesIO(data))


def main(argv: list[str]) -> None:
    """``cli.py shards``: the training images of the example's split (its --data flags) as shards in ``--out``."""
    parser = argparse.ArgumentParser(
        prog="cli.py shards", description="Write the training images as tar shards to stream from (docs/data.md)."
    )
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist)")
    parser.add_argument("--per_shard", type=int, default=10_000, help="samples in each tar file")
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR, help="as the example's --data.data_dir")
    parser.add_argument("--source", default="auto", help="as the example's --data.source")
    parser.add_argument("--val_size", type=int, default=5000, help="as the example's --data.val_size")
    parser.add_argument("--seed", type=int, default=42, help="as the example's --data.seed")
    args = parser.parse_args(argv)
    if args.per_shard <= 0:
        raise UserError(f"--per_shard must be a positive integer, got {args.per_shard}")
    if args.out.exists():  # (write_shards checks again: before the images are read, it saves the wait)
        raise UserError(f"--out {args.out} exists: the shards are never written over; pick another folder or remove it")
    data = FashionMNISTDataModule(data_dir=args.data_dir, source=args.source, val_size=args.val_size, seed=args.seed)
    data.prepare_data()
    data.setup("fit")
    split = {"val_size": args.val_size, "seed": args.seed, "source": data.hparams.resolved_source}
    write_shards(args.out, data.train_set.images, data.train_set.labels, split, args.per_shard)
    shards = len(read_index(args.out)["shards"])
    print(f"wrote {len(data.train_set):,} training images of {data.files.describe()} in {shards} shards to {args.out}")
