"""Test helper: write ``last.ckpt`` over and over (version i holds tensors full of i) until killed."""

import torch

from app.checkpoints.io import atomic_torch_save


def write_forever(path: str, done) -> None:
    """Run in a forked process: after each complete write, put its version in ``done`` (a multiprocessing queue)."""
    torch.set_num_threads(1)  # the parent's OpenMP thread pool does not exist in a forked child: stay serial
    for i in range(10**6):
        atomic_torch_save({"version": i, "weights": torch.full((4, 1024, 1024), float(i))}, path)  # 16 MiB
        done.put(i)
