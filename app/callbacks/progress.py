"""Lightning's rich progress bar, redrawn a few times a second instead of after every batch.

Two things in Lightning 2.6 make a GPU wait for the host at every training step when a progress bar is shown:

- ``RichProgressBar`` redraws after every batch and reads the progress-bar metrics each time (its
  ``refresh_rate`` only switches it on or off);
- every value logged with ``prog_bar=True, on_step=True`` is turned into a Python float after every batch, by the
  trainer itself, whether or not a bar is drawn.

Reading a tensor's value on the host waits for the device to compute it, so the next step cannot be queued while
the GPU works, and the redraw's host time is time the GPU idles. :class:`ProgressBar` draws at most every
``refresh_seconds`` (and at each loop's first and last batch), and shows the task's per-step values
(``TaskSpec.step_values``: the example's ``train/loss``) by reading them when it draws, so they need not be logged
with ``prog_bar=True``.

Output that does not reach a terminal (a log file, a pipe) gets plain lines: rich tells by ``isatty()``, except
under ``mpirun``, whose ranks all write to a pseudo-terminal of its own (see :func:`plain_under_the_launcher`).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.launch.launcher import launcher_ranks
from app.task import step_values


def live_bar_console(trainer: Trainer) -> Any:
    """The console of a rich progress bar live in this process, or None.

    While the bar is live it redraws by moving the cursor up, and erases or overdraws whatever was written to the
    terminal outside its console; that console prints lines above the bar."""
    bar = trainer.progress_bar_callback
    progress = getattr(bar, "progress", None) if isinstance(bar, RichProgressBar) else None
    return progress.console if progress is not None and progress.live.is_started else None


def console_print(trainer: Trainer, message: Any) -> None:
    """Print a line or a rich renderable on global rank 0 so that it stays on the screen (above a live bar)."""
    if not trainer.is_global_zero:
        return
    console = live_bar_console(trainer)
    if console is not None:
        console.print(message, markup=False, highlight=False, soft_wrap=isinstance(message, str))
    elif isinstance(message, str):
        rank_zero_info(message)
    else:
        from rich.console import Console

        Console().print(message)


def plain_under_the_launcher() -> None:
    """Under an MPI launcher, make rich print plain lines when the launcher's own output is no terminal.

    Open MPI's ``mpirun`` gives every rank a pseudo-terminal as its stdout and copies what comes out of it to its own
    stdout, which is as often a log file (``mpirun ... > train.log``, a batch job) as a terminal. Rich asks the rank's
    stdout, always a terminal then, so the bar redrew itself into the log several times a second. Where the output
    really goes is the stdout of the nearest ancestor process that does not write into this one's terminal: mpirun
    (or its daemon on another node). When that is no terminal, or cannot be read, ``TTY_COMPATIBLE=0`` (rich's own
    switch, which the horovod strategy's self-launch sets for its ranks likewise) makes every rich console of this
    process plain, the bar's, the model summary's and the run report's alike. A ``TTY_COMPATIBLE`` or ``FORCE_COLOR``
    set by the user is kept.
    """
    if launcher_ranks() is None or "TTY_COMPATIBLE" in os.environ or "FORCE_COLOR" in os.environ:
        return
    try:
        ours = os.fstat(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout replaced (captured): rich does not draw a bar on it
        return
    if not os.isatty(sys.stdout.fileno()):
        return  # rich sees no terminal already
    if not _launcher_writes_to_a_terminal((ours.st_dev, ours.st_ino)):
        os.environ["TTY_COMPATIBLE"] = "0"


def _launcher_writes_to_a_terminal(ours: tuple[int, int]) -> bool:
    """Whether the nearest ancestor whose stdout is not the file ``ours`` (device, inode) writes to a terminal."""
    pid = os.getppid()
    for _ in range(16):  # mpirun, or a shell or two between it and the rank (``mpirun sh -c "python ..."``)
        if pid <= 1:
            return False
        try:
            theirs = os.stat(f"/proc/{pid}/fd/1")
            if (theirs.st_dev, theirs.st_ino) != ours:
                if not stat.S_ISCHR(theirs.st_mode):  # a file or a pipe
                    return False
                fd = os.open(f"/proc/{pid}/fd/1", os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
                try:
                    return os.isatty(fd)  # a terminal, not /dev/null
                finally:
                    os.close(fd)
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent
        except (OSError, ValueError, IndexError):  # not Linux, or not ours to read: plain lines are always readable
            return False
    return False


class _CurrentStderr:
    """A stream that writes to ``sys.stderr`` as it is at each write, not as it was when a handler was made."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def log_above_the_bar() -> None:
    """Make Lightning's own lines ("`Trainer.fit` stopped: ...") print above a live bar, not over it.

    Lightning's loggers print through a ``StreamHandler`` that holds the ``sys.stderr`` of import time. While the bar
    is live in a terminal, rich replaces ``sys.stderr`` with a proxy that prints above the bar; a write to the old
    stream lands at the cursor instead, on the bar's line, and the next redraw leaves a copy of the bar behind.
    """
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stderr__, sys.stderr):
                handler.setStream(_CurrentStderr())


class ProgressBar(RichProgressBar):
    """``RichProgressBar`` redrawn at most every ``refresh_seconds`` (and at the first and last batch of each loop).

    Args:
        refresh_seconds: Least time between two redraws. 0 redraws after every batch, as Lightning does.
        show: Values to show besides those logged with ``prog_bar=True``, read only when the bar redraws: from the
            module's latest training step's values (``TaskSpec.step_values``) when it has them, else logged ones.
            Default: every one of the task's step values (the example's ``train/loss``).
        **kwargs: ``RichProgressBar``'s arguments (``leave``, ``theme``, ``console_kwargs``, ...).
    """

    def __init__(self, refresh_seconds: float = 0.5, show: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if refresh_seconds < 0:
            raise ValueError(f"refresh_seconds must be >= 0, got {refresh_seconds}")
        self.refresh_seconds = refresh_seconds
        self.show = None if show is None else list(show)  # None: every value of the task's step_values
        self._drawn_at = float("-inf")
        self._trained_batches = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        plain_under_the_launcher()  # before the bar's console is made (at the first loop's start)
        if self.is_enabled:
            log_above_the_bar()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Every rank reads the epoch's metrics here, together, before rank 0's bar does.

        Lightning's bar reads them on rank 0 only, and the first read of the epoch computes the torchmetrics objects a
        module logged with ``on_epoch=True`` in ``training_step``: a collective. Alone on rank 0 it waited forever
        for the other ranks (a fork's task hung under ddp and horovod; Lightning issue 21264). Later reads, the
        bar's and the loggers', get the values computed here."""
        if trainer.world_size > 1:
            trainer.progress_bar_metrics  # noqa: B018  (the read is the point: it computes on every rank)
        super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The bar is finished: leave it where it is, so what is printed at the end of the run (the run report)
        comes below it, not above a bar redrawn under everything."""
        if self.progress is not None:
            if self.train_progress_bar_id is not None:  # the batches trained since the last redraw: a run that
                # max_steps ended inside an epoch left "1/184 ... 0.00it/s" on a screen that had trained 2
                self.progress.update(self.train_progress_bar_id, completed=self._trained_batches)
                self.refresh()
            self.progress.stop()  # Lightning's teardown stops it again (a no-op) and prepares the next stage's

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A stop (SIGINT, SIGTERM) or a failure ends the bar where training got to: it said 250/430 under the line
        "stopped after step 261" (a helper's run, as a user would see it)."""
        if self.progress is not None and self.train_progress_bar_id is not None and trainer.training:
            self.progress.update(self.train_progress_bar_id, completed=self._trained_batches)
            self.refresh()
        super().on_exception(trainer, pl_module, exception)

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the version folder: printed once at the start, not worth a place on the bar
        # The module's latest step values first (a task may keep them every step but log them only at the steps
        # where they are written or read: TaskSpec.step_values), then what was logged.
        latest = step_values(pl_module)
        logged = trainer.callback_metrics
        for name in latest if self.show is None else self.show:
            value = latest.get(name, logged.get(name))
            if value is not None and name not in items:
                items[name] = float(value)  # the one read of the device per redraw
        return items

    def _due(self, batch_idx: int, total: float) -> bool:
        now = time.monotonic()
        # the first batch too: rich's it/s needs two updates of the loop's bar
        if batch_idx == 0 or batch_idx + 1 >= total or now - self._drawn_at >= self.refresh_seconds:
            self._drawn_at = now
            return True
        return False

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._trained_batches = batch_idx + 1  # drawn at the end of training, whether this batch was drawn or not
        if not self.is_disabled and self._due(batch_idx, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.is_disabled:  # ranks other than 0 draw nothing (and have no loop indices to read)
            return
        if trainer.sanity_checking or self._due(batch_idx, self.total_val_batches_current_dataloader):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_test_batches_current_dataloader):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_predict_batches_current_dataloader):
            super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
