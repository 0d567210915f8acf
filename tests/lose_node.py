"""Test-only callbacks for the elastic tests: a node that is lost, and a run that waits for a node to join.

Each acts only on the launcher's first start (torchrun's ``TORCHELASTIC_RESTART_COUNT`` or the horovod
self-launch's ``TEMPLATE_MPI_RESTART`` 0) and in the process it names, so the restarted job runs undisturbed.
"""

import os
import signal
import threading
import time
from pathlib import Path

from lightning.pytorch import Callback

from app.callbacks import Preemption


class LoseNodeAtStep(Callback):
    """After ``step``, the worker whose agent was started with ``LOSE_THIS_NODE=1`` SIGKILLs its torchrun agent and
    itself: the node is gone for good, as when a machine is lost."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.step and os.environ.get("LOSE_THIS_NODE") == "1" and first_start:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: it cannot restart this worker
            os.kill(os.getpid(), signal.SIGKILL)


class HangNodeAtStep(Callback):
    """After ``step``, the worker whose agent was started with ``LOSE_THIS_NODE=1`` stops (SIGSTOP) its torchrun agent
    and itself, after writing both pids to ``$HANG_PIDS`` (for the test to kill): nothing closes their connections,
    as when a link is cut or a host hangs, so the other node's collectives wait instead of failing."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.step and os.environ.get("LOSE_THIS_NODE") == "1" and first_start:
            with open(os.environ["HANG_PIDS"], "w") as f:
                f.write(f"{os.getppid()} {os.getpid()}\n")
            os.kill(os.getppid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)


class PauseAtStep(Callback):
    """On the launcher's first start, each rank of ``ranks`` (all by default) writes ``paused-<rank>`` into ``folder``
    and waits (up to ``timeout`` s) for a file ``go`` there; the others write ``passed-<rank>`` and go on. The test
    does something to the nodes (cuts a link) at a known point, however fast the steps are. ``where``:

    - ``"step"``: after optimizer step ``step``, between two steps;
    - ``"backward"``: before the backward pass of the batch after step ``step``: the ranks that go on are inside
      that backward's gradient all-reduce, waiting for the paused ones;
    - ``"save"``: inside the first checkpoint save after step ``step`` (its ``on_save_checkpoint``, after the
      callbacks' states were gathered): the ranks that go on wait at the save's barrier.
    """

    def __init__(
        self, step: int, folder: str, where: str = "step", ranks: list[int] | None = None, timeout: float = 120
    ) -> None:
        assert where in ("step", "backward", "save"), where
        self.step, self.folder, self.where, self.ranks, self.timeout = step, Path(folder), where, ranks, timeout
        self.done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.where == "step":
            self._pause(trainer)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.where == "backward":
            self._pause(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # the save of the training loop, not a rank watchdog's save from its own thread
        if self.where == "save" and threading.current_thread() is threading.main_thread():
            self._pause(trainer, at_least=True)

    def _pause(self, trainer, at_least: bool = False) -> None:
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        at = trainer.global_step >= self.step if at_least else trainer.global_step == self.step
        if self.done or not at or not first_start:
            return
        self.done = True
        self.folder.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        if self.ranks is not None and rank not in self.ranks:
            (self.folder / f"passed-{rank}").touch()
            return
        (self.folder / f"paused-{rank}").touch()
        deadline = time.monotonic() + self.timeout
        while not (self.folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class LoseRankAtStep(Callback):
    """After ``step``, rank ``rank`` of the horovod strategy's first mpirun launch SIGKILLs itself (a rank lost)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        first_start = os.environ.get("TEMPLATE_MPI_RESTART", "0") == "0"
        if trainer.global_step == self.step and trainer.global_rank == self.rank and first_start:
            os.kill(os.getpid(), signal.SIGKILL)


class WaitForNodeAtStep(Callback):
    """After ``step`` of a run of ``world_size`` processes, wait (up to ``timeout`` s) until the launcher stops this
    worker with SIGTERM, as torchrun does when another node joins: the join then comes at a known step."""

    def __init__(self, step: int, world_size: int, timeout: float = 240) -> None:
        self.step, self.world_size, self.timeout = step, world_size, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step or trainer.world_size != self.world_size:
            return
        [preemption] = [c for c in trainer.callbacks if isinstance(c, Preemption)]
        deadline = time.monotonic() + self.timeout
        while not preemption.received and time.monotonic() < deadline:
            time.sleep(0.1)


class LoseNodeInStopFlag(Callback):
    """The node is lost while the other rank waits for Preemption's stop flag: the worker with ``LOSE_THIS_NODE=1``
    issues no stop-flag all-reduce after ``step`` and dies in the next step, after its gradients were reduced. The
    survivor's wait for that flag (in its ``on_train_batch_end``, after its optimizer step) is the collective that
    fails, as it is when a busy machine holds back the flag's exchange until the node is gone."""

    def __init__(self, step: int) -> None:
        self.step = step

    def _mine(self, trainer) -> bool:
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        return os.environ.get("LOSE_THIS_NODE") == "1" and first_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._mine(trainer) and trainer.global_step == self.step - 1:  # the batch that ends at ``step``
            import torch.distributed as dist

            [preemption] = [c for c in trainer.callbacks if isinstance(c, Preemption)]
            all_reduce = dist.all_reduce

            def no_flag(tensor, *args, group=None, **kwargs):
                if group is not None and group is preemption._group:
                    return _Done()
                return all_reduce(tensor, *args, group=group, **kwargs)

            dist.all_reduce = no_flag

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._mine(trainer) and trainer.global_step == self.step:  # the next step's gradients are reduced
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class _Done:
    def wait(self) -> bool:
        return True
