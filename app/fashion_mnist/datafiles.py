"""Fashion-MNIST's files on disk: where they are, which source is used, how IDX files get there, and reading a split.

Kept apart from the data module (:mod:`app.fashion_mnist.data`) because none of this needs Lightning: it is folders,
downloads, checksums and file validation, each failure a :class:`~app.fashion_mnist.idx.DataFileError` that names the
file and the fix.

Sources (``--data.source``):

- ``fashion_mnist``: the real files, looked for in this order: torchvision's layout ``<data_dir>/FashionMNIST/raw/``,
  the four files directly in ``<data_dir>``, and the system copy ``/usr/share/datasets/fashion-mnist/`` (Debian's
  package ``dataset-fashion-mnist``; ``$FASHION_MNIST_SYSTEM_DIR`` names another folder, or none when empty). Each
  file may be gzip'd by anyone or extracted: its decompressed content is checked against the published MD5 sums.
  Found nowhere, torchvision downloads them into ``<data_dir>/FashionMNIST/raw/``.
- ``synthetic``: a deterministic stand-in (:mod:`app.fashion_mnist.synthetic`) written as the same IDX files to a
  folder of the template's own, ``<data_dir>/FashionMNIST-synthetic/raw/``, and read back by the same code. A
  ``data_dir`` that is not the template's to write (read-only, under ``/usr``, the system copy, or a folder holding
  the real files themselves) gets nothing written: the stand-in goes to
  ``${XDG_CACHE_HOME:-~/.cache}/fashion-resnet-template/FashionMNIST-synthetic/raw/`` instead.
- ``auto`` (default): the real files where they are found, else download them, else the synthetic stand-in with a
  loud warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchvision.datasets import FashionMNIST

from app.checkpoints.atomic import write_bytes
from app.errors import TemplateWarning
from app.fashion_mnist import synthetic
from app.fashion_mnist.idx import DataFileError, parse_idx, read_idx, read_idx_bytes, write_idx

Source = Literal["auto", "fashion_mnist", "synthetic"]

CLASSES = tuple(FashionMNIST.classes)  # ("T-shirt/top", "Trouser", ..., "Ankle boot"): label i names CLASSES[i]
SPLITS = {  # split -> (images file, labels file, number of samples)
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
FILES = tuple(name for images, labels, _ in SPLITS.values() for name in (images, labels))
# MD5 of each published file's decompressed content: the same whoever compressed it (torchvision's .gz sums,
# FashionMNIST.resources, are those of the original archives; Debian's package re-compressed them).
CONTENT_MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}
SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's (and its derivatives') package dataset-fashion-mnist
SYSTEM_DIR_ENV = "FASHION_MNIST_SYSTEM_DIR"  # another system copy; set empty: none
PACKAGE = "dataset-fashion-mnist"
CACHE_NAME = "fashion-resnet-template"  # the template's own folder under the user's cache
SYNTHETIC_SEED = 0
SYNTHETIC_STAMP = "GENERATOR"  # beside the synthetic files: which app.fashion_mnist.synthetic version wrote them
NAMES = {"fashion_mnist": "Fashion-MNIST", "synthetic": "the SYNTHETIC stand-in"}  # a resolved source, in a sentence


def system_dir() -> Path | None:
    """The system copy's folder: ``/usr/share/datasets/fashion-mnist``, or ``$FASHION_MNIST_SYSTEM_DIR`` (empty:
    none)."""
    value = os.environ.get(SYSTEM_DIR_ENV, SYSTEM_DIR)
    return Path(value) if value else None


def cache_dir() -> Path:
    """The template's own folder in the user's cache, for files that ``--data.data_dir`` may not take."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no HOME and no passwd entry
            base = Path(tempfile.gettempdir())
    return Path(base) / CACHE_NAME


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def writable(folder: Path) -> bool:
    """Whether files may be written into ``folder``: this process may, and the folder is meant to be written. A
    folder without any write permission bit is read-only for root too, whom the permission check lets through."""
    try:
        return os.access(folder, os.W_OK | os.X_OK) and bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def file_in(folder: Path, name: str) -> Path | None:
    """``name`` in ``folder``, extracted or gzip'd (the extracted file first: nothing to decompress), or None."""
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return path
    return None


@dataclass(frozen=True)
class Place:
    """A folder where the real files may be, and what it is (said in the run's data line)."""

    folder: Path
    what: str
    system: bool = False

    def fix(self) -> str:
        """How to get a good copy of a bad file here: never "delete it", whoever can download it again or not."""
        if self.system and _real(self.folder) == _real(Path(SYSTEM_DIR)):
            return f"the system copy is damaged: reinstall it (apt-get install --reinstall {PACKAGE})"
        return (
            f"replace it with an intact copy of the published file (apt-get install {PACKAGE} puts the four in "
            f"{SYSTEM_DIR}), or pass another --data.data_dir"
        )


def read_checked(path: Path, name: str, ndim: int, fix: str) -> torch.Tensor:
    """Read a real file and check its decompressed content against the published file's MD5, naming the file."""
    try:
        data = read_idx_bytes(path)
        tensor = parse_idx(data, path, ndim)
    except DataFileError as err:
        raise DataFileError(f"{err}; {fix}") from None
    digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if digest != CONTENT_MD5[name]:
        raise DataFileError(
            f"{path}: not the published Fashion-MNIST file (the MD5 of its content is {digest}, expected "
            f"{CONTENT_MD5[name]}); {fix}"
        )
    return tensor


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

    # ------------------------------------------------------------------ where the files are
    @property
    def real_dir(self) -> Path:
        """torchvision's layout in ``data_dir``: the first place looked in, and where a download goes."""
        return self.data_dir / "FashionMNIST" / "raw"

    def real_places(self) -> list[Place]:
        """Where the real files are looked for, in order, each folder once (``--data.data_dir`` may be the system
        copy's folder itself: it is then the system copy)."""
        system = system_dir()
        system_what = f"the system copy, Debian's {PACKAGE}" if str(system) == SYSTEM_DIR else f"${SYSTEM_DIR_ENV}"
        places = [
            Place(self.real_dir, "torchvision's layout"),
            Place(self.data_dir, "the four files in --data.data_dir"),
            *([Place(system, system_what)] if system is not None else []),
        ]
        unique: dict[Path, Place] = {}
        for place in places:
            key = _real(place.folder)
            if system is not None and key == _real(system):
                place = Place(place.folder, system_what, system=True)
            unique.setdefault(key, place)
        return list(unique.values())

    def places_text(self) -> str:
        folders = [str(p.folder) for p in self.real_places()]
        return ", ".join(folders[:-1]) + f" or {folders[-1]}" if len(folders) > 1 else folders[0]

    def find_real(self) -> Place | None:
        """The first place that holds all four real files (each extracted or gzip'd), or None."""
        for place in self.real_places():
            if all(file_in(place.folder, name) for name in FILES):
                return place
        return None

    def resolve_source(self) -> str:
        if self.source != "auto":
            return self.source
        return "fashion_mnist" if self.find_real() is not None else "synthetic"

    def folder(self) -> Path:
        """The folder of the resolved source."""
        if self.resolve_source() == "synthetic":
            return self.synthetic_dir
        place = self.find_real()
        return place.folder if place is not None else self.real_dir

    def not_ours(self) -> str | None:
        """Why the template may not write into ``data_dir`` (None: it may). It writes only folders of its own: not a
        system or read-only folder, nor a folder holding the real files themselves (someone's copy of the data set)."""
        folder = _real(self.data_dir)
        system = system_dir()
        if system is not None and (folder == _real(system) or _real(system) in folder.parents):
            return "the system copy's folder"
        if folder == Path("/usr") or Path("/usr") in folder.parents:
            return "a system folder, under /usr"
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is not None and existing.is_dir() and not writable(existing):
            return f"{existing} is read-only"
        if all(file_in(self.data_dir, name) for name in FILES):
            return "it holds the Fashion-MNIST files themselves"
        return None

    @property
    def synthetic_dir(self) -> Path:
        """The stand-in's folder: ``<data_dir>/FashionMNIST-synthetic/raw`` where ``data_dir`` is the template's to
        write (or already holds this generator's files), else the template's folder in the user's cache."""
        own = self.data_dir / "FashionMNIST-synthetic" / "raw"
        if self.not_ours() is None or _synthetic_current(own):
            return own
        return cache_dir() / "FashionMNIST-synthetic" / "raw"

    def describe(self) -> str:
        """Which files the resolved source reads, in a few words (the run's data line)."""
        if self.resolve_source() == "synthetic":
            return f"{NAMES['synthetic']} in {self.synthetic_dir} (not Fashion-MNIST)"
        place = self.find_real()
        if place is None:
            return f"Fashion-MNIST (not in {self.places_text()})"
        forms = {"gzip'd" if p.suffix == ".gz" else "extracted" for p in (file_in(place.folder, n) for n in FILES)}
        return f"Fashion-MNIST in {place.folder} ({place.what}; {' and '.join(sorted(forms))} files)"

    # ------------------------------------------------------------------ getting them there
    def fetch(self, download: Callable[[], None]) -> None:
        """Nothing when the real files are found; else download them (with ``download``) into ``data_dir`` when it
        is the template's to write; else, under ``auto``, write the synthetic stand-in."""
        if self.source == "synthetic":
            self.write_synthetic()
            return
        if self.find_real() is not None:
            return
        not_ours = self.not_ours()
        if not_ours is not None:
            failure, short = f"nothing is downloaded into {self.data_dir} ({not_ours})", f"not downloaded: {not_ours}"
        else:
            made = [d for d in (self.real_dir, *self.real_dir.parents) if not d.exists()]  # deepest first
            try:
                download()
                return
            except Exception as err:  # torchvision raises RuntimeError/URLError/OSError; each means "no files"
                remove_empty(made)  # a failed download leaves no empty folders behind (data_dir itself included)
                reason = re.sub(r"\s*Tried \S+ got:\s*", " ", " ".join(str(err).split()))  # torchvision: 3 lines
                failure, short = f"the download failed ({reason})", f"could not be downloaded ({type(err).__name__})"
        if self.source == "fashion_mnist":
            raise DataFileError(
                f"--data.source=fashion_mnist: the Fashion-MNIST files are in none of {self.places_text()}, and "
                f"{failure}; install them (apt-get install {PACKAGE}), or put the four files (gzip'd or extracted) "
                f"in {self.real_dir}, or use --data.source=synthetic to run on the offline stand-in"
            )
        rank_zero_warn(
            f"Fashion-MNIST is not in {self.places_text()}, and {short}.\n"
            f"         Using the SYNTHETIC stand-in in {self.synthetic_dir} instead (--data.source=auto): its accuracy "
            "says nothing about Fashion-MNIST.\n"
            f"         For the real data: apt-get install {PACKAGE}, or put the four files in {self.real_dir}.",
            category=TemplateWarning,
        )
        self.write_synthetic()

    def write_synthetic(self) -> None:
        """Write the stand-in's files, unless this generator's version already wrote them (its stamp says so).

        Both splits come from one seed, so the test split holds new samples of the training split's classes.
        Files without the stamp, or with an older one, are written again: an older generator made the test
        split from other classes.
        """
        folder = self.synthetic_dir
        if _synthetic_current(folder):
            return
        if any((folder / name).exists() for name in FILES):
            rank_zero_info(
                f"{folder}: synthetic files from an older version of app/fashion_mnist/synthetic.py; writing them again"
            )
        try:
            for images_file, labels_file, count in SPLITS.values():
                images, labels = synthetic.generate(count, seed=SYNTHETIC_SEED)
                write_idx(folder / images_file, images)
                write_idx(folder / labels_file, labels)
            write_bytes(folder / SYNTHETIC_STAMP, _stamp().encode())  # last: vouches for finished files only
        except OSError as err:
            blocking = next((p for p in [folder, *folder.parents] if p.is_file()), None)
            if blocking is not None:
                raise DataFileError(
                    f"--data.data_dir={self.data_dir}: {blocking} is a file where a folder belongs; move it away or "
                    "pass another --data.data_dir"
                ) from None
            raise DataFileError(
                f"{folder}: cannot write the synthetic files ({err.strerror}); make the folder writable "
                "or pass another --data.data_dir"
            ) from None

    # ------------------------------------------------------------------ reading them
    def read_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and validate one split of the resolved source: ``(uint8 images [N,28,28], int64 labels [N])``."""
        images_file, labels_file, _ = SPLITS[split]  # (the real files' sizes: their content's MD5 vouches for them)
        if self.resolve_source() == "synthetic":
            folder = self.synthetic_dir
            fix = f"delete {folder}: the next run writes the stand-in again"
            images, labels = _read_fixed(folder / images_file, 3, fix), _read_fixed(folder / labels_file, 1, fix)
        else:
            place = self.find_real()
            if place is None:
                raise DataFileError(
                    f"--data.source=fashion_mnist: the Fashion-MNIST files are in none of {self.places_text()}; "
                    f"install them (apt-get install {PACKAGE}) or put the four files in {self.real_dir}"
                )
            folder = place.folder
            images = read_checked(file_in(folder, images_file), images_file, 3, place.fix())
            labels = read_checked(file_in(folder, labels_file), labels_file, 1, place.fix())
        where = folder / images_file
        if tuple(images.shape[1:]) != (28, 28):
            raise DataFileError(f"{where}: images are {tuple(images.shape[1:])}, expected 28x28")
        if len(images) != len(labels):
            raise DataFileError(f"{where}: {len(images)} images but {len(labels)} labels in {labels_file}")
        if len(labels) and int(labels.max()) >= len(CLASSES):
            raise DataFileError(f"{folder / labels_file}: label {int(labels.max())} out of range 0..{len(CLASSES) - 1}")
        return images, labels.long()


def _stamp() -> str:
    return f"app.fashion_mnist.synthetic version {synthetic.VERSION}, seed {SYNTHETIC_SEED}\n"


def _synthetic_current(folder: Path) -> bool:
    """Whether ``folder`` holds this generator's stand-in: all four files and its stamp."""
    stamp = folder / SYNTHETIC_STAMP
    try:
        return stamp.is_file() and stamp.read_text() == _stamp() and all((folder / n).exists() for n in FILES)
    except OSError:
        return False


def _read_fixed(path: Path, ndim: int, fix: str) -> torch.Tensor:
    try:
        return read_idx(path, ndim)
    except DataFileError as err:
        raise DataFileError(f"{err}; {fix}") from None


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders that are empty, deepest first (those listed before their parents)."""
    for folder in folders:
        with contextlib.suppress(OSError):  # not empty (a partial download is kept for the user), or already gone
            folder.rmdir()
