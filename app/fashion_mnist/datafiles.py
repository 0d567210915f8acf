"""Fashion-MNIST's files on disk: which source is used, how its IDX files get there, and reading a split back.

Kept apart from the data module (:mod:`app.fashion_mnist.data`) because none of this needs Lightning: it is folders,
downloads, checksums and file validation, each failure a :class:`~app.fashion_mnist.idx.DataFileError` that names the
file and the fix.

Sources (``--data.source``):

- ``fashion_mnist``: the real files in ``<data_dir>/FashionMNIST/raw/`` (torchvision's layout), downloaded by
  torchvision when missing; the ``.gz`` files are checked against torchvision's known MD5 sums.
- ``synthetic``: a deterministic stand-in (:mod:`app.fashion_mnist.synthetic`) written as the same IDX files to
  ``<data_dir>/FashionMNIST-synthetic/raw/`` and read back by the same code.
- ``auto`` (default): real files if present, else try to download them, else the synthetic stand-in with a
  loud warning.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchvision.datasets import FashionMNIST
from torchvision.datasets.utils import check_integrity

from app.errors import TemplateWarning
from app.fashion_mnist import synthetic
from app.fashion_mnist.idx import DataFileError, atomic_write_bytes, read_idx, write_idx

Source = Literal["auto", "fashion_mnist", "synthetic"]

CLASSES = tuple(FashionMNIST.classes)  # ("T-shirt/top", "Trouser", ..., "Ankle boot"): label i names CLASSES[i]
SPLITS = {  # split -> (images file, labels file, number of samples)
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
KNOWN_MD5 = dict(FashionMNIST.resources)  # {"train-images-idx3-ubyte.gz": "8d4f...", ...}
SYNTHETIC_SEED = 0
SYNTHETIC_STAMP = "GENERATOR"  # beside the synthetic files: which app.fashion_mnist.synthetic version wrote them


def download(data_dir: Path) -> None:
    """torchvision's download of both splits into ``<data_dir>/FashionMNIST/raw/`` (it checks their MD5 sums)."""
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)
    try:
        for train in (True, False):
            FashionMNIST(data_dir, train=train, download=True)
    finally:
        socket.setdefaulttimeout(old_timeout)


@dataclass(frozen=True)
class FashionMNISTFiles:
    """The IDX files of one ``--data.data_dir`` and ``--data.source``."""

    data_dir: Path
    source: Source = "auto"

    @property
    def real_dir(self) -> Path:
        return self.data_dir / "FashionMNIST" / "raw"

    @property
    def synthetic_dir(self) -> Path:
        return self.data_dir / "FashionMNIST-synthetic" / "raw"

    def real_present(self) -> bool:
        return all(
            (self.real_dir / name).exists() or (self.real_dir / f"{name}.gz").exists()
            for images, labels, _ in SPLITS.values()
            for name in (images, labels)
        )

    def resolve_source(self) -> str:
        if self.source != "auto":
            return self.source
        return "fashion_mnist" if self.real_present() else "synthetic"

    def folder(self) -> Path:
        """The folder of the resolved source."""
        return self.real_dir if self.resolve_source() == "fashion_mnist" else self.synthetic_dir

    def fetch(self, download: Callable[[], None]) -> None:
        """Download the real files (with ``download``), or write the synthetic ones."""
        if self.source == "synthetic":
            self.write_synthetic()
            return
        if self.real_present():
            return
        made = [d for d in (self.real_dir, *self.real_dir.parents) if not d.exists()]  # deepest first
        try:
            download()
        except Exception as err:  # torchvision raises RuntimeError/URLError/OSError; each means "no files"
            remove_empty(made)  # a failed download leaves no empty folders behind (data_dir itself included)
            if self.source == "fashion_mnist":
                reason = re.sub(r"\s*Tried \S+ got:\s*", " ", " ".join(str(err).split()))  # torchvision: 3 lines
                raise DataFileError(
                    f"--data.source=fashion_mnist: the Fashion-MNIST files are not in {self.real_dir} and the "
                    f"download failed ({reason}); put the four files there (as .gz or extracted), or use "
                    "--data.source=synthetic to run on the offline stand-in"
                ) from None
            rank_zero_warn(
                f"Fashion-MNIST is not in {self.real_dir} and could not be downloaded ({type(err).__name__}).\n"
                "         Using the SYNTHETIC stand-in instead (--data.source=auto): its accuracy says nothing about "
                "Fashion-MNIST.",
                category=TemplateWarning,
            )
            self.write_synthetic()

    def write_synthetic(self) -> None:
        """Write the stand-in's files, unless this generator's version already wrote them (its stamp says so).

        Both splits come from one seed, so the test split holds new samples of the training split's classes.
        Files without the stamp, or with an older one, are written again: an older generator made the test
        split from other classes.
        """
        stamp = self.synthetic_dir / SYNTHETIC_STAMP
        expected = f"app.fashion_mnist.synthetic version {synthetic.VERSION}, seed {SYNTHETIC_SEED}\n"
        files = [self.synthetic_dir / name for images, labels, _ in SPLITS.values() for name in (images, labels)]
        if stamp.is_file() and stamp.read_text() == expected and all(f.exists() for f in files):
            return
        if any(f.exists() for f in files):
            rank_zero_info(
                f"{self.synthetic_dir}: synthetic files from an older version of app/fashion_mnist/synthetic.py; "
                "writing them again"
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

    def read_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and validate one split of the resolved source: ``(uint8 images [N,28,28], int64 labels [N])``."""
        source = self.resolve_source()
        folder = self.real_dir if source == "fashion_mnist" else self.synthetic_dir
        images_file, labels_file, count = SPLITS[split]
        images = read_idx(pick(folder, images_file, verify=source == "fashion_mnist"), ndim=3)
        labels = read_idx(pick(folder, labels_file, verify=source == "fashion_mnist"), ndim=1)
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


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders that are empty, deepest first (those listed before their parents)."""
    for folder in folders:
        with contextlib.suppress(OSError):  # not empty (a partial download is kept for the user), or already gone
            folder.rmdir()


def pick(folder: Path, name: str, verify: bool) -> Path:
    """Prefer the ``.gz`` as distributed (and check its MD5), else the extracted file."""
    gz = folder / f"{name}.gz"
    if gz.exists():
        if verify and not check_integrity(gz, KNOWN_MD5[gz.name]):
            raise DataFileError(
                f"{gz}: MD5 checksum mismatch (expected {KNOWN_MD5[gz.name]}): the file is corrupt or not "
                "Fashion-MNIST; delete it (and its extracted copy) and download it again"
            )
        return gz
    return folder / name
