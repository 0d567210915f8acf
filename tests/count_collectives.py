"""A test-only callback: the collectives of some training steps on each rank, from one batch's start to a later one's.

Two records, written to ``folder/rank<N>.json``: every gloo operation run in that time (torch.profiler's ``gloo:*``
events: DDP's gradient buckets in C++ included), and each ``torch.distributed`` call Python code made, with its
``async_op`` (a call without it blocks the host until every rank has made it).

The Python calls are counted where they are made, so exactly. The gloo operations run on gloo's own threads, an
asynchronous one (DDP's bucket, Preemption's flag) when that thread gets to it: one started just before the window
can run inside it, and one started inside at its end can run after it. Counted over several steps, each edge moves
the count by at most one per kind of collective."""

import json
import os
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback
from torch.profiler import ProfilerActivity, profile

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "broadcast_object_list", "reduce", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
)  # fmt: skip


class CountCollectives(Callback):
    def __init__(self, folder: str, batch: int = 4, steps: int = 1) -> None:
        """
        Args:
            folder: Where each rank writes what it counted.
            batch: The first batch whose step is counted (a later one than DDP's first two, which set up its buckets).
            steps: How many steps are counted, from that batch on.
        """
        self.folder, self.batch, self.steps = Path(folder), batch, steps
        self.calls: list[list] = []
        self._profiler = None
        self._originals: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.batch:
            self._start()
        elif batch_idx == self.batch + self.steps:  # (Lightning's loop has begun it: what it does first is counted)
            self._stop(trainer)

    def _start(self) -> None:
        for name in COLLECTIVES:
            original = self._originals[name] = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls.append([_name, bool(kwargs.get("async_op", False))])
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()

    def _stop(self, trainer) -> None:
        self._profiler.__exit__(None, None, None)
        for name, original in self._originals.items():
            setattr(dist, name, original)
        gloo = [event.name for event in self._profiler.events() if event.name.startswith("gloo:")]
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"gloo": sorted(gloo), "python": self.calls, "pid": os.getpid()}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
