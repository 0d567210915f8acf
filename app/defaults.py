"""What ``cli.py`` adds to every run, for runs built in Python with ``lightning.Trainer``::

    from lightning.pytorch import Trainer, seed_everything
    from app.defaults import last_checkpoint, trainer_defaults

    if __name__ == "__main__":  # ddp_spawn and the horovod self-launch import this script in new processes
        seed_everything(42)
        model, data = MyModel(), MyData()
        trainer = Trainer(**trainer_defaults(model, "runs"), strategy="ddp", devices=2, max_epochs=3)
        trainer.fit(model, data, ckpt_path=last_checkpoint("runs"))  # None the first time: starts fresh

``trainer_defaults`` gives the default callbacks (the same list ``cli.py`` builds from the model's ``spec``: the
checkpoint ranked by its monitored metric plus ``last.ckpt``, Preemption, Elastic, the run report, ...), the
RankWatchdog, the atomic ``weights_only`` checkpoint IO, and loggers writing into a freshly claimed
``ROOT/lightning_logs/version_N`` (no other run can take it). What stays with the CLI: its one-line errors for
bad input, the ``--ckpt_path`` rule (a checkpoint's network settings win), and launching under torchrun's restarts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from app.callbacks import RankWatchdog
from app.checkpoint_io import SafeCheckpointIO
from app.run_dir import claim_versions
from app.task import spec_of

__all__ = ["last_checkpoint", "trainer_defaults"]


def trainer_defaults(
    model: Any,
    default_root_dir: str | Path = ".",
    *,
    callbacks: list | None = None,
    drop_callbacks: tuple[str, ...] = (),
    logger: bool = True,
    watchdog_timeout: float = 60.0,
) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that give a run what ``cli.py`` gives it.

    Args:
        model: The LightningModule to train (its ``spec`` picks the checkpoint's metric).
        default_root_dir: Where ``lightning_logs/version_N`` goes.
        callbacks: Your own callbacks; one of the same kind as a default (a ModelCheckpoint, a progress bar)
            replaces that default, as in ``cli.py``.
        drop_callbacks: Default callbacks to leave out, by class name (``cli.py``'s ``--drop_callbacks``).
        logger: False: no loggers and no run folder (checkpoints go into ``ROOT/checkpoints``).
        watchdog_timeout: ``--watchdog.timeout``: seconds without a sign of life before a rank counts as lost.
    """
    from app.cli import default_callbacks, default_loggers  # the CLI's own lists, built the same way

    own = list(callbacks or [])
    settings = {"logger": logger or None}
    built = default_callbacks(settings, own, list(drop_callbacks), spec_of(model))
    kwargs: dict[str, Any] = {
        "default_root_dir": str(default_root_dir),
        "callbacks": [*built, *own, RankWatchdog(timeout=watchdog_timeout)],
        "plugins": [SafeCheckpointIO()],
        "logger": False,
    }
    if logger:
        configs = [
            Namespace(class_path=c["class_path"], init_args=Namespace(**c["init_args"]))
            for c in default_loggers(str(default_root_dir))
        ]
        claim_versions(configs)
        kinds = {
            "lightning.pytorch.loggers.CSVLogger": CSVLogger,
            "lightning.pytorch.loggers.TensorBoardLogger": TensorBoardLogger,
        }
        kwargs["logger"] = [kinds[c.class_path](**vars(c.init_args)) for c in configs]
    return kwargs


def last_checkpoint(default_root_dir: str | Path = ".") -> str | None:
    """The newest ``last.ckpt`` under the root (``cli.py``'s ``--ckpt_path last``), or None when there is none."""
    from app.cli import newest_last_ckpt

    root = Path(default_root_dir)
    found = newest_last_ckpt(root / "lightning_logs", root)
    return None if found is None else str(found)
