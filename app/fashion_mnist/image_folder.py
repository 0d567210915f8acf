"""Users' own images for ``predict`` (``--data.predict_dir``): PNG/JPEG files as Fashion-MNIST samples.

Kept apart from the Fashion-MNIST files (:mod:`app.fashion_mnist.datafiles`): these are arbitrary photos, not IDX
files, so they are decoded, made grayscale, resized to 28x28 and, where needed, inverted to Fashion-MNIST's polarity.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Literal

import torch

from app.errors import UserError

Invert = Literal["auto", "always", "never"]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def image_files(given: str | Path) -> list[tuple[Path, str]]:
    """The images ``--data.predict_dir`` names, sorted, each with the name predictions.csv gives it: the PNG/JPEG
    files of a folder (their file names), one image file (its name), or a glob pattern such as ``shots/**/*.jpg``
    (each path from the pattern's first folder with a wildcard: ``day1/a.jpg``)."""
    given = str(given)
    flag = f"--data.predict_dir={given!r}"
    if glob.has_magic(given):
        parts = Path(given).parts
        base = Path(*parts[: next(i for i, part in enumerate(parts) if glob.has_magic(part))] or ["."])
        paths = sorted(Path(p) for p in glob.glob(given, recursive=True) if Path(p).is_file())
        files = [(p, str(p.relative_to(base))) for p in paths if p.suffix.lower() in IMAGE_SUFFIXES]
        if not files:
            raise UserError(f"{flag} matches no .png/.jpg/.jpeg file")
        return files
    path = Path(given)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise UserError(f"{flag} is not a .png/.jpg/.jpeg image; give an image, a folder of them or a glob")
        return [(path, path.name)]
    if not path.is_dir():
        raise UserError(f"{flag} does not exist; give a folder of .png/.jpg images, one image, or a glob ('a/*.jpg')")
    files = [(p, p.name) for p in sorted(path.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise UserError(f"{flag} holds no .png/.jpg/.jpeg images")
    return files


def load_image_folder(given: str | Path, invert: Invert = "auto") -> tuple[torch.Tensor, list[str]]:
    """The images ``given`` names (:func:`image_files`) as uint8 ``[N, 28, 28]`` in Fashion-MNIST's polarity, and
    their names."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2.functional import resize, to_dtype

    files = image_files(given)
    images = []
    for path, _ in files:
        try:
            image = decode_image(str(path), mode=ImageReadMode.GRAY)  # [1, H, W], uint8 (uint16 for 16-bit PNGs)
        except RuntimeError as err:
            reason = re.sub(r"^\w+, \S+:\d+, ", "", str(err))  # without torchvision's "function, file.cpp:61, "
            raise UserError(f"{path}: not a readable image ({reason}); remove it from --data.predict_dir") from None
        image = to_dtype(image, torch.uint8, scale=True)
        image = resize(image, [28, 28], antialias=True)[0]
        if invert == "always" or (invert == "auto" and _border_is_lighter(image)):
            image = 255 - image
        images.append(image)
    return torch.stack(images), [name for _, name in files]


def _border_is_lighter(image: torch.Tensor) -> bool:
    border = torch.cat([image[0], image[-1], image[:, 0], image[:, -1]]).float().mean()
    return bool(border > image[7:21, 7:21].float().mean())
