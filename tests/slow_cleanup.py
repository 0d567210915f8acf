"""A test-only callback: rank 0 takes its time in ``on_exception``, as a logger uploading its files does."""

import time

from lightning.pytorch import Callback


class SlowCleanup(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  # longer than the 5 s poll of Lightning's child-process observer

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if trainer.global_rank == 0:
            time.sleep(self.seconds)
