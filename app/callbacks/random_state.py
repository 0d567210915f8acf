"""Random state: every rank seeds its random-number generators at each training batch from the run's seed, the
batch's place in the run and its rank, so a model that draws random numbers in its step (dropout, stochastic depth,
noise, random masking) draws the same numbers at a batch however the run got there: unbroken, resumed after a stop,
requeued, or resumed after a lost node.

Lightning 2.x checkpoints hold no generator state, and LightningCLI seeds again (``seed_everything``) when a resumed
run starts: a resumed run then drew other dropout masks than an unbroken one from its first step on (a dropout-0.3
model ended 0.29 away in a weight after one SIGTERM and ``--ckpt_path last``). Saving each rank's generators in the
checkpoint, this callback's first design, brought them back after a stop, but not after a lost rank: its
generators were gone with it, and the survivor's save held its own only, so a job resumed with the node back drew
other masks than the unbroken job. Generators that are a function of where the run stands need nothing saved but
the seed, and no collective at a save.

What is seeded, at the start of every training batch (each micro-batch of an accumulation window), with
:func:`~app.checkpoints.generators.derived_seed` of (seed, epoch, batch index, global rank): torch's CPU generator,
the CUDA generators once CUDA runs, Python's ``random`` and numpy's global generator (about 10 us a batch). Draws
between batches (a validation loop's, a callback's) follow from the last batch's seed, and are the same too. The seed
is the run's (``seed_everything``), kept in the checkpoint: a resume goes on with the seed its run started with.

The promise (docs/reliability.md):

- at the same world size, rank ``r`` draws at each batch what rank ``r`` of the unbroken run drew: the resumed run
  ends bitwise equal to it, after a stop, a requeue or a lost node;
- at another world size (an elastic restart, a move from 2 devices to 1) other ranks see a batch's samples, and the
  draws differ from the unbroken run's; the run is still the same every time it is run.

Not covered: random numbers drawn while the main process loads data (a random transform in a data set's
``__getitem__`` with ``num_workers=0``): the loader fetches a batch ahead. The template's loaders
(:func:`app.loader.make_loader`) draw nothing from these generators; draw from the loader's
:meth:`~app.loader.ResumableLoader.batch_seed` instead.
"""

from __future__ import annotations

import os

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.checkpoints.generators import derived_seed, seed_generators


class RandomState(Callback):
    """Seeds each rank's random-number generators at every training batch from the run's seed, the batch's place and
    the rank; keeps the seed in each checkpoint (see the module's docstring)."""

    def __init__(self) -> None:
        self._resumed_seed: int | None = None  # the seed of the run a resumed fit continues

    def seed(self) -> int:
        """The run's seed: the checkpoint's on a resume, else ``seed_everything``'s (0 without one, as Lightning)."""
        if self._resumed_seed is not None:
            return self._resumed_seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        state = {"seed": self.seed(), "world_size": trainer.world_size}
        checkpoint.setdefault("callbacks", {})[self.state_key] = state

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if trainer.state.fn != "fit" or not saved:
            return  # (a checkpoint from before the template kept the seed: this run's own seed)
        self._resumed_seed = int(saved["seed"])
        if saved.get("world_size") != trainer.world_size:
            rank_zero_info(
                f"The checkpoint was written by {saved.get('world_size')} rank(s), this run has "
                f"{trainer.world_size}: other ranks see each batch's samples, so random draws such as dropout masks "
                f"differ from an unbroken run's; each rank seeds its generators at every batch from the seed "
                f"({self._resumed_seed}), the batch and its rank, so this run is repeatable"
            )

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        seed_generators(derived_seed(self.seed(), trainer.current_epoch, batch_idx, trainer.global_rank))
