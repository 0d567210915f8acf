"""``strategy="horovod"``: Horovod's programming model as a Lightning 2.x Strategy, with or without Horovod.

Launch it the way Horovod users do, one process per device::

    horovodrun -np 4 python cli.py fit --trainer.strategy=horovod
    mpirun -np 4 python cli.py fit --trainer.strategy=horovod --trainer.devices=4
    python cli.py fit --trainer.strategy=horovod --trainer.devices=4      # starts mpirun -np 4 itself

Each rank takes the GPU of its local rank, or, when the launcher bound one GPU to each rank (``srun
--gpus-per-task=1``: it is alone in the rank's ``CUDA_VISIBLE_DEVICES``), that one.

Ranks come from MPI, and a ``torch.distributed`` process group (nccl on GPU, gloo on CPU) whose rendezvous address
is sent over MPI carries the collectives. The ``horovod`` package itself is not used: its last release (0.28.1) does
not build against torch >= 2.1, which Lightning 2.6 needs (its ``horovod.torch`` backend is retired:
docs/strategies.md).

Horovod semantics:

- at start, parameters, buffers and optimizer state are broadcast from rank 0;
- gradients are reduced like ``hvd.DistributedOptimizer``, in fusion buckets (``fusion_mb``, Tensor Fusion) whose
  allreduce starts during backward as soon as the bucket is complete, all waited for before ``optimizer.step()``:
  DDP's reducer does this, with Horovod's reduction as its communication hook;
- ``op`` (``average``, ``sum``, or ``adasum`` of the local optimizer steps), ``compression`` (``none``, ``fp16``,
  ``bf16``: what travels is 16 bits wide) and ``gradient_predivide_factor`` (divide by f before the sum and by
  size/f after) mean what they mean in Horovod; the reductions live in :mod:`app.strategies.reductions`;
- with ``accumulate_grad_batches=k``, gradients are communicated once per optimizer step, not every batch;
- ``barrier()`` is a real barrier; ``reduce``/``all_gather``/``broadcast`` serve metrics and logging;
- the learning rate is NOT scaled by the number of ranks behind your back (Lightning 1.x did that); scale it
  yourself, or use the LR warmup callback's linear scaling rule.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from app.errors import UserError
from app.launch.launcher import launcher_ranks, one_gpu_per_rank
from app.strategies.launchers.mpirun import MPILaunchEnvironment, MPIRunLauncher
from app.strategies.reductions import (
    FUSION_MB,
    WIRE_DTYPES,
    AdasumDelta,
    Compression,
    ReduceOp,
    fused_allreduce,
    is_power_of_two,
)


class HorovodStrategy(ParallelStrategy):
    strategy_name = "horovod"
    refusals = {"comm_hook": "the horovod strategy compresses with --trainer.strategy.compression=fp16|bf16"}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``horovod``, the name Lightning 2.0 removed (ours alone: registering it again changes nothing)."""
        strategy_registry.register(
            "horovod", cls, description="Horovod programming model over MPI (horovodrun / mpirun)", override=True
        )

    def __init__(
        self,
        compression: Compression = "none",
        op: ReduceOp = "average",
        gradient_predivide_factor: float = 1.0,
        fusion_mb: float = FUSION_MB,
        find_unused_parameters: bool = False,
        timeout: float = 1800.0,
        max_restarts: int = 0,
        accelerator=None,
        parallel_devices=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        """
        Args:
            compression: Wire format of what the ranks exchange: ``none``, ``fp16`` or ``bf16``.
            op: ``average`` (Horovod's default) or ``sum`` of the ranks' gradients, or ``adasum`` of their
                optimizer steps (needs a power-of-two number of ranks).
            gradient_predivide_factor: Divide gradients by this before the sum, and by size/this after.
            fusion_mb: Gradients are allreduced in buckets of up to this many MiB (Horovod's Tensor Fusion,
                HOROVOD_FUSION_THRESHOLD): DDP's buckets, whose allreduce overlaps the rest of backward. At the
                default (DDP's 25) the first bucket is 1 MiB, as DDP's; 0 sends every gradient on its own.
            find_unused_parameters: Let parameters get no gradient in a step (DDP's option of that name; it costs
                a walk of the autograd graph per step).
            timeout: Seconds a collective may wait for the other ranks before the run fails.
            max_restarts: When this strategy starts its ranks itself (``--trainer.devices=N``, no mpirun around
                it): after a rank fails, restart up to this many times on the ranks that survived, from the state
                of the last completed step, in the same run folder (see docs/elastic.md).
        """
        if compression not in WIRE_DTYPES:
            raise UserError(f"--trainer.strategy.compression={compression!r} must be one of none, fp16, bf16")
        if op not in ReduceOp.__args__:
            raise UserError(f"--trainer.strategy.op={op!r} must be one of {', '.join(ReduceOp.__args__)}")
        if gradient_predivide_factor <= 0 or (op != "average" and gradient_predivide_factor != 1.0):
            raise UserError(
                "--trainer.strategy.gradient_predivide_factor must be > 0, and 1.0 unless --trainer.strategy.op=average"
            )
        if max_restarts < 0:
            raise UserError(f"--trainer.strategy.max_restarts={max_restarts} must be >= 0 (0: no restarts)")
        if not math.isfinite(timeout) or timeout <= 0:  # torch failed in C++ at the first collective, 100 lines
            raise UserError(f"--trainer.strategy.timeout={timeout:g}: use a finite number of seconds > 0, such as 1800")
        if not math.isfinite(fusion_mb) or fusion_mb < 0:
            raise UserError(f"--trainer.strategy.fusion_mb={fusion_mb} must be a finite number >= 0 (0: no fusion)")
        self.compression, self.op, self.predivide, self.timeout = compression, op, gradient_predivide_factor, timeout
        self.fusion_mb, self.find_unused_parameters, self.max_restarts = fusion_mb, find_unused_parameters, max_restarts
        environment = MPILaunchEnvironment() if MPILaunchEnvironment.detect() else None
        super().__init__(accelerator, parallel_devices, environment, checkpoint_io, precision_plugin)
        self._num_nodes = 1
        self._adasum: AdasumDelta | None = None
        if environment is not None:  # so that only rank 0 prints and logs from the very start
            rank_zero_only.rank = environment.global_rank()

    # ---------------------------------------------------------------- ranks and devices
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def _launched(self) -> bool:
        return isinstance(self.cluster_environment, MPILaunchEnvironment)

    @property
    @override
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self._launched else 0

    @property
    @override
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self._launched else 0

    @property
    @override
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self._launched else 0

    @property
    @override
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self._launched else 1

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        # one device per process of the node; a rank given a GPU of its own (one_gpu_per_rank) has just that one
        return devices[self.local_rank] if len(devices) > 1 and devices[0].type != "cpu" else devices[0]

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning: a user's own training DataLoader gets a DistributedSampler (each rank its shard)."""
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        """Called when the Trainer is built: check the launch, and start mpirun ourselves when there is none."""
        ranks = launcher_ranks()
        if ranks is None:
            if self.num_nodes > 1:
                hosts = ",".join(f"node{i}:{self.num_processes}" for i in range(min(self.num_nodes, 3)))
                hosts += ",..." if self.num_nodes > 3 else ""
                raise UserError(
                    f"--trainer.strategy=horovod with --trainer.num_nodes={self.num_nodes} must be started on every "
                    f"node by a launcher: mpirun -np {self.num_nodes * self.num_processes} -H {hosts} python cli.py "
                    "fit ... (docs/multi-node.md)"
                )
            self._check_adasum_world_size(self.num_processes)
            if self.max_restarts and self.num_processes == 1:
                raise UserError(
                    f"--trainer.strategy.max_restarts={self.max_restarts} restarts a run on the ranks that survive a "
                    "failure; with one device there are none: use --trainer.devices=N (N > 1), or drop max_restarts"
                )
            self._launcher = MPIRunLauncher(self) if self.num_processes > 1 else None
            return
        if self.max_restarts:
            raise UserError(
                f"--trainer.strategy.max_restarts={self.max_restarts} restarts the ranks this strategy starts itself "
                "(python cli.py fit --trainer.strategy=horovod --trainer.devices=N); under your own mpirun or "
                "horovodrun, restarting is the launcher's job: drop max_restarts, or see docs/elastic.md"
            )
        world, _, _, local_size = ranks
        on_cpu = self.parallel_devices is None or self.parallel_devices[0].type == "cpu"
        own_gpu = not on_cpu and self.num_processes == 1 and one_gpu_per_rank()
        if not (self.num_processes == local_size or (on_cpu and self.num_processes == 1) or own_gpu):
            hint = (
                ""
                if on_cpu or self.num_processes != 1
                else (
                    "; --trainer.devices=1 is for a rank given a GPU of its own, alone in its CUDA_VISIBLE_DEVICES "
                    "(srun --gpus-per-task=1)"
                )
            )
            raise UserError(
                f"mpirun started {local_size} processes per node, but --trainer.devices={self.num_processes}: "
                f"pass --trainer.devices={local_size} (one device per process){hint}"
            )
        if self.num_nodes * local_size != world:
            raise UserError(
                f"mpirun started {world} processes, {local_size} per node, but --trainer.num_nodes={self.num_nodes}: "
                f"pass --trainer.num_nodes={world // local_size}"
            )
        self._check_adasum_world_size(world)
        self._launcher = None

    def _check_adasum_world_size(self, world_size: int) -> None:
        if self.op == "adasum" and not is_power_of_two(world_size):
            raise UserError(
                f"--trainer.strategy.op=adasum combines ranks in pairs (0+1, 2+3, then the pairs' results), so it "
                f"needs a power-of-two number of ranks; this run has {world_size}: use "
                f"{1 << (world_size.bit_length() - 1)} or {1 << world_size.bit_length()} ranks, or op=average"
            )

    def enter_mpi_launch(self) -> None:
        """In a rank started by :class:`MPIRunLauncher`: take the ranks from the launch."""
        self.cluster_environment = MPILaunchEnvironment()
        rank_zero_only.rank = self.global_rank
        self._launcher = None

    # ---------------------------------------------------------------- set-up
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the accelerator selects self.root_device
        if not _group_ready():
            backend = "nccl" if self.root_device.type == "cuda" else "gloo"
            if self._launched:
                address, port = self.cluster_environment.main_address, self.cluster_environment.main_port
            else:  # one process, no launcher: a group of one
                address, port = "127.0.0.1", find_free_network_port()
            dist.init_process_group(
                backend,
                init_method=f"tcp://{address}:{port}",
                world_size=self.world_size,
                rank=self.global_rank,
                timeout=timedelta(seconds=self.timeout),
                device_id=self.root_device if backend == "nccl" else None,
            )
            # The group outlives fit (on_fit_end callbacks may still all_gather); app.launch.process_group destroys it
            # at exit.
        if self.world_size == 1:  # a group of one (e.g. a restart on one surviving rank): nothing to accumulate
            warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True")
        rank_zero_info(
            f"horovod strategy: {self.world_size} ranks, compression={self.compression}, "
            f"op={self.op}, fusion_mb={self.fusion_mb:g}"
        )

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)  # model to device, optimizers, precision
        module = self.lightning_module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
        if self.optimizers:
            self._broadcast_optimizer_state()
        if not self.optimizers or self.world_size == 1:  # not fitting, or nothing to reduce
            return
        if self.op == "adasum":
            self._adasum = AdasumDelta(self.compression)
            return
        self.model = fused_allreduce(
            module,
            self.world_size,
            self.op,
            self.compression,
            self.predivide,
            self.fusion_mb,
            self.find_unused_parameters,
        )

    def _broadcast_optimizer_state(self) -> None:
        for optimizer in self.optimizers:
            from lightning.fabric.utilities.apply_func import move_data_to_device

            state = [move_data_to_device(optimizer.state_dict(), "cpu") if self.global_rank == 0 else None]
            dist.broadcast_object_list(state, src=0)
            if self.global_rank != 0:
                optimizer.load_state_dict(state[0])

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ---------------------------------------------------------------- gradients
    # ParallelStrategy.block_backward_sync enters DDP's no_sync() for the batches that only accumulate.
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Manual optimization: tell DDP's reducer which outputs backward starts from, as Lightning's DDP does."""
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            from lightning.pytorch.overrides.distributed import prepare_for_backward

            prepare_for_backward(self.model, closure_loss)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """With ``op=adasum``: a local step, then the ranks' weight deltas combined (see :class:`AdasumDelta`)."""
        if self._adasum is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        with self._adasum.step(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ---------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if _group_ready():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _group_ready():
            return obj
        payload = [obj]
        dist.broadcast_object_list(payload, src=src)
        return payload[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not _group_ready():
            return tensor
        op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
        mean = op in ("mean", "avg", dist.ReduceOp.AVG)  # gloo has no AVG: sum, then divide
        if mean or op is None:
            op = dist.ReduceOp.SUM
        elif isinstance(op, str):
            op = getattr(dist.ReduceOp, op.upper())
        dist.all_reduce(tensor, op=op, group=group)  # in place, as Lightning's strategies reduce
        if not mean:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if tensor.is_floating_point() else tensor.copy_(tensor // size)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor``, stacked along a new first dimension (as Lightning's strategies return it)."""
        if not _group_ready():
            return tensor.unsqueeze(0)
        tensor = tensor.contiguous()
        if sync_grads:  # gradients flow back to every rank's input
            from torch.distributed.nn.functional import all_gather as all_gather_with_grad

            return torch.stack(all_gather_with_grad(tensor, group or dist.group.WORLD))
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    @override
    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        self._adasum = None
        super().teardown()


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()
