"""``strategy="fsdp"``: sharded data parallel (PyTorch's FSDP2, ``fully_shard``), on CPU as well as on GPUs.

    python cli.py fit --trainer.strategy=fsdp --trainer.devices=4
    python cli.py fit --trainer.strategy=fsdp --trainer.strategy.blocks='[BasicBlock]' --trainer.precision=bf16-mixed

Each of N processes trains on its own slice of every batch, as under ``ddp``, but keeps only 1/N of each parameter,
of its gradient and of the optimizer's state:

1. **shard**: every block (the task's ``spec.blocks``, app/task.py: the example's residual blocks) becomes one
   FSDP unit, and each top-level submodule of the LightningModule (the example's ``net``) one more for whatever its
   blocks leave (stem, head). A unit's parameters are split into N flat pieces, one per rank;
2. **forward / backward**: a unit all-gathers its full parameters just before it runs and frees them after
   (``reshard_after_forward``), so at most a unit or two are whole at any moment; backward gathers again and
   reduce-scatters the gradients, so each rank ends the step with the mean gradient of its own piece;
3. **step**: the optimizer updates each rank's piece, with optimizer state for that piece only.

The sum is the same as ddp's mean over ranks, so the run trains like one device on the global batch (float64
parity in tests/test_strategies.py). Lightning 2.6's own ``fsdp`` (FSDP1) refuses CPU; its ``ModelParallelStrategy``
needs the model to shard itself in ``configure_model``. Here the strategy does it, so any task trains unchanged.

Checkpoints hold one full state dict, as every other strategy's do: rank 0 gathers the weights and the optimizer
state (torch.distributed.checkpoint's ``get_*_state_dict`` with ``full_state_dict``, keyed like
``optimizer.state_dict()``), so ``last.ckpt`` loads under ``torch.load(weights_only=True)``, in ``cli.py test`` /
``predict`` / ``export`` and in any other strategy, and a run resumes at any number of devices. The gathering needs
every rank: a rank lost mid-run takes its piece with it, so elastic restarts go on from the last checkpoint on
disk instead of a survivor's memory (docs/model-parallel.md).

With ``--trainer.precision=bf16-mixed`` the units compute and reduce in bfloat16 (FSDP2's ``MixedPrecisionPolicy``)
while each rank keeps its piece, its gradients and the optimizer state in float32; ``param_dtype`` and
``reduce_dtype`` choose otherwise (``reduce_dtype=float32`` sums gradients in float32).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed import default_pg_timeout
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from app.checkpoints.sharded import (
    BackgroundSaves,
    by_index,
    by_name,
    is_sharded_checkpoint,
    load_sharded,
    not_loaded_here,
    save_sharded,
)
from app.checkpoints.storage import is_url
from app.errors import UserError
from app.lightning_internals import free_strategy_name
from app.strategies.model_parallel import SplitModelStrategy
from app.task import match_modules, spec_of

DType = Literal["float32", "bfloat16", "float16", "float64"]


def check_shardable(model: nn.Module) -> None:
    """FSDP2 shards submodules, and contiguous parameters only: a model's own parameters are refused in one line, and
    channels_last weights go back to NCHW ("does not support non-contiguous parameters yet"). A channels_last task's
    activations stay NHWC, and its convolutions with them."""
    own = [name for name, _ in model.named_parameters(recurse=False)]
    if own:
        raise UserError(
            f"--trainer.strategy=fsdp shards the submodules of {type(model).__name__}, but the parameters "
            f"{', '.join(own)} are its own: move them into a submodule (self.net = ...)"
        )
    if any(not p.is_contiguous() for p in model.parameters()):
        model.to(memory_format=torch.contiguous_format)
        rank_zero_info("fsdp: weights kept in the contiguous layout, which FSDP2 shards (activations unchanged)")


class FSDPStrategy(SplitModelStrategy):
    strategy_name = "fsdp"
    refusals = {
        "comm_hook": "fsdp reduce-scatters its own gradients, in bfloat16 with --trainer.strategy.reduce_dtype=bfloat16"
    }
    float16_reason = "the sharded gradients here"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``fsdp``, taken over from Lightning's GPU-only FSDP1 strategy (still there by class path,
        ``lightning.pytorch.strategies.FSDPStrategy``). Defined here also because the one inherited from Lightning's
        DDPStrategy would register this class as ``ddp``."""
        if "fsdp" not in strategy_registry or strategy_registry["fsdp"]["strategy"] is not cls:
            strategy_registry.register(
                "fsdp",
                cls,
                description="FSDP2: parameters, gradients and optimizer state sharded over the ranks (CPU and GPU)",
                override=True,
            )
            free_strategy_name("fsdp")  # Lightning refuses the name on CPU otherwise (app/lightning_internals.py)

    def __init__(
        self,
        blocks: list[str] | None = None,
        reshard_after_forward: bool = True,
        param_dtype: DType | None = None,
        reduce_dtype: DType | None = None,
        checkpoint: Literal["full", "sharded"] = "full",
        async_save: bool = False,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            blocks: The modules that become one FSDP unit each: class names (``BasicBlock``) or paths as in
                ``named_modules()``, globs allowed (``net.layer*``). Default: the blocks the task's ``spec`` names;
                none named, each top-level submodule is one unit.
            reshard_after_forward: Free a unit's gathered parameters after its forward (less memory; backward
                gathers them again). ``false`` keeps them until backward: one all-gather per unit and step fewer.
            param_dtype: The dtype units compute in (default: bfloat16 under ``--trainer.precision=bf16-mixed``,
                else the parameters' own).
            reduce_dtype: The dtype gradients are reduce-scattered in (default: ``param_dtype``).
            checkpoint: ``full``: one state dict, gathered on rank 0, in one file (loads anywhere); ``sharded``: a
                folder that every rank writes its pieces into, with no rank holding the whole model, loadable at any
                number of ranks (app/checkpoints/sharded.py; ``cli.py consolidate`` makes one file of it).
            async_save: With ``checkpoint=sharded``: a save copies each rank's pieces to CPU memory and training goes
                on while a background thread writes them; the folder is moved into place once written (at a later
                batch, the next save or the run's end). Costs a copy of the rank's shard in CPU memory per save in
                flight.
            process_group_backend: ``gloo``, ``nccl`` (default: nccl on GPUs, gloo on CPU).
            timeout: The process group's timeout: a collective waiting longer for a lost peer fails.
        """
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip
        for flag, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and dtype not in DType.__args__:
                raise UserError(f"--trainer.strategy.{flag}={dtype}: use one of {', '.join(DType.__args__)}")
        self.blocks = tuple(blocks) if blocks else ()
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        if checkpoint not in ("full", "sharded"):
            raise UserError(f"--trainer.strategy.checkpoint={checkpoint}: use full or sharded")
        self.checkpoint = checkpoint
        if async_save and checkpoint != "sharded":
            raise UserError(
                "--trainer.strategy.async_save=true writes sharded checkpoints in the background: add "
                "--trainer.strategy.checkpoint=sharded"
            )
        self.background = BackgroundSaves(timeout) if async_save else None
        self.units: list[str] = []  # the sharded modules' paths, in the order they were wrapped

    @override
    def setup(self, trainer) -> None:
        if self.checkpoint == "sharded" and is_url(trainer.default_root_dir):
            raise UserError(
                f"--trainer.strategy.checkpoint=sharded with --trainer.default_root_dir={trainer.default_root_dir}: "
                "sharded checkpoints are folders renamed into place, on a local or shared filesystem (NFS); pass such "
                "a root, or checkpoint=full"
            )
        super().setup(trainer)
        if self.background is not None:
            self.background.start()  # every rank: the saves' own process group

    # ---------------------------------------------------------------- shard the model
    def split(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if _is_sharded(model) or not (dist.is_available() and dist.is_initialized()):
            return model  # (trainer.test after trainer.fit: sharded already)
        self.units = []
        check_shardable(model)
        mesh = init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=("shard",))
        options = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        policy = self._mixed_precision(model)
        if policy is not None:
            options["mp_policy"] = policy
        if policy is not None and policy.param_dtype not in (None, torch.float32):
            self._shard_batchnorm_in_float32(model, options)
        for path, block in self._blocks(model):
            fully_shard(block, **options)
            self.units.append(path)
        for name, child in model.named_children():
            if isinstance(child, FSDPModule) or not any(True for _ in child.parameters()):
                continue
            fully_shard(child, **options)  # what the blocks leave: the stem, the head
            self.units.append(name)
        return model

    def _shard_batchnorm_in_float32(self, model: nn.Module, options: dict) -> None:
        """BatchNorm keeps float32 weights (its running statistics are float32 buffers, which FSDP does not cast, and
        batch_norm takes no bfloat16 weights with them); it normalises bfloat16 inputs as autocast does."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=options["mp_policy"].reduce_dtype)
        for name, norm in model.named_modules():
            if isinstance(norm, _BatchNorm) and any(True for _ in norm.parameters()):
                fully_shard(norm, **{**options, "mp_policy": keep})
                self.units.append(name)

    def _blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The blocks each sharded on their own: --trainer.strategy.blocks, else the task's ``spec.blocks``."""
        targets = self.blocks or spec_of(model).blocks
        blocks = match_modules(model, targets) if targets else []
        if self.blocks and not blocks:
            raise UserError(
                f"--trainer.strategy.blocks={list(self.blocks)} matches no module of {type(model).__name__}; give "
                "class names (e.g. BasicBlock) or paths as in named_modules() (e.g. net.layer1)"
            )
        return blocks

    def _mixed_precision(self, model: nn.Module):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        param = self.param_dtype or ("bfloat16" if str(self.precision_plugin.precision) == "bf16-mixed" else None)
        reduce = self.reduce_dtype or param
        if param is None and reduce is None:
            return None
        return MixedPrecisionPolicy(
            param_dtype=getattr(torch, param) if param else None,
            reduce_dtype=getattr(torch, reduce) if reduce else None,
            cast_forward_inputs=True,
        )

    # ---------------------------------------------------------------- its Parallelism (app/parallelism.py)
    devices_per_process = 1
    stages = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size  # every rank takes a slice of each batch, as under ddp

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded yet (a rank holds 1/N of it): from set-up on."""
        return self.model is not None and _is_sharded(self.model)

    # ---------------------------------------------------------------- checkpoints: one full state dict, or shards
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.sharded:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.checkpoint == "sharded":
            from torch.distributed.tensor import DTensor

            state = get_model_state_dict(self.model)  # each rank its own pieces (DTensors)
            if self.is_global_zero:
                return state
            # and rank 0's buffers (BatchNorm's statistics), as in a full checkpoint: FSDP keeps each rank's own
            return {name: value for name, value in state.items() if isinstance(value, DTensor)}
        # every rank takes part in the gathering; rank 0 gets the full tensors, on the CPU, the others nothing
        return get_model_state_dict(self.model, options=_full_state())

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self.sharded:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if self.checkpoint == "sharded":
            return get_optimizer_state_dict(self.model, optimizer)
        state = get_optimizer_state_dict(self.model, optimizer, options=_full_state())
        return by_index(state) if self.is_global_zero else {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.checkpoint == "sharded" and self.sharded:
            return save_sharded(self, checkpoint, filepath, self.background)  # every rank writes its pieces
        return super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.background is not None and self.background.writing(Path(filepath)):
            self.background.settle(wait=True)  # (ModelCheckpoint's top-k drops a best still being written)
        super().remove_checkpoint(filepath)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.background is not None:
            self.background.settle()  # the background saves written since: into place

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.background is not None:
            self.background.settle(wait=True)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._ending_on = exception

    @override
    def teardown(self) -> None:
        try:
            if self.background is not None:  # a run that ended early: its saves in flight written, or said
                failed = self.background.close(raise_failure=getattr(self, "_ending_on", None) is None)
                if failed:
                    rank_zero_warn(failed)
        finally:
            super().teardown()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.checkpoint == "sharded"  # the shards are loaded into the sharded model

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if not self.sharded:
            raise not_loaded_here(checkpoint_path)
        optimizers = [getattr(optimizer, "_optimizer", optimizer) for optimizer in self.optimizers]  # torch's own
        return {**load_sharded(checkpoint_path, self.model, optimizers), _LOADED: True}

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if checkpoint.get(_LOADED):
            return None  # loaded with the shards
        if not self.sharded:
            return super().load_model_state_dict(checkpoint, strict=strict)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # a full checkpoint into a sharded model (--trainer.strategy.checkpoint=sharded restores after the split)
        set_model_state_dict(
            self.model, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        if checkpoint.get(_LOADED):
            return None
        if not self.sharded:
            return super().load_optimizer_state_dict(checkpoint)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = {id(p): name for name, p in self.model.named_parameters()}
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
            set_optimizer_state_dict(
                self.model, optimizer, by_name(state, order), options=StateDictOptions(full_state_dict=True)
            )
        return None


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _full_state():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


_LOADED = "template_loaded_from_shards"  # a checkpoint whose weights and optimizer state load_checkpoint set
