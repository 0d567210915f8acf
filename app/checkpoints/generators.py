"""The process's random-number generators (torch's CPU and CUDA ones, Python's ``random``, numpy's global one): as
plain data, what a launcher hands to the processes it starts (the horovod self-launch, as Lightning's ``ddp_spawn``
does); seeded from a place in the run, what :class:`app.callbacks.RandomState` does at every training batch."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def generator_states() -> dict[str, Any]:
    """This process's generators, as plain data (``torch.load(weights_only=True)`` reads it back)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position)},
    }
    state["numpy"].update(has_gauss=int(has_gauss), gauss=float(gauss))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_generator_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["position"], numpy["has_gauss"], numpy["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def derived_seed(seed: int, *where: int) -> int:
    """A seed for one place in a run (``where``: e.g. the epoch, the batch and the rank): the same every time,
    different for every place."""
    digest = hashlib.sha256(":".join(map(str, (seed, *where))).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def seed_generators(seed: int) -> None:
    """Seed torch's CPU generator, the CUDA generators (once CUDA runs), Python's ``random`` and numpy's global one:
    about 10 us, called at every training batch (``torch.manual_seed`` takes 70 us where CUDA is built in but not
    started: it queues the CUDA seeding with a stack trace each time)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)  # at once, not queued
    random.seed(seed)
    np.random.seed(seed)
