"""A test-only callback: after a given optimizer step, the worker of a "node" SIGKILLs its torchrun agent and itself.

Only the worker whose agent was started with ``LOSE_THIS_NODE=1`` does it, and only on torchrun's first start: the
node is gone for good, as when a machine is lost.
"""

import os
import signal

from lightning.pytorch import Callback


class LoseNodeAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.step and os.environ.get("LOSE_THIS_NODE") == "1" and first_start:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: it cannot restart this worker
            os.kill(os.getpid(), signal.SIGKILL)
