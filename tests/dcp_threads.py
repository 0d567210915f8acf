"""A test-only callback: each DCP save (``torch.distributed.checkpoint.save``) of this rank notes the thread it ran
on, one line per save, in ``$DCP_THREADS/rank<N>.txt``: whether fsdp's sharded saves ran in the background."""

import os
import threading
from pathlib import Path

import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback


class DCPThreads(Callback):
    def setup(self, trainer, pl_module, stage: str) -> None:
        notes, save = Path(os.environ["DCP_THREADS"]) / f"rank{trainer.global_rank}.txt", dcp.save

        def noted(*args, **kwargs):
            with notes.open("a") as out:
                out.write(threading.current_thread().name + "\n")
            return save(*args, **kwargs)

        dcp.save = noted
