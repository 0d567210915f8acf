"""What the template's loader and callbacks read from a strategy, beyond Lightning's ranks: :class:`Parallelism`.

Lightning's strategies say how many processes there are (``world_size``) and which one this is. The template's
strategies also differ in what one process drives and holds, and the loader and callbacks need to know:

- ``devices_per_process``: ``dp`` drives all its devices from one process, which loads their batches together;
- ``stages``: a ``pipeline`` cuts the network into stages, and every stage of a replica sees each of its samples;
- ``data_parallel_size``: into how many slices each global batch is dealt (the processes, or a pipeline's
  replicas: world size / stages);
- ``sharded``: no process holds the whole model and optimizer state (``fsdp`` once it has sharded the model, a
  ``pipeline`` once it has cut it): a lost rank's part is gone, and the ranks must agree on what each one sees.

A strategy states them by implementing the four as attributes or properties (``dp``, ``fsdp`` and ``pipeline`` do);
readers ask :func:`parallelism`, which answers for any other strategy (Lightning's ``ddp``, ``ddp_spawn``, one
device, the template's ``horovod``, a user's) as plain data parallelism: one device per process, no stages, the
data split over every process, nothing sharded. A new strategy that differs implements :class:`Parallelism`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Parallelism(Protocol):
    @property
    def devices_per_process(self) -> int: ...

    @property
    def stages(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def sharded(self) -> bool: ...


FIELDS = ("devices_per_process", "stages", "data_parallel_size", "sharded")


@dataclass(frozen=True)
class DataParallel:
    """Any strategy that does not implement :class:`Parallelism`: plain data parallelism."""

    data_parallel_size: int
    devices_per_process: int = 1
    stages: int = 1
    sharded: bool = False


def parallelism(strategy) -> Parallelism:
    """The strategy itself when its class implements :class:`Parallelism` (looked up on the class: no property is
    run to find out), else :class:`DataParallel` over its processes."""
    if all(hasattr(type(strategy), name) for name in FIELDS):
        return strategy
    return DataParallel(data_parallel_size=getattr(strategy, "world_size", 1))
