"""Users' own images for ``predict`` (``--data.predict_dir``): a folder of PNG/JPEG files as Fashion-MNIST samples.

Kept apart from the Fashion-MNIST files (:mod:`app.fashion_mnist.datafiles`): these are arbitrary photos, not IDX
files, so they are decoded, made grayscale, resized to 28x28 and, where needed, inverted to Fashion-MNIST's polarity.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import torch

from app.errors import UserError

Invert = Literal["auto", "always", "never"]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


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
            reason = re.sub(r"^\w+, \S+:\d+, ", "", str(err))  # without torchvision's "function, file.cpp:61, "
            raise UserError(f"{path}: not a readable image ({reason}); remove it from --data.predict_dir") from None
        image = to_dtype(image, torch.uint8, scale=True)
        image = resize(image, [28, 28], antialias=True)[0]
        if invert == "always" or (invert == "auto" and _border_is_lighter(image)):
            image = 255 - image
        images.append(image)
    return torch.stack(images), [p.name for p in files]


def _border_is_lighter(image: torch.Tensor) -> bool:
    border = torch.cat([image[0], image[-1], image[:, 0], image[:, -1]]).float().mean()
    return bool(border > image[7:21, 7:21].float().mean())
