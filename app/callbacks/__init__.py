"""Lightning callbacks of the template; each can be added with ``--trainer.callbacks+=app.callbacks.NAME``."""

from app.callbacks.epoch_summary import EpochSummary

__all__ = ["EpochSummary"]
