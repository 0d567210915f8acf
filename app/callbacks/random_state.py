"""Random state: every rank's random-number generators go into each checkpoint and come back on resume, so a model
that draws random numbers in its step (dropout, stochastic depth, noise, random masking) resumes exactly.

Lightning 2.x checkpoints hold no generator state, and LightningCLI seeds again (``seed_everything``) when a resumed
run starts: a resumed run then draws other dropout masks than an unbroken one from its first step on (a dropout-0.3
model ended 0.29 away in a weight after one SIGTERM and ``--ckpt_path last``).

What is saved, for each rank: torch's CPU generator, the CUDA generators of the devices this process uses, Python's
``random`` and numpy's global generator. The rank that writes the checkpoint gathers them all; a survivor that saves
alone after a lost rank (no collective can run) saves its own.

When they come back: right before the resumed run's first training batch, which is where the unbroken run stood
when it saved (after a step, or after a validation). Everything the resumed run does before that point (seeding,
building the model, the loaders starting their epoch) then cannot shift what the training steps draw. The template's
loaders (:func:`app.loader.make_loader`) draw nothing from these generators; a random transform in a data set's
``__getitem__`` is not covered (draw from the loader's :meth:`~app.loader.ResumableLoader.batch_seed` instead).

The promise (docs/reliability.md):

- at the same world size, rank ``r`` gets back rank ``r``'s generators: the resumed run draws what the unbroken run
  draws and ends bitwise equal to it;
- at another world size (an elastic restart, a move from 2 devices to 1), or from a checkpoint that lacks a rank's
  state, no rank can draw what another set of ranks drew: every rank seeds its generators from the run's seed, the
  step and its rank, so the resumed run is the same every time it is run.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.checkpoints.generators import derived_seed, generator_states, seed_generators, set_generator_states
from app.lightning_internals import saves_alone


class RandomState(Callback):
    """Saves each rank's random-number generators with every checkpoint; a resumed ``fit`` restores them before
    its first training batch (see the module's docstring for what is promised at another world size)."""

    def __init__(self) -> None:
        self._restore: dict | None = None  # what a resumed fit sets before its first training batch
        self.restored = ""  # how the resumed run's generators were set: "saved", "derived" or "" (a fresh run)

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        mine = generator_states()
        world = trainer.world_size
        if world > 1 and dist.is_available() and dist.is_initialized() and not saves_alone(trainer.strategy):
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
            ranks = dict(enumerate(states)) if len(states) == world else {trainer.global_rank: mine}
        else:
            ranks = {trainer.global_rank: mine}
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        checkpoint.setdefault("callbacks", {})[self.state_key] = {"world_size": world, "seed": seed, "ranks": ranks}

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if trainer.state.fn != "fit":
            return
        step, rank, world = checkpoint.get("global_step", 0), trainer.global_rank, trainer.world_size
        ranks = (saved or {}).get("ranks", {})
        if saved and saved.get("world_size") == world and len(ranks) == world:
            self._restore = {"state": ranks[rank]}
            return
        seed = (saved or {}).get("seed", int(os.environ.get("PL_GLOBAL_SEED", 0)))
        self._restore = {"seed": derived_seed(seed, step, rank)}
        if not saved:
            why = "holds no random-number state (written before the template saved it)"
        elif saved.get("world_size") != world:
            why = f"holds the random-number state of {saved.get('world_size')} rank(s), this run has {world}"
        else:
            why = f"holds the random-number state of {len(ranks)} of its {world} ranks (saved after a lost rank)"
        rank_zero_info(
            f"The checkpoint {why}: each rank seeds its generators from the seed ({seed}), the step ({step}) and its "
            "rank, so this run is repeatable; random draws such as dropout masks differ from an unbroken run's"
        )

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._restore is None:
            return
        if "state" in self._restore:
            set_generator_states(self._restore["state"])
            self.restored = "saved"
        else:
            seed_generators(self._restore["seed"])
            self.restored = "derived"
        self._restore = None
