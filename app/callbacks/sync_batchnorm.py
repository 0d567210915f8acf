"""Synchronized BatchNorm: every process normalises with the mean and variance of the whole global batch.

    python cli.py fit --trainer.strategy=ddp --trainer.devices=4 --trainer.callbacks+=app.callbacks.SyncBatchNorm

With N processes at per-device batch b, plain BatchNorm normalises each device's b samples with their own
statistics; synchronized BN gives every device the statistics of all N*b samples, so training (outputs,
gradients, running statistics) is what one device would compute on the whole batch. It matters when b is small.
It costs one all-reduce of 2C+1 numbers per BN layer in forward and one of 2C in backward (C = channels).

The callback converts the model's BatchNorm layers before the strategy wraps the model, when world size > 1:

- GPU (ddp, ddp_spawn, horovod): ``torch.nn.SyncBatchNorm``;
- CPU (gloo), where ``torch.nn.SyncBatchNorm`` refuses to run: ``AllReduceBatchNorm`` below, the same math over
  ``torch.distributed.all_reduce``;
- one process (world size 1, and ``dp``, whose replicas live in one process and are rebuilt every step): nothing
  is converted; ``dp`` gets a warning, since its replicas keep normalising each chunk on its own.

The converted layers keep the parameter and buffer names, so checkpoints load into the plain network.
``Trainer(sync_batchnorm=True)`` may be set as well: the callback's conversion is then the only one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from app.errors import TemplateWarning, UserError
from app.lightning_internals import drop_layer_sync
from app.parallelism import parallelism


class SyncBatchNorm(Callback):
    """Convert BatchNorm layers to synchronized BatchNorm for multi-process training (no-op on one process)."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if parallelism(strategy).devices_per_process > 1:  # dp
            rank_zero_warn(
                "SyncBatchNorm: strategy=dp runs its replicas in one process and cannot synchronize BatchNorm across "
                "them; each device normalises its own chunk. Use --trainer.strategy=ddp for synchronized BN.",
                category=TemplateWarning,
            )
            return
        refusal = parallelism(strategy).refusals.get("sync_batchnorm")  # a pipeline's, whatever its stages
        if refusal:
            label = parallelism(strategy).label
            raise UserError(f"SyncBatchNorm does not work with --trainer.strategy={label}: {refusal}")
        if trainer.world_size == 1:
            rank_zero_info("SyncBatchNorm: one process, nothing to synchronize; BatchNorm layers left as they are.")
            return
        drop_layer_sync(strategy)  # with sync_batchnorm=True, ddp would convert again, to torch.nn.SyncBatchNorm
        layer, how = sync_batchnorm_class(strategy)
        count = convert_batchnorm(pl_module, layer)
        rank_zero_info(
            f"SyncBatchNorm: {count} BatchNorm layers synchronized across {trainer.world_size} processes ({how})."
        )


def sync_batchnorm_class(strategy) -> tuple[type[_BatchNorm], str]:
    """The synchronized BN layer that works on this strategy's device."""
    if strategy.root_device.type in ("cuda", "xpu"):
        return nn.SyncBatchNorm, "torch.nn.SyncBatchNorm"
    return AllReduceBatchNorm, "AllReduceBatchNorm over torch.distributed.all_reduce"


def convert_batchnorm(module: nn.Module, layer: type[_BatchNorm]) -> int:
    """Replace every BatchNorm layer below ``module`` by ``layer`` in place, keeping its state; returns the count."""
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, _BatchNorm) and not isinstance(child, layer)
    ]
    for parent, name, child in targets:
        setattr(parent, name, _converted(child, layer))
    return len(targets)


def _converted(bn: _BatchNorm, layer: type[_BatchNorm]) -> _BatchNorm:
    new = layer(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    new.load_state_dict(bn.state_dict())
    if bn.affine:
        new.weight.requires_grad_(bn.weight.requires_grad)
        new.bias.requires_grad_(bn.bias.requires_grad)
    new.train(bn.training)
    tensors = [*bn.parameters(), *bn.buffers()]
    return new.to(tensors[0].device) if tensors else new


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are summed over all processes: ``torch.nn.SyncBatchNorm``'s math for
    any device and backend (gloo on CPU included). Same parameters, buffers and eval behaviour as BatchNorm.

    Uneven batches are handled: each process contributes its own element count.
    """

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        synchronized = use_batch_stats and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not synchronized:
            return super().forward(input)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        running = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if running else None,
            self.running_var if running else None,
            self.eps,
            factor,
        )


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * w + b with mean/var over every process's batch (biased var, as BN).

    Forward all-reduces per channel [sum x, sum x^2, count]; backward all-reduces [sum dy, sum dy*x_hat] and gives
    dx = w / std * (dy - mean(dy) - x_hat * mean(dy*x_hat)) with global means, which is exactly the gradient of one
    process holding the whole batch. dw and db stay local: the strategy averages parameter gradients as usual.
    Sums are taken in float64 so the result matches single-process BN to float32 rounding.
    """

    @staticmethod
    @override
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        x64 = x.double()
        # torch.full, not torch.tensor([...], device=cuda): no host-to-device copy of a Python list in every BN layer
        count = torch.full((1,), x.numel() / channels, dtype=torch.float64, device=x.device)
        stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), count])
        dist.all_reduce(stats)
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = (var + eps).rsqrt()
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * (total / (total - 1).clamp_min(1))
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        x_hat = ((x64 - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        y = x_hat
        if weight is not None:
            y = x_hat * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x_hat, weight, invstd.to(x.dtype), total)
        ctx.dims, ctx.shape = dims, shape
        return y

    @staticmethod
    @override
    def backward(ctx, dy):
        x_hat, weight, invstd, total = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        channels = x_hat.shape[1]
        grad_weight = grad_bias = None
        sum_dy = dy.double().sum(dims)
        sum_dy_xhat = (dy.double() * x_hat.double()).sum(dims)
        if weight is not None:
            grad_weight, grad_bias = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)
        sums = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(sums)
        mean_dy = (sums[:channels] / total).to(dy.dtype)
        mean_dy_xhat = (sums[channels:] / total).to(dy.dtype)
        scale = invstd if weight is None else invstd * weight
        dx = (dy - mean_dy.view(shape) - x_hat * mean_dy_xhat.view(shape)) * scale.view(shape)
        return dx, grad_weight, grad_bias, None, None, None, None
