"""The process's random-number generators (torch's CPU and CUDA ones, Python's ``random``, numpy's global one) as
plain data: what a checkpoint keeps of them (:class:`app.callbacks.RandomState`) and what a launcher hands to the
processes it starts (the horovod self-launch, as Lightning's ``ddp_spawn`` does)."""

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


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A seed for one rank at one step of a run: the same every time, different for every rank and step."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def seed_generators(seed: int) -> None:
    torch.manual_seed(seed)  # the CUDA generators too
    random.seed(seed)
    np.random.seed(seed)
