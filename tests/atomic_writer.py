"""Test helper: write ``last.ckpt`` over and over (version i holds tensors full of i) until killed."""

import sys

import torch

from app.checkpoint_io import atomic_torch_save

path = sys.argv[1]
for i in range(10**6):
    atomic_torch_save({"version": i, "weights": torch.full((4, 1024, 1024), float(i))}, path)  # 16 MiB
    print(i, flush=True)
