"""Library messages that say nothing to a user of this template, silenced one by one.

Each filter matches one message from one module, and says why it is silenced; every other warning, the user's
own included, still shows.
"""

from __future__ import annotations

import logging
import warnings


class _DropMessage(logging.Filter):
    def __init__(self, startswith: str) -> None:
        super().__init__()
        self.startswith = startswith

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.startswith)

    def __eq__(self, other: object) -> bool:  # install() twice adds each filter once (Logger.addFilter checks `in`)
        return isinstance(other, _DropMessage) and other.startswith == self.startswith

    def __hash__(self) -> int:
        return hash(self.startswith)


def install() -> None:
    """Install the filters (again: each is added once)."""
    # Lightning 2.6's own pytree helper calls a torch API that torch deprecated; nothing a user can change.
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)", module=r"lightning\.pytorch\.utilities\._pytree"
    )
    # Short runs (tests, smoke runs) have fewer batches than log_every_n_steps; the template logs every epoch's
    # metrics whatever the interval, so nothing is missing from metrics.csv.
    warnings.filterwarnings(
        "ignore", message=r"The number of training batches .* is smaller than the logging interval",
        module=r"lightning\.pytorch\.loops\.fit_loop",
    )  # fmt: skip
    # A resumed run logs to a new version folder by design, so the checkpoint folder always "changes"; the resumed
    # run keeps its own best checkpoints from then on.
    warnings.filterwarnings(
        "ignore", message=r"The dirpath has changed from", module=r"lightning\.pytorch\.callbacks\.model_checkpoint"
    )
    # Every run gets a version folder of its own (app/run_dir.py); the one folder a logger finds non-empty is that of
    # an elastic restart continuing its run, whose metrics.csv was moved aside first and is written back in full.
    warnings.filterwarnings(
        "ignore", message=r"Experiment logs directory .* exists and is not empty",
        module=r"lightning\.fabric\.loggers\.csv_logs",
    )  # fmt: skip
    # Under 16-mixed/bf16-mixed the parameters are stored in float32, which is what the summary then assumes: the
    # size it prints is right, the warning (every bf16-mixed run) is not.
    warnings.filterwarnings("ignore", message=r"Precision (16|bf16)-mixed is not supported by the model summary")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    # An advertisement for a cloud service, printed by every Trainer.
    rank_zero.addFilter(_DropMessage("💡 Tip: For seamless cloud"))
    # The template's default RichModelSummary is there on purpose; Lightning notes that it adds no second one.
    rank_zero.addFilter(_DropMessage("Trainer already configured with model summary callbacks"))


class HeldRecords(logging.Filter):
    """Holds a logger's records back until :meth:`release`; :meth:`drop` discards them.

    Lightning seeds (and logs "Seed set to 42") before it builds the model and the data module, which check their
    arguments: an error there would follow the seed line. The line waits until the classes are built."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger, self.records = logging.getLogger(name), []
        self.logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def drop(self) -> None:
        self.logger.removeFilter(self)
        self.records.clear()

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()
