"""``strategy="dp"``: ``torch.nn.DataParallel``'s mechanics as a Lightning 2.x Strategy.

One process drives N devices. Every step:

1. **scatter** the batch into N chunks along dim 0 (``torch.chunk`` sizes: 10 samples on 4 devices -> 3,3,3,1);
2. **replicate** the module onto the N devices (parameters are broadcast; gradients flow back and add up);
3. **parallel_apply**: replica i runs its own ``training_step`` / ``validation_step`` / ``test_step`` /
   ``predict_step`` on chunk i, in one thread per device;
4. **gather** the outputs to the first device: 0-dim values (the loss) are averaged weighted by chunk size, so an
   uneven last batch gives the full-batch mean; per-sample tensors (predictions, targets) are concatenated.

Lightning 2.x dropped this strategy (and the ``*_step_end`` hooks it relied on). Its generic
``_ForwardRedirection`` would run the root module's step on every chunk, so each replica's step is called here
directly. Metric updates and ``self.log`` belong in the ``on_*_batch_end`` hooks, which run once on the root module
with the gathered outputs: a replica, and any state it changes, is thrown away after the step. As in
``nn.DataParallel``, BatchNorm normalises each chunk on its own, and only device 0's replica updates the running
statistics (it shares the root module's buffers).

On CPU (``--trainer.accelerator=cpu --trainer.devices=N``) the same split / per-chunk step / combine path runs
sequentially on the one CPU module, with the same BatchNorm bookkeeping, so the logic is tested without GPUs.

DataParallel's costs hold here too: one Python process (the GIL) feeds every device, and device 0 does
extra work (gathering outputs, the optimizer step, holding the master weights). Use ``ddp`` to scale; ``dp`` is
for one machine when a single-process workflow matters more than speed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.nn.parallel import parallel_apply, replicate
from torch.nn.parallel.scatter_gather import scatter
from typing_extensions import override

from app.errors import UserError
from app.launch.launcher import mpi_world_size


class DataParallelStrategy(ParallelStrategy):
    strategy_name = "dp"
    starts_own_workers = True  # its replicas are threads of this one process (app/parallelism.py)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``dp``, the name Lightning 2.0 removed (ours alone: registering it again changes nothing)."""
        description = "torch.nn.DataParallel: one process, the batch split across devices"
        strategy_registry.register("dp", cls, description=description, override=True)

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision_plugin=None) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # ---------------------------------------------------------------- one process: rank 0 of 1
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def is_global_zero(self) -> bool:
        return True

    # ---------------------------------------------------------------- its Parallelism (app/parallelism.py)
    @property
    def devices_per_process(self) -> int:
        """The data module loads this many devices' batches per step (``--data.batch_size`` is per device)."""
        return len(self.parallel_devices)

    stages = 1  # no pipeline
    data_parallel_size = 1  # one process takes each whole global batch, and splits it over its devices
    sharded = False  # the root module holds every weight

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:
        return None

    @override
    def _configure_launcher(self) -> None:
        """Called when the Trainer is built: one process needs no launcher, and must not be one of many."""
        if mpi_world_size() > 1:
            raise UserError(
                "--trainer.strategy=dp runs in one process, but this process was started by an MPI launcher with "
                f"{mpi_world_size()} ranks; run it without mpirun, or use --trainer.strategy=horovod under mpirun"
            )
        self._launcher = None

    @override
    def model_to_device(self) -> None:
        """Called in set-up, after the task's ``configure_model`` (where a task compiles its network). On one device
        dp neither replicates nor splits (as ``nn.DataParallel``), so a compiled module runs as on a single device."""
        compiled = compiled_modules(self.model) if len(self.parallel_devices) > 1 else []
        if compiled:
            raise UserError(
                f"--trainer.strategy=dp cannot run a compiled module ({compiled[0]}: torch.compile, or the task's "
                "own compile option): dp rebuilds its replicas every step; use ddp, or dp on one device"
            )
        self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass  # one process: nothing to wait for

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor  # already the value of the whole batch: the outputs were gathered

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    # ---------------------------------------------------------------- the steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._data_parallel("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._data_parallel("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._data_parallel("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._data_parallel("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    def _data_parallel(self, step: str, precision_context, batch: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if len(self.parallel_devices) == 1:  # as nn.DataParallel: nothing to split, replicate or gather
            return getattr(module, step)(batch, *args, **kwargs)
        if self.root_device.type == "cuda":
            chunks = scatter(batch, [d.index for d in self.parallel_devices], dim=0)
            replicas = replicate(module, self.parallel_devices[: len(chunks)], detach=not torch.is_grad_enabled())
            outputs = parallel_apply(
                [in_context(getattr(replica, step), precision_context) for replica in replicas],
                [(chunk, *args) for chunk in chunks],
                [kwargs] * len(chunks),
                self.parallel_devices[: len(chunks)],
            )
        else:
            chunks = split_batch(batch, len(self.parallel_devices))
            outputs = [getattr(module, step)(chunks[0], *args, **kwargs)]
            for chunk in chunks[1:]:
                # Like replicas 1..N-1 of nn.DataParallel, the other chunks must not change the root's buffers
                # (BatchNorm running statistics): they run on throw-away copies, only chunk 0's update is kept.
                with scratch_buffers(module):
                    outputs.append(getattr(module, step)(chunk, *args, **kwargs))
        return combine_outputs(outputs, [batch_len(chunk) for chunk in chunks], self.root_device)


def in_context(function, context):
    """``function`` run inside ``context()``, entered in the thread that runs it.

    Autocast is thread-local. ``parallel_apply`` re-enters it in each replica's thread, but as
    ``torch.amp.autocast(device, enabled=...)``, the device's default dtype (float16 on CUDA): under bf16-mixed the
    replicas would compute in float16. The precision plugin's own context restores its dtype.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return function(*args, **kwargs)

    return run


@contextmanager
def scratch_buffers(module: torch.nn.Module):
    """Give every buffer of ``module`` a fresh copy for the duration, then put the originals back untouched."""
    originals = [(m, name, buf) for m in module.modules() for name, buf in m.named_buffers(recurse=False)]
    for m, name, buf in originals:
        setattr(m, name, buf.clone())
    try:
        yield
    finally:
        for m, name, buf in originals:
            setattr(m, name, buf)


def batch_len(batch: Any) -> int:
    """The size of dim 0 of the first tensor in a (nested) batch."""
    if isinstance(batch, Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        size = batch_len(value)
        if size:
            return size
    return 0


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split every tensor of a (nested) batch along dim 0 as ``torch.chunk`` does; other values are repeated."""
    count = len(torch.empty(batch_len(batch), 0).chunk(n)) if batch_len(batch) else 1

    def split(obj: Any) -> list[Any]:
        if isinstance(obj, Tensor):
            return list(obj.chunk(n))
        if isinstance(obj, (list, tuple)):
            columns = [split(v) for v in obj]
            return [type(obj)(column[i] for column in columns) for i in range(count)]
        if isinstance(obj, dict):
            columns = {k: split(v) for k, v in obj.items()}
            return [{k: v[i] for k, v in columns.items()} for i in range(count)]
        return [obj] * count

    return split(batch)


def combine_outputs(outputs: list[Any], sizes: list[int], device: torch.device) -> Any:
    """Gather per-chunk step outputs onto ``device``: scalars weighted by chunk size, batches concatenated."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            total = sum(sizes)
            return sum(out.to(device) * (size / total) for out, size in zip(outputs, sizes, strict=True))
        return torch.cat([out.to(device) for out in outputs])
    if isinstance(first, dict):
        return {key: combine_outputs([out[key] for out in outputs], sizes, device) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(combine_outputs([out[i] for out in outputs], sizes, device) for i in range(len(first)))
    return first


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules compiled in place (``Module.compile``) or wrapped by ``torch.compile``."""
    return [
        name or type(model).__name__
        for name, module in model.named_modules()
        if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")
    ]
