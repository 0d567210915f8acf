"""``ddp`` and ``ddp_spawn``: Lightning's DDPStrategy with two options that save work and change nothing trained.

Lightning wraps the model in ``DistributedDataParallel`` on any number of devices, one included. Its defaults copy
every gradient into a communication bucket and back after the all-reduce, and broadcast every BatchNorm buffer
from rank 0 before each forward. On one GPU that was 0.865x single-device speed (issue 44). The template's ``ddp``
and ``ddp_spawn`` differ from Lightning's in two defaults, both given way to a value the run sets itself
(``--trainer.strategy=ddp --trainer.strategy.broadcast_buffers=true`` or a ``DDPStrategy(...)`` in Python):

- ``gradient_as_bucket_view=True``: the gradients are views of the buckets, so nothing is copied in or back.
  The values are the same; an optimizer still sees ``param.grad`` (what it must not do is ``grad.detach_()``).
- ``broadcast_buffers=False`` in a world of one process only: there the broadcast copies rank 0's buffers onto
  themselves. With several ranks it stays on, since without it each rank would validate with its own BatchNorm
  statistics (rank 0's, which the checkpoint holds, are the same either way).

``static_graph`` stays off: a task whose steps use different parameters (a fork's branch, a frozen layer) would
fail with it. Lightning's own class stays available by class path (``lightning.pytorch.strategies.DDPStrategy``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from typing_extensions import override


class DDPStrategy(LightningDDPStrategy):
    """Lightning's DDPStrategy with ``gradient_as_bucket_view=True`` and, in a world of one, no buffer broadcast."""

    def __init__(self, *args: Any, gradient_as_bucket_view: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, gradient_as_bucket_view=gradient_as_bucket_view, **kwargs)

    @override
    def configure_ddp(self) -> None:
        if self.world_size == 1:
            self._ddp_kwargs.setdefault("broadcast_buffers", False)  # rank 0's buffers onto rank 0's: no work
        super().configure_ddp()
