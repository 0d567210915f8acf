"""A deterministic, offline stand-in for Fashion-MNIST, written in the same IDX files.

Ten classes of 28x28 grayscale "garments". Like Fashion-MNIST, the classes come in confusable pairs (think
shirt / T-shirt): classes ``2k`` and ``2k+1`` share a silhouette and differ in a fainter detail pattern. Each
sample is its class prototype shifted by up to 3 pixels, with random contrast, a faint overlay of another
class, and pixel noise; a small share of labels is flipped. A ResNet learns it far above chance (10%), yet not
perfectly, so the numbers a run prints mean something. Same seed, same bytes (NumPy's PCG64 is stable).
"""

from __future__ import annotations

import numpy as np
import torch

SIZE = 28
NUM_CLASSES = 10
# Bump whenever ``generate`` returns other bytes for the same arguments: files written by an older version are
# then recognised (by the stamp the data module writes beside them) and written again.
# 2: the test split is drawn from the same class prototypes as the training split (1 seeded them differently).
VERSION = 2


def _blobs(rng: np.random.Generator, count: int, sigma: tuple[float, float], margin: int) -> np.ndarray:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    img = np.zeros((SIZE, SIZE), np.float32)
    for _ in range(count):
        cy, cx = rng.uniform(margin, SIZE - margin, size=2)
        s = rng.uniform(*sigma)
        img += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * s * s))
    return img / img.max()


def _prototypes(rng: np.random.Generator) -> np.ndarray:
    """Ten prototypes in [0, 1]: five shared silhouettes, each with two different detail patterns."""
    protos = np.empty((NUM_CLASSES, SIZE, SIZE), np.float32)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    for pair in range(NUM_CLASSES // 2):
        silhouette = np.clip(_blobs(rng, 7, (2.5, 5.0), 6) * 1.6, 0, 1)
        for member in range(2):
            angle, freq = rng.uniform(0, np.pi), rng.uniform(0.5, 1.1)
            stripes = 0.5 + 0.5 * np.sin(freq * (np.cos(angle) * xx + np.sin(angle) * yy) + rng.uniform(0, 6))
            detail = _blobs(rng, 2, (1.5, 2.5), 8)
            protos[2 * pair + member] = silhouette * (0.55 + 0.25 * stripes) + 0.35 * detail * silhouette
    return np.clip(protos, 0, 1)


def generate(num_samples: int, seed: int = 0, label_noise: float = 0.03) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images uint8 [N, 28, 28], labels uint8 [N])``, the same bytes for the same arguments.

    The prototypes depend on ``seed`` only, so a train and a test set made with the same seed (and different
    ``num_samples``) are new samples of the same ten classes: the samples are drawn from a stream keyed by
    ``(seed, num_samples)``.
    """
    protos = _prototypes(np.random.default_rng(seed))
    rng = np.random.default_rng([seed, num_samples])
    labels = rng.integers(0, NUM_CLASSES, num_samples)
    others = (labels + rng.integers(1, NUM_CLASSES, num_samples)) % NUM_CLASSES

    pad = 3
    padded = np.pad(protos, ((0, 0), (pad, pad), (pad, pad)))
    oy, ox = rng.integers(0, 2 * pad + 1, (2, num_samples))
    rows = (oy[:, None] + np.arange(SIZE))[:, :, None]
    cols = (ox[:, None] + np.arange(SIZE))[:, None, :]
    shifted = padded[labels[:, None, None], rows, cols]

    contrast = rng.uniform(0.6, 1.2, (num_samples, 1, 1)).astype(np.float32)
    overlay = rng.uniform(0.0, 0.45, (num_samples, 1, 1)).astype(np.float32)
    noise = rng.normal(0.0, 0.12, (num_samples, SIZE, SIZE)).astype(np.float32)
    images = np.clip(contrast * shifted + overlay * protos[others] + noise, 0, 1)

    flip = rng.random(num_samples) < label_noise
    labels = np.where(flip, rng.integers(0, NUM_CLASSES, num_samples), labels)
    return (
        torch.from_numpy(np.rint(images * 255).astype(np.uint8)),
        torch.from_numpy(labels.astype(np.uint8)),
    )
