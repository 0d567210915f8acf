"""Batched image transforms that run on the training device: no per-sample Python, no PIL."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_crop_flip(images: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop after zero padding, then random horizontal flip, independently per image.

    ``images`` is ``[B, C, H, W]``; the result has the same shape. One gather for the crops, one ``where``
    for the flips: the cost does not grow with Python work per sample. The random numbers come from
    ``generator`` (on its own device, then copied: 3 numbers per image) or, without one, from the global RNG.
    """
    b, _, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    source = generator.device if generator is not None else images.device
    offsets = torch.randint(0, 2 * padding + 1, (2, b), device=source, generator=generator)
    flip = torch.rand(b, device=source, generator=generator) < 0.5
    if source.type == "cpu" and images.device.type == "cuda":
        # From pinned memory the copy is queued like a kernel; from pageable memory CUDA first waits for the GPU.
        offsets, flip = offsets.pin_memory(), flip.pin_memory()
    offsets, flip = offsets.to(images.device, non_blocking=True), flip.to(images.device, non_blocking=True)
    rows = (offsets[0, :, None] + torch.arange(h, device=images.device))[:, None, :, None]  # [B, 1, H, 1]
    cols = (offsets[1, :, None] + torch.arange(w, device=images.device))[:, None, None, :]  # [B, 1, 1, W]
    batch = torch.arange(b, device=images.device)[:, None, None, None]
    channel = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    cropped = padded[batch, channel, rows, cols]
    return torch.where(flip[:, None, None, None], cropped.flip(-1), cropped)


def normalize(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return (images - mean) / std
