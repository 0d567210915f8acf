"""Activation (gradient) checkpointing: trade compute for memory by recomputing blocks in backward.

    python cli.py fit --trainer.callbacks+=app.callbacks.ActivationCheckpointing
    python cli.py fit --trainer.callbacks+=app.callbacks.ActivationCheckpointing \\
        --trainer.callbacks.modules='[net.layer1, net.layer2]'

A checkpointed block keeps only its input during forward; its inner activations are recomputed during backward
(``torch.utils.checkpoint``, non-reentrant). For ResNet-18 on 28x28 images this removes most of what training
keeps for backward, at the price of one more forward pass of the wrapped blocks (about +30% step time).

Recomputation must not change anything a run keeps:

- BatchNorm in training mode would update its running statistics (and ``num_batches_tracked``) a second time
  during recomputation. While recomputing, BN layers here normalise with the batch statistics as in the forward
  pass but leave their running statistics alone (momentum 0 for that moment, the step counter put back).
- Random operations (dropout) replay the same random numbers: ``torch.utils.checkpoint`` restores the CPU and CUDA
  RNG state for the recomputation (``preserve_rng_state``).
- Autocast (``--trainer.precision=bf16-mixed``) is recorded and replayed by ``torch.utils.checkpoint``.

Blocks are wrapped by giving them a subclass whose ``forward`` checkpoints (parameter and buffer names, hence
checkpoints, are unchanged; ``dp``'s replicas inherit it), before the strategy wraps the model, and unwrapped
when fitting ends. Evaluation and ``torch.no_grad()`` never recompute.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from app.errors import UserError
from app.task import match_modules, spec_of


class ActivationCheckpointing(Callback):
    def __init__(self, modules: list[str] | None = None) -> None:
        """
        Args:
            modules: What to checkpoint: class names (``BasicBlock``) or module paths as in ``named_modules()``,
                globs allowed (``net.layer*``). Default: the blocks the model's ``spec`` names (app/task.py); the
                example task's are its residual blocks (torchvision BasicBlock/Bottleneck).
        """
        self.modules = tuple(modules) if modules else ()
        self.targets = self.modules
        self.wrapped: list[str] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.targets = self.modules or spec_of(pl_module).blocks
        if not self.targets:
            raise UserError(
                f"ActivationCheckpointing: {type(pl_module).__name__} names no blocks to recompute (spec = "
                "TaskSpec(blocks=...), app/task.py); pass --trainer.callbacks.modules=[...] with class names or paths"
            )
        self.wrapped = apply_activation_checkpointing(pl_module, self.targets)
        if not self.wrapped:
            raise UserError(
                f"ActivationCheckpointing: --trainer.callbacks.modules={list(self.targets)} matches no module of "
                f"{type(pl_module).__name__}; give class names (e.g. BasicBlock) or paths (e.g. net.layer1)"
            )
        rank_zero_info(f"ActivationCheckpointing: {len(self.wrapped)} modules recompute in backward ({self.targets})")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            remove_activation_checkpointing(pl_module)
            self.wrapped = []


def apply_activation_checkpointing(root: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Checkpoint every module whose class name or path matches a target (outermost matches only); returns paths."""
    chosen = match_modules(root, targets)
    for _, module in chosen:
        if not isinstance(module, _Checkpointed):
            module.__class__ = _checkpointed_class(type(module))
    return [path for path, _ in chosen]


def remove_activation_checkpointing(root: nn.Module) -> None:
    for module in root.modules():
        if isinstance(module, _Checkpointed):
            module.__class__ = module._original_class


COMPILE_REFUSED = (
    "ActivationCheckpointing does not work with a compiled model (a task's own compile option): "
    "torch.compile traces a checkpoint only with contexts it can trace, and the callback's BatchNorm guard is not "
    "one; leave out one of the two"
)


@torch.compiler.disable
def _refuse_compile() -> None:
    """Raised outside the traced graph: Dynamo of torch 2.11 cannot build the error in it (UserError's __init__
    records itself) and failed with its own "Failed to raise exception" instead (seen on the GPU machine)."""
    raise UserError(COMPILE_REFUSED)


class _Checkpointed:
    """Mixin placed in front of a module's own class: ``forward`` runs under ``torch.utils.checkpoint``."""

    _original_class: type[nn.Module]

    def forward(self, *args, **kwargs):
        forward = super().forward
        if not (self.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            # torch.compile needs a checkpoint's context_fn to return TorchDispatchModes; the BatchNorm guard below
            # (its running statistics updated once, not again in the recomputation) is a plain context manager
            _refuse_compile()
        return checkpoint(forward, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _contexts(self):
        return nullcontext(), _frozen_batchnorm_statistics(self)


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {"_original_class": cls})
    return _CLASSES[cls]


@contextmanager
def _frozen_batchnorm_statistics(module: nn.Module):
    """During recomputation BN normalises with the batch statistics, as in forward, but its running statistics stay.

    Momentum 0 makes the running-statistics update ``r * 1 + batch * 0 == r`` (exactly, for finite values), so the
    recomputed op is the same op as in forward (same saved tensors); the step counter is put back afterwards.
    """
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [(layer.momentum, layer.num_batches_tracked.clone()) for layer in layers]
    for layer in layers:
        layer.momentum = 0.0
    try:
        yield
    finally:
        for layer, (momentum, count) in zip(layers, saved, strict=True):
            layer.momentum = momentum
            layer.num_batches_tracked.copy_(count)
