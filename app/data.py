"""Fashion-MNIST as a LightningDataModule: uint8 tensors in memory, one indexing op per batch, work on the device.

Sources (``--data.source``):

- ``fashion_mnist``: the real files in ``<data_dir>/FashionMNIST/raw/`` (torchvision's layout), downloaded by
  torchvision when missing; the ``.gz`` files are checked against torchvision's known MD5 sums.
- ``synthetic``: a deterministic stand-in (:mod:`app.synthetic`) written as the same IDX files to
  ``<data_dir>/FashionMNIST-synthetic/raw/`` and read back by the same code.
- ``auto`` (default): real files if present, else try to download them, else the synthetic stand-in with a
  loud warning. The resolved source is stored in the hyperparameters as ``resolved_source``.

Batches leave the loader as ``(uint8 images [B, 28, 28], int64 labels [B])``; conversion to float,
normalisation and augmentation happen on the training device in :meth:`on_after_batch_transfer`.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import FashionMNIST

from app import synthetic
from app.augment import normalize, random_crop_flip
from app.errors import UserError
from app.idx import DataFileError, atomic_write_bytes, md5sum, read_idx, write_idx
from app.loader import ResumableLoader, ResumableSampler

Source = Literal["auto", "fashion_mnist", "synthetic"]
Invert = Literal["auto", "always", "never"]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics, on the [0, 1] scale
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
SPLITS = {  # split -> (images file, labels file, number of samples)
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
KNOWN_MD5 = dict(FashionMNIST.resources)  # {"train-images-idx3-ubyte.gz": "8d4f...", ...}
SYNTHETIC_SEED = 0
SYNTHETIC_STAMP = "GENERATOR"  # beside the synthetic files: which app.synthetic version wrote them


class TensorImageDataset(Dataset):
    """Images and labels held as tensors; ``__getitems__`` serves a whole batch with one indexing op."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]


def keep_batch(batch):
    """``collate_fn`` for :class:`TensorImageDataset`: ``__getitems__`` already returns a collated batch."""
    return batch


class FashionMNISTDataModule(LightningDataModule):
    def __init__(
        self,
        data_dir: str = "data",
        source: Source = "auto",
        batch_size: int = 256,
        val_size: int = 5000,
        augment: bool = False,
        num_workers: int = 0,
        seed: int = 42,
        predict_dir: str | None = None,
        predict_invert: Invert = "auto",
    ) -> None:
        """
        Args:
            data_dir: Folder holding ``FashionMNIST/raw/`` (real) and ``FashionMNIST-synthetic/raw/`` files.
            source: ``auto``, ``fashion_mnist`` or ``synthetic`` (see the module docstring).
            batch_size: Samples per device and step, for every strategy. The global batch is
                batch_size x devices x nodes (x accumulate_grad_batches per optimizer step); ``dp`` loads
                batch_size x devices per step and splits it across its devices.
            val_size: Samples held out of the 60k training set for validation (a fixed, seeded split).
            augment: Random crop (4-pixel padding) and horizontal flip, done on the device, training only.
            num_workers: DataLoader workers. 0 is usually fastest: a batch is one tensor indexing op.
            seed: Seed of the train/val split and of the shuffling order.
            predict_dir: ``predict`` on the PNG/JPEG images of this folder instead of the test set. Each image is
                read as grayscale and resized to 28x28.
            predict_invert: Fashion-MNIST shows light clothes on a dark background. ``auto`` inverts an image
                whose border is lighter than its centre (a photo on a white background); ``always``/``never``.
        """
        super().__init__()
        if batch_size <= 0:
            raise UserError(f"--data.batch_size must be a positive integer, got {batch_size}")
        if not 0 < val_size < SPLITS["train"][2]:
            raise UserError(f"--data.val_size must be between 1 and {SPLITS['train'][2] - 1}, got {val_size}")
        if num_workers < 0:
            raise UserError(f"--data.num_workers must be >= 0, got {num_workers}")
        if source not in Source.__args__:
            raise UserError(f"--data.source={source!r} must be one of {', '.join(Source.__args__)}")
        if predict_invert not in Invert.__args__:
            raise UserError(f"--data.predict_invert={predict_invert!r} must be one of {', '.join(Invert.__args__)}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.train_set = self.val_set = self.test_set = self.predict_set = None
        self.train_loader: ResumableLoader | None = None
        self._loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.predict_names: list[str] = []  # what each predicted sample is: a file name, or "test[i]"

    # ------------------------------------------------------------------ files
    @property
    def real_dir(self) -> Path:
        return self.data_dir / "FashionMNIST" / "raw"

    @property
    def synthetic_dir(self) -> Path:
        return self.data_dir / "FashionMNIST-synthetic" / "raw"

    def _real_present(self) -> bool:
        return all(
            (self.real_dir / name).exists() or (self.real_dir / f"{name}.gz").exists()
            for images, labels, _ in SPLITS.values()
            for name in (images, labels)
        )

    def _download(self) -> None:
        old_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)
        try:
            for train in (True, False):
                FashionMNIST(self.data_dir, train=train, download=True)
        finally:
            socket.setdefaulttimeout(old_timeout)

    def _write_synthetic(self) -> None:
        """Write the stand-in's files, unless this generator's version already wrote them (its stamp says so).

        Both splits come from one seed, so the test split holds new samples of the training split's classes.
        Files without the stamp, or with an older one, are written again: an older generator made the test
        split from other classes.
        """
        stamp = self.synthetic_dir / SYNTHETIC_STAMP
        expected = f"app.synthetic version {synthetic.VERSION}, seed {SYNTHETIC_SEED}\n"
        files = [self.synthetic_dir / name for images, labels, _ in SPLITS.values() for name in (images, labels)]
        if stamp.is_file() and stamp.read_text() == expected and all(f.exists() for f in files):
            return
        if any(f.exists() for f in files):
            rank_zero_info(
                f"{self.synthetic_dir}: synthetic files from an older version of app/synthetic.py; writing them again"
            )
        try:
            for images_file, labels_file, count in SPLITS.values():
                images, labels = synthetic.generate(count, seed=SYNTHETIC_SEED)
                write_idx(self.synthetic_dir / images_file, images)
                write_idx(self.synthetic_dir / labels_file, labels)
            atomic_write_bytes(stamp, expected.encode())  # last: a stamp vouches for finished files only
        except OSError as err:
            blocking = next((p for p in [self.synthetic_dir, *self.synthetic_dir.parents] if p.is_file()), None)
            if blocking is not None:
                raise DataFileError(
                    f"--data.data_dir={self.data_dir}: {blocking} is a file where a folder belongs; move it away or "
                    "pass another --data.data_dir"
                ) from None
            raise DataFileError(
                f"{self.synthetic_dir}: cannot write the synthetic files ({err.strerror}); make the folder writable "
                "or pass another --data.data_dir"
            ) from None

    def prepare_data(self) -> None:
        """Runs once per node (local rank 0): fetch the files, then read and check both splits.

        Checking here, before Lightning makes the run's log folder, means a bad file stops the run with nothing
        written. The tensors are kept for :meth:`setup` in this process.
        """
        self._fetch_files()
        self._loaded = {split: self.load_split(split) for split in SPLITS}
        self._check_train_size(len(self._loaded["train"][1]))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loaded": {}}  # spawned/MPI ranks read the files themselves

    def _fetch_files(self) -> None:
        """Download the real files, or write the synthetic ones."""
        source = self.hparams.source
        if source == "synthetic":
            self._write_synthetic()
            return
        if self._real_present():
            return
        try:
            self._download()
        except Exception as err:  # torchvision raises RuntimeError/URLError/OSError; each means "no files"
            if source == "fashion_mnist":
                reason = re.sub(r"\s*Tried \S+ got:\s*", " ", " ".join(str(err).split()))  # torchvision: 3 lines
                raise DataFileError(
                    f"--data.source=fashion_mnist: the Fashion-MNIST files are not in {self.real_dir} and the "
                    f"download failed ({reason}); put the four files there (as .gz or extracted), or use "
                    "--data.source=synthetic to run on the offline stand-in"
                ) from None
            rank_zero_warn(
                "\n" + "!" * 100 + f"\n  Fashion-MNIST is not in {self.real_dir} and could not be downloaded "
                f"({type(err).__name__}).\n  Training on the SYNTHETIC stand-in instead (--data.source=auto). "
                "Its accuracy says nothing about Fashion-MNIST.\n" + "!" * 100
            )
            self._write_synthetic()

    def _check_train_size(self, loaded: int) -> None:
        """Validation takes ``val_size`` of the training files; training needs at least one sample left."""
        if loaded <= self.hparams.val_size:
            folder = self.synthetic_dir if self.resolve_source() == "synthetic" else self.real_dir
            raise UserError(
                f"--data.val_size={self.hparams.val_size}: the training files in {folder} hold only {loaded} "
                "samples; pass a smaller --data.val_size, or check the files"
            )

    def resolve_source(self) -> str:
        if self.hparams.source != "auto":
            return self.hparams.source
        return "fashion_mnist" if self._real_present() else "synthetic"

    def load_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and validate one split of the resolved source: ``(uint8 images [N,28,28], int64 labels [N])``."""
        if split in self._loaded:
            return self._loaded.pop(split)
        source = self.resolve_source()
        folder = self.real_dir if source == "fashion_mnist" else self.synthetic_dir
        images_file, labels_file, count = SPLITS[split]
        images = read_idx(self._pick(folder, images_file, verify=source == "fashion_mnist"), ndim=3)
        labels = read_idx(self._pick(folder, labels_file, verify=source == "fashion_mnist"), ndim=1)
        where = folder / images_file
        if tuple(images.shape[1:]) != (28, 28):
            raise DataFileError(f"{where}: images are {tuple(images.shape[1:])}, expected 28x28")
        if len(images) != len(labels):
            raise DataFileError(f"{where}: {len(images)} images but {len(labels)} labels in {labels_file}")
        if source == "fashion_mnist" and len(images) != count:
            raise DataFileError(f"{where}: {len(images)} samples, Fashion-MNIST's {split} split has {count}")
        if len(labels) and int(labels.max()) >= len(CLASSES):
            raise DataFileError(f"{folder / labels_file}: label {int(labels.max())} out of range 0..{len(CLASSES) - 1}")
        return images, labels.long()

    @staticmethod
    def _pick(folder: Path, name: str, verify: bool) -> Path:
        """Prefer the ``.gz`` as distributed (and check its MD5), else the extracted file."""
        gz = folder / f"{name}.gz"
        if gz.exists():
            if verify and md5sum(gz) != KNOWN_MD5[gz.name]:
                raise DataFileError(
                    f"{gz}: MD5 checksum mismatch (expected {KNOWN_MD5[gz.name]}): the file is corrupt or not "
                    "Fashion-MNIST; delete it (and its extracted copy) and download it again"
                )
            return gz
        return folder / name

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        self.hparams.resolved_source = self.resolve_source()
        if stage in ("fit", "validate") and self.train_set is None:
            images, labels = self.load_split("train")
            self._check_train_size(len(labels))
            perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.hparams.seed))
            val_idx, train_idx = perm[: self.hparams.val_size], perm[self.hparams.val_size :]
            self.train_set = TensorImageDataset(images[train_idx], labels[train_idx])
            self.val_set = TensorImageDataset(images[val_idx], labels[val_idx])
        if stage == "predict" and self.hparams.predict_dir:
            images, self.predict_names = load_image_folder(self.hparams.predict_dir, self.hparams.predict_invert)
            self.predict_set = TensorImageDataset(images, torch.full((len(images),), -1))
        else:
            if stage in ("test", "predict") and self.test_set is None:
                self.test_set = TensorImageDataset(*self.load_split("test"))
            if stage == "predict":
                self.predict_set = self.test_set
                self.predict_names = [f"test[{i}]" for i in range(len(self.test_set))]
        # Only now that the files have loaded (a bad file stops the run before any log folder is made).
        for logger in self.trainer.loggers if self.trainer is not None else []:
            logger.log_hyperparams({"resolved_source": self.hparams.resolved_source})
        if stage == "fit" and self.trainer is not None:
            self._log_batch_size()

    def _log_batch_size(self) -> None:
        t, b = self.trainer, self.hparams.batch_size
        devices = t.num_devices
        total = b * devices * t.num_nodes
        rank_zero_info(
            f"Batch size: {b} per device x {devices} devices x {t.num_nodes} nodes = {total} per step"
            + (
                f", x {t.accumulate_grad_batches} accumulation = {total * t.accumulate_grad_batches} per optimizer step"
                if t.accumulate_grad_batches > 1
                else ""
            )
            + f"; {len(self.train_set)} training samples from {self.hparams.resolved_source!r}"
        )

    def _loader(self, dataset: TensorImageDataset, train: bool) -> DataLoader:
        strategy = self.trainer.strategy if self.trainer is not None else None
        # dp runs one process over several devices: it loads their batches together and splits them.
        batch_size = self.hparams.batch_size * getattr(strategy, "devices_per_process", 1)
        shard = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        options = dict(
            batch_size=batch_size,
            collate_fn=keep_batch,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
            pin_memory=on_cuda,
        )
        if train:
            # Chosen here rather than injected by Lightning, so that one process and N processes walk the same
            # seeded permutation: rank r takes every N-th sample of it, and the union of the ranks' step-k
            # batches is one device's step-k batch at N x batch_size. Resumable part-way through an epoch.
            sampler = ResumableSampler(
                dataset,
                num_replicas=shard.get("num_replicas", 1),
                rank=shard.get("rank", 0),
                shuffle=True,
                seed=self.hparams.seed,
            )
            self.train_loader = ResumableLoader(dataset, sampler=sampler, seed=self.hparams.seed, **options)
            return self.train_loader
        if shard:  # evaluation shards without the padding DistributedSampler adds: each sample counts once
            sampler = UnrepeatedDistributedSampler(dataset, shard["num_replicas"], shard["rank"], shuffle=False)
        else:
            sampler = None
        return DataLoader(dataset, sampler=sampler, **options)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, train=False)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if not isinstance(batch, (tuple, list)) or batch[0].dtype != torch.uint8:
            return batch  # not one of our batches (e.g. the model summary's example input)
        images, labels = batch
        images = images.unsqueeze(1).float().div_(255)  # [B, 1, 28, 28] in [0, 1]
        if self.hparams.augment and self.trainer is not None and self.trainer.training:
            # Random numbers named by (seed, epoch, batch, rank): a resumed run crops exactly as an unbroken one.
            generator = torch.Generator().manual_seed(self.train_loader.batch_seed())
            images = random_crop_flip(images, padding=4, generator=generator)
        return normalize(images, MEAN, STD), labels


def load_image_folder(folder: str | Path, invert: Invert = "auto") -> tuple[torch.Tensor, list[str]]:
    """The PNG/JPEG images of ``folder`` (sorted by name) as uint8 ``[N, 28, 28]`` in Fashion-MNIST's polarity."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2.functional import resize, to_dtype

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--data.predict_dir={str(folder)!r} is not a folder; give a folder of .png/.jpg images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"--data.predict_dir={str(folder)!r} holds no .png/.jpg/.jpeg images")
    images = []
    for path in files:
        try:
            image = decode_image(str(path), mode=ImageReadMode.GRAY)  # [1, H, W], uint8 (uint16 for 16-bit PNGs)
        except RuntimeError as err:
            raise UserError(f"{path}: not a readable image ({err}); remove it from --data.predict_dir") from None
        image = to_dtype(image, torch.uint8, scale=True)
        image = resize(image, [28, 28], antialias=True)[0]
        if invert == "always" or (invert == "auto" and _border_is_lighter(image)):
            image = 255 - image
        images.append(image)
    return torch.stack(images), [p.name for p in files]


def _border_is_lighter(image: torch.Tensor) -> bool:
    border = torch.cat([image[0], image[-1], image[:, 0], image[:, -1]]).float().mean()
    return bool(border > image[7:21, 7:21].float().mean())
