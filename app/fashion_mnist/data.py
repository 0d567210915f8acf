"""Fashion-MNIST as a LightningDataModule: uint8 tensors in memory, one indexing op per batch, work on the device.

This module is what Lightning and the CLI see (``app.fashion_mnist.data.FashionMNISTDataModule``): the datasets, the
train/val split, the loaders and the on-device transforms. The files behind them (``--data.source``, download,
MD5 checks, the synthetic stand-in) are :mod:`app.fashion_mnist.datafiles`; users' own images for ``predict`` are
:mod:`app.fashion_mnist.image_folder`. The resolved source is stored in the hyperparameters as ``resolved_source``.

Batches leave the loader as ``(uint8 images [B, 28, 28], int64 labels [B])``; conversion to float,
normalisation and augmentation happen on the training device in :meth:`on_after_batch_transfer`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from app.errors import TemplateWarning, UserError
from app.fashion_mnist.augment import normalize, random_crop_flip
from app.fashion_mnist.datafiles import CLASSES, NAMES, SPLITS, FashionMNISTFiles, Source, download
from app.fashion_mnist.image_folder import Invert, image_files, load_image_folder
from app.loader import ResumableLoader, make_loader

# CLASSES and SPLITS are defined in app.fashion_mnist.datafiles; app.fashion_mnist.export imports CLASSES from here.
__all__ = ["CLASSES", "MEAN", "SPLITS", "STD", "FashionMNISTDataModule", "TensorImageDataset", "keep_batch"]

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics, on the [0, 1] scale


class TensorImageDataset(Dataset):
    """Images and labels held as tensors; ``__getitems__`` serves a whole batch with one indexing op."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None) -> None:
        self.images, self.labels = images, labels  # labels None: a user's own images, which have none

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        # a tensor of indices: a batch (app.loader.DeviceLoader); no label: a batch of images alone, ``(images,)``
        return (self.images[index],) if self.labels is None else (self.images[index], self.labels[index])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        return self[torch.as_tensor(indices)]

    def to(self, device: torch.device) -> TensorImageDataset:
        labels = None if self.labels is None else self.labels.to(device)
        return TensorImageDataset(self.images.to(device), labels)


def keep_batch(batch):
    """``collate_fn`` for :class:`TensorImageDataset`: ``__getitems__`` already returns a collated batch."""
    return batch


DEFAULT_DATA_DIR = "data"


class FashionMNISTDataModule(LightningDataModule):
    class_names = CLASSES  # what predictions.csv calls each class (app/task.py)

    def __init__(
        self,
        data_dir: str = DEFAULT_DATA_DIR,
        source: Source = "auto",
        batch_size: int = 256,
        val_size: int = 5000,
        augment: bool = False,
        num_workers: int = 0,
        on_device: bool = False,
        seed: int = 42,
        predict_dir: str | None = None,
        predict_invert: Invert = "auto",
    ) -> None:
        """
        Args:
            data_dir: Folder of the real files (in ``FashionMNIST/raw/``, as torchvision lays them out, or directly
                in it) and of the synthetic stand-in's (``FashionMNIST-synthetic/raw/``). The real files are also
                found in the system copy, /usr/share/datasets/fashion-mnist (``apt-get install dataset-fashion-mnist``).
            source: ``auto``, ``fashion_mnist`` or ``synthetic`` (see the docstring of app/fashion_mnist/datafiles.py).
                A checkpoint trained on another source than the one ``auto`` finds is refused by ``validate``,
                ``test``, ``predict`` and a resumed ``fit``; naming the source runs it all the same, with a warning.
            batch_size: Samples per device and step, for every strategy. The global batch is
                batch_size x devices x nodes (x accumulate_grad_batches per optimizer step); ``dp`` loads
                batch_size x devices per step and splits it across its devices.
            val_size: Samples held out of the 60k training set for validation (a fixed, seeded split).
            augment: Random crop (4-pixel padding) and horizontal flip, done on the device, training only.
            num_workers: DataLoader workers. 0 is usually fastest: a batch is one tensor indexing op.
            on_device: Keep the training images on the training device (43 MB as uint8) and cut each batch there
                from the epoch's order (:class:`app.loader.DeviceLoader`): no pinned buffer and no copy per step.
                The batches are the same as without it; on a GPU ``augment``'s crops are drawn by the GPU's
                generator (as reproducible, through a resume too, but other crops than the host's). Needs
                ``num_workers=0``.
            seed: Seed of the train/val split and of the shuffling order.
            predict_dir: ``predict`` on the PNG/JPEG images of this folder (or this one image, or the images this
                glob matches, ``'shots/**/*.jpg'``) instead of the test set. Each image is
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
        if on_device and num_workers:
            raise UserError(
                f"--data.on_device=true cuts batches on the device, in the training process: drop "
                f"--data.num_workers={num_workers} (or leave --data.on_device off)"
            )
        if source not in Source.__args__:
            raise UserError(f"--data.source={source!r} must be one of {', '.join(Source.__args__)}")
        if predict_invert not in Invert.__args__:
            raise UserError(f"--data.predict_invert={predict_invert!r} must be one of {', '.join(Invert.__args__)}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self._check_data_dir()
        if predict_dir:
            image_files(predict_dir)  # a bad --data.predict_dir is one line before anything runs, not after setup
        self.train_set = self.val_set = self.test_set = self.predict_set = None
        self.train_loader: ResumableLoader | None = None
        self._device_train_set: TensorImageDataset | None = None  # train_set on the device (on_device)
        self._loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.predict_names: list[str] = []  # what each predicted sample is: a file name, or "test[i]"

    # ------------------------------------------------------------------ files (app.fashion_mnist.datafiles)
    def _check_data_dir(self) -> None:
        """A ``--data.data_dir`` other than the default that does not exist, while the real files are read from the
        system copy: one warning line, before anything runs (a mistyped path to one's own copy would otherwise train
        on another copy without a word). A warning, not an error: a new folder is also where a script points a run
        that may have to download, and the system copy holds the same published files."""
        given = self.hparams.data_dir
        if self.data_dir.exists() or self.data_dir == Path(DEFAULT_DATA_DIR) or self.hparams.source == "synthetic":
            return  # (the default folder, absent on a fresh clone, is where the system copy is documented to win)
        place = self.files.find_real()
        if place is not None and place.system:
            rank_zero_warn(
                f"--data.data_dir={given}: no such folder; reading the Fashion-MNIST files of {place.folder} "
                f"({place.what}) instead. If you meant a copy of your own, fix the path",
                category=TemplateWarning,
            )

    @property
    def files(self) -> FashionMNISTFiles:
        return FashionMNISTFiles(self.data_dir, self.hparams.source)

    def _download(self) -> None:
        """torchvision's download; a method of the module so that a test can make it fail (no network)."""
        download(self.data_dir)

    @override
    def prepare_data(self) -> None:
        """Runs once per node (local rank 0): fetch the files, then read and check both splits.

        Checking here, before Lightning makes the run's log folder, means a bad file stops the run with nothing
        written. The tensors are kept for :meth:`setup` in this process.
        """
        if self.hparams.predict_dir and self.trainer is not None and self.trainer.state.fn == "predict":
            return  # predicting the user's own images: no Fashion-MNIST needed (the folder is read in setup)
        self.files.fetch(download=self._download)
        self._loaded = {split: self.load_split(split) for split in SPLITS}
        self._check_train_size(len(self._loaded["train"][1]))

    def __getstate__(self) -> dict:
        # spawned/MPI ranks read the files themselves
        return {**self.__dict__, "_loaded": {}, "_device_train_set": None}

    def _check_train_size(self, loaded: int) -> None:
        """Validation takes ``val_size`` of the training files; training needs at least one sample left."""
        if loaded <= self.hparams.val_size:
            folder = self.files.folder()
            raise UserError(
                f"--data.val_size={self.hparams.val_size}: the training files in {folder} hold only {loaded} "
                "samples; pass a smaller --data.val_size, or check the files"
            )

    def load_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and validate one split of the resolved source: ``(uint8 images [N,28,28], int64 labels [N])``."""
        if split in self._loaded:
            return self._loaded.pop(split)
        return self.files.read_split(split)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        self.hparams.resolved_source = self.files.resolve_source()
        if stage in ("fit", "validate") and self.train_set is None:
            images, labels = self.load_split("train")
            self._check_train_size(len(labels))
            perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.hparams.seed))
            val_idx, train_idx = perm[: self.hparams.val_size], perm[self.hparams.val_size :]
            self.train_set = TensorImageDataset(images[train_idx], labels[train_idx])
            self.val_set = TensorImageDataset(images[val_idx], labels[val_idx])
        if stage == "predict" and self.hparams.predict_dir:
            images, self.predict_names = load_image_folder(self.hparams.predict_dir, self.hparams.predict_invert)
            self.predict_set = TensorImageDataset(images, None)  # no labels: predictions.csv leaves them empty
        else:
            if stage in ("test", "predict") and self.test_set is None:
                self.test_set = TensorImageDataset(*self.load_split("test"))
            if stage == "predict":
                self.predict_set = self.test_set
                self.predict_names = [f"test[{i}]" for i in range(len(self.test_set))]
        # Only now that the files have loaded (a bad file stops the run before any log folder is made).
        for logger in self.trainer.loggers if self.trainer is not None else []:
            logger.log_hyperparams({"resolved_source": self.hparams.resolved_source})
        rank_zero_info(self.data_line(stage))
        if stage == "fit" and self.trainer is not None:
            self._log_batch_size()

    def data_line(self, stage: str) -> str:
        """What this stage runs on, in one line: how many images, of which data, from which files."""
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn ("test"), which prints otherwise
        if stage == "predict" and self.hparams.predict_dir:
            return f"Data: predict on the {len(self.predict_set):,} images in {self.hparams.predict_dir} (your own)"
        what = self.files.describe()
        if stage == "fit":
            train, val = len(self.train_set), len(self.val_set)
            return f"Data: fit on {train:,} training and {val:,} validation images of {what}"
        if stage == "validate":
            return (
                f"Data: validate on the {len(self.val_set):,} validation images (held out of the training files by "
                f"--data.seed={self.hparams.seed}) of {what}"
            )
        return f"Data: {stage} on the {len(self.test_set):,} test images of {what}"

    @property
    def epoch_note(self) -> str | None:
        """Said on every epoch line of the run (app/task.py): that the data is not Fashion-MNIST."""
        if self.hparams.get("resolved_source") == "synthetic":
            return "SYNTHETIC data, not Fashion-MNIST"
        return None

    def check_trained_on(self, checkpoint: dict, ckpt_path: str | None = None) -> None:
        """A checkpoint trained on another source than this run's: refused when the source was left to ``auto``,
        a warning when this run names its source (``--data.source``), the way through. One line, naming both.

        Called by the example's model when Lightning loads a checkpoint (``ImageClassifier.on_load_checkpoint``),
        for ``fit --ckpt_path``, ``validate``, ``test`` and ``predict``; ``predict`` on ``--data.predict_dir`` reads
        no Fashion-MNIST, and a checkpoint that does not say what it was trained on is taken as it is.
        """
        fn = self.trainer.state.fn if self.trainer is not None else None
        stage = getattr(fn, "value", fn) or "this run"
        if stage == "predict" and self.hparams.predict_dir:
            return
        trained = (checkpoint.get("datamodule_hyper_parameters") or {}).get("resolved_source")
        now = self.hparams.get("resolved_source")
        if trained not in NAMES or now not in NAMES or trained == now:
            return
        ckpt = ckpt_path or "the checkpoint"
        verb = {"fit": "train"}.get(stage, stage)
        if self.hparams.source == "auto":
            raise UserError(
                f"{ckpt} was trained on {NAMES[trained]}, but this {stage} would run on {NAMES[now]} "
                f"({self.files.folder()}); pass --data.source={trained} to {verb} on what it was trained on, or "
                f"--data.source={now} to {verb} on {NAMES[now]} all the same"
            )
        rank_zero_warn(
            f"{ckpt} was trained on {NAMES[trained]}; this {stage} runs on {NAMES[now]} (--data.source={now})",
            category=TemplateWarning,
        )

    def _log_batch_size(self) -> None:
        t, b = self.trainer, self.hparams.batch_size
        devices = max(t.num_devices, t.world_size // t.num_nodes)  # mpirun -np 2 with devices=1 on CPU: 2 processes
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
        # The template's loader (app/loader.py): per-device batch under every strategy, one seeded order for all
        # ranks that resumes part-way through an epoch at any world size, unpadded evaluation shards.
        if self.hparams.num_workers == 0:
            # Lightning advises workers for any loader with fewer than two on a machine of more than two cores
            # ("The 'train_dataloader' does not have many workers which may be a bottleneck"), twice a run. Here a
            # batch is one indexing op on uint8 tensors, or on the device (on_device, which refuses workers):
            # workers would only add their copies between processes (docs/data.md). Silenced once this data module
            # builds a loader without workers; a fork's own data module, in a process without this one, is advised.
            warnings.filterwarnings(
                "ignore", message=r"The '\w+_dataloader' does not have many workers",
                module=r"lightning\.pytorch\.trainer\.connectors\.data_connector",
            )  # fmt: skip
        on_device = train and self.hparams.get("on_device", False)
        if on_device:
            device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
            if self._device_train_set is None or self._device_train_set.images.device != device:
                self._device_train_set = dataset.to(device)
            dataset = self._device_train_set
        loader = make_loader(
            self.trainer,
            dataset,
            train=train,
            batch_size=self.hparams.batch_size,
            seed=self.hparams.seed,
            on_device=on_device,
            collate_fn=keep_batch,
            num_workers=self.hparams.num_workers,
        )
        if train:
            self.train_loader = loader  # names each batch for augmentation (batch_seed)
        return loader

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, train=False)

    @override
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if not isinstance(batch, (tuple, list)) or batch[0].dtype != torch.uint8:
            return batch  # not one of our batches (e.g. the model summary's example input)
        images, *labels = batch  # no labels: a user's own images
        images = images.unsqueeze(1).float().div_(255)  # [B, 1, 28, 28] in [0, 1]
        if self.hparams.augment and self.trainer is not None and self.trainer.training:
            # Random numbers named by (seed, epoch, batch, rank): a resumed run crops exactly as an unbroken one.
            # On the device with on_device: drawing there needs no pinned copy of the random numbers.
            source = images.device if self.hparams.get("on_device") else "cpu"
            generator = torch.Generator(device=source).manual_seed(self.train_loader.batch_seed())
            images = random_crop_flip(images, padding=4, generator=generator)
        return normalize(images, MEAN, STD), *labels
