"""``ddp`` and ``ddp_spawn``: Lightning's DDPStrategy with two options that save work and change nothing trained.

Lightning wraps the model in ``DistributedDataParallel`` on any number of devices, one included. Its defaults copy
every gradient into a communication bucket and back after the all-reduce, and broadcast every BatchNorm buffer
from rank 0 before each forward. On one GPU that was 0.865x single-device speed (issue 44). The template's ``ddp``
and ``ddp_spawn`` differ from Lightning's in two defaults, both given way to a value the run sets itself
(``--trainer.strategy=app.strategies.DDPStrategy --trainer.strategy.broadcast_buffers=true``, or
``DDPStrategy(...)`` in Python):

- ``gradient_as_bucket_view=True``: the gradients are views of the buckets, so nothing is copied in or back.
  The values are the same; an optimizer still sees ``param.grad`` (what it must not do is ``grad.detach_()``).
- no buffer broadcast (``broadcast_buffers=False``; ``forward_sync_buffers=False`` from torch 2.14) in a world of one
  process only: there the broadcast copies rank 0's buffers onto themselves. With several ranks it stays on, since
  without it each rank would validate with its own BatchNorm statistics (rank 0's, which the checkpoint holds, are
  the same either way).

And on a GPU the model is wrapped on the current CUDA stream. Lightning wraps it on a new side stream (the recipe
for capturing a whole DDP step in one CUDA graph by hand). Under ``torch.compile(mode="reduce-overhead")`` that made
every backward run into AccumulateGrad nodes of another stream, which torch warns "may incur unnecessary
synchronization and break CUDA graph capture"; ``cli.py fit --trainer.strategy=ddp`` compiled ran 2.8x slower than
one device on an H200 (issue 44). torch's own advice is to build DDP on the stream of the forwards. (Measured on an
H200 at e35ee52: the warning is gone and the device time per step fell from 8.04 to 7.02 ms; the host's 10.8 ms, and
so the gap, stay.)

``static_graph`` stays off: a task whose steps use different parameters (a fork's branch, a frozen layer) would
fail with it. Lightning's own class stays available by class path (``lightning.pytorch.strategies.DDPStrategy``).
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

_BUFFER_SYNC = {"broadcast_buffers", "forward_sync_buffers"}


def _buffer_sync_argument() -> str:
    """DDP's switch for the buffer broadcast before each forward: ``forward_sync_buffers`` from torch 2.14 on, which
    deprecates ``broadcast_buffers`` with a FutureWarning."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"


class DDPStrategy(LightningDDPStrategy):
    """Lightning's DDPStrategy with ``gradient_as_bucket_view=True`` and, in a world of one, no buffer broadcast."""

    def __init__(self, *args: Any, gradient_as_bucket_view: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, gradient_as_bucket_view=gradient_as_bucket_view, **kwargs)

    @override
    def configure_ddp(self) -> None:
        if self.world_size == 1 and not _BUFFER_SYNC.intersection(self._ddp_kwargs):
            self._ddp_kwargs[_buffer_sync_argument()] = False  # rank 0's buffers onto rank 0's: no work
        super().configure_ddp()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        """DDP on the current stream (Lightning's wraps it on a side stream on GPUs)."""
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)
