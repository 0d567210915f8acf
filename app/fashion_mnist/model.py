"""The task: classify Fashion-MNIST with a ResNet, as a LightningModule.

The ``*_step`` methods only compute: they return the loss, the predicted classes and the targets of their batch.
Metrics are updated (and ``train/loss`` logged) in the ``on_*_batch_end`` hooks, which always run on the root
module with the whole batch's outputs; the metric objects are logged once, in ``on_*_epoch_end``. That keeps the
module strategy-agnostic: under ``dp`` the steps run on replicas (one chunk each) whose state is thrown away, and
the strategy combines their outputs before the hooks see them. Nothing here reads a device value on the host
during a step (see docs/benchmarks.md): on a GPU the next step is queued while this one computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from app.checkpoints.io import check_weights_fit, load_checkpoint
from app.errors import UserError
from app.fashion_mnist.networks import Arch, Norm, build_resnet
from app.task import TaskSpec, step_value_read

# d2l trains ResNet-18 with plain SGD at lr 0.1 per 256 images; momentum, Nesterov and weight decay are the
# usual ImageNet-recipe additions. ``cli.py`` shows these as the ``--model.optimizer`` default.
DEFAULT_SGD = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}


class WeightedMean(Metric):
    """The mean of per-batch values weighted by their sample counts, summed over processes in ``compute()``.

    torchmetrics' ``MeanMetric`` checks every update for NaN (a read of the device on the host, so a wait for the
    GPU every step), and with the check disabled it drops the weights (torchmetrics issue #3434). A NaN loss
    makes this mean NaN, which is what the log should show.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    @override
    def update(self, value: torch.Tensor, weight: int) -> None:
        self.total += value.detach().float() * weight
        self.weight += weight

    @override
    def compute(self) -> torch.Tensor:
        return self.total / self.weight


class ImageClassifier(LightningModule):
    # What the template's machinery reads from this task (app/task.py, docs/fork.md): checkpoints are ranked by
    # validation accuracy, these three arguments decide the weights' shapes, activation checkpointing wraps residual
    # blocks; SGD is the --model.optimizer default that cli.py shows in --help and records in config.yaml; the data
    # module's folder is --data.data_dir; the plot draws the losses and the accuracies, and its title names the data
    # source that FashionMNISTDataModule records, in red for the synthetic stand-in. The ResNet lists its layers for
    # the pipeline (pipeline_layers()), the module keeps step_values for the bar, and the data module has
    # class_names, predict_names and epoch_note: each the default of its field.
    spec = TaskSpec(
        monitor="val/acc",
        mode="max",
        network=("arch", "num_classes", "norm"),
        blocks=("BasicBlock", "Bottleneck"),
        default_optimizer={"class_path": "torch.optim.SGD", "init_args": dict(DEFAULT_SGD)},
        data_folder="data_dir",
        plot_panels=(("loss", ("train/loss_epoch", "val/loss")), ("accuracy", ("train/acc", "val/acc"))),
        data_source="resolved_source",
        stand_in_data=("synthetic",),
    )

    def __init__(
        self,
        arch: Arch = "resnet18",
        num_classes: int = 10,
        norm: Norm = "batch",
        label_smoothing: float = 0.0,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: Literal["epoch", "step"] = "epoch",
        channels_last: bool = False,
        compile: bool = False,
        compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default",
    ) -> None:
        """
        Args:
            arch: torchvision ResNet with d2l's 28x28 stem; ``resnet_tiny`` is a small one for CPU tests,
                ``resnet_mini`` the quickstart's.
            num_classes: Output classes (Fashion-MNIST has 10).
            norm: ``batch`` (BatchNorm, as d2l) or ``group`` (GroupNorm: no coupling between samples).
            label_smoothing: Cross-entropy label smoothing in [0, 1).
            optimizer: Any torch optimizer, e.g. ``--model.optimizer=AdamW --model.optimizer.lr=1e-3``.
                Default: SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4).
            lr_scheduler: Any torch LR scheduler, e.g. ``--model.lr_scheduler=CosineAnnealingLR
                --model.lr_scheduler.T_max=10``. ReduceLROnPlateau watches ``val/acc``.
            lr_scheduler_interval: Step the scheduler every ``epoch`` or every optimizer ``step``.
            channels_last: Keep weights and activations in NHWC layout (faster convolutions with bf16/fp16 on GPUs).
            compile: ``torch.compile`` the network (in place: parameter names and checkpoints are unchanged),
                for fixed shapes: each batch size (an epoch's last, smaller batch too) compiles once. The first
                steps are slow while it compiles. Not with ``dp``, whose replicas are rebuilt every step.
            compile_mode: ``torch.compile``'s mode.
        """
        super().__init__()
        if num_classes < 2:
            raise UserError(f"--model.num_classes must be >= 2, got {num_classes}")
        if not 0.0 <= label_smoothing < 1.0:
            raise UserError(f"--model.label_smoothing must be in [0, 1), got {label_smoothing}")
        self.save_hyperparameters()
        # Under LightningCLI the optimizer and scheduler are saved as their config (plain data). Callables passed
        # from Python are not plain data: keep them out of the checkpoint so it loads with weights_only=True.
        for name in ("optimizer", "lr_scheduler"):
            if callable(self.hparams.get(name)):
                del self.hparams[name]
        check_optimizer(optimizer, lr_scheduler)
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.net = build_resnet(arch, num_classes=num_classes, norm=norm)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.example_input_array = torch.zeros(2, 1, 28, 28)
        # One set of metric objects per stage; torchmetrics syncs their state across processes in compute().
        # No input checks: they read tensors on the host (torch.unique of predictions and labels), on a GPU a wait
        # for the device every step; our inputs are argmax indices and labels, in range by construction.
        self.train_acc, self.val_acc, self.test_acc = (
            MulticlassAccuracy(num_classes, average="micro", validate_args=False) for _ in range(3)
        )
        self.train_loss, self.val_loss, self.test_loss = WeightedMean(), WeightedMean(), WeightedMean()
        # The latest training step's values (device tensors), kept for the progress bar whether logged or not.
        self.step_values: dict[str, torch.Tensor] = {}

    @override
    def configure_model(self) -> None:
        """Layout and compilation, applied once the model is on its device and before the strategy wraps it."""
        if self.hparams.get("channels_last"):
            self.net.to(memory_format=torch.channels_last)
        if self.hparams.get("compile") and not getattr(self, "_compiled", False):  # dp on 2+ devices refuses it (dp.py)
            # Shapes fixed (dynamic=False): an epoch's last, smaller batch gets a graph of its own. Dynamo's
            # default would compile that second batch size as a symbolic one and then run every later step
            # through the symbolic graph (slower kernels, no CUDA graphs).
            self.net.compile(mode=self.hparams.compile_mode, dynamic=False)  # forward(): predict, the summary
            self._compiled_scoring = torch.compile(_scoring, mode=self.hparams.compile_mode, dynamic=False)
            self._compiled = True

    def _scored(self, images: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the predicted classes of a batch; under ``--model.compile`` one compiled region, so that the
        loss, its gradient and the argmax run inside the graph (and its CUDA graph) instead of as eager kernels."""
        return getattr(self, "_compiled_scoring", _scoring)(self, images, target)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != self.dtype and self.dtype == torch.float64
        ):  # --trainer.precision=64-true: batches come as float32
            x = x.to(self.dtype)
        if self.hparams.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    # ---------------------------------------------------------------- steps: compute only
    def _step(self, batch) -> dict[str, torch.Tensor]:
        images, target = batch
        loss, preds = self._scored(images, target)
        # "loss" is what Lightning backpropagates (and divides by accumulate_grad_batches before the batch-end
        # hooks see it); "batch_loss" is the batch's own mean loss, for logging. It outlives the step (the progress
        # bar, the logger), so when compiled it is a copy: a CUDA graph's outputs live in memory that its next
        # replay overwrites, and a graph whose last outputs are still alive is recorded again instead of replayed.
        batch_loss = loss.detach().clone() if getattr(self, "_compiled", False) else loss.detach()
        return {"loss": loss, "batch_loss": batch_loss, "preds": preds, "target": target}

    @override
    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        return self._step(batch)

    @override
    def validation_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        return self._step(batch)

    @override
    def test_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        return self._step(batch)

    @override
    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        probs = self(images).float().softmax(dim=1)
        return {"preds": probs.argmax(dim=1), "probs": probs}

    # ---------------------------------------------------------------- hooks: metrics and logging, on the root
    def _update(self, stage: str, outputs: dict[str, torch.Tensor], batch_idx: int = 0) -> None:
        target, loss = outputs["target"], outputs["batch_loss"]
        getattr(self, f"{stage}_acc").update(outputs["preds"], target)
        getattr(self, f"{stage}_loss").update(loss, target.numel())
        if stage == "train":
            self.step_values["train/loss"] = loss  # what app.callbacks.ProgressBar shows, read when it redraws
            # Not prog_bar=True: Lightning turns progress-bar values into Python floats after every batch, a wait
            # for the GPU each step. Logged only at the steps where something reads it (each self.log is about
            # 0.3 ms of host time in Lightning, the largest part of a step's overhead at small batches).
            if self._step_value_read(self.trainer, batch_idx):
                self.log("train/loss", loss, on_step=True, on_epoch=False, batch_size=target.numel())

    _step_value_read = staticmethod(step_value_read)  # whether a value logged at this step is read (app/task.py)

    def _log_epoch(self, stage: str) -> None:
        # The metric objects are logged once per epoch, not per batch: each self.log of a Metric moves it "to the
        # device" again (Lightning walks its state), about 1 ms of host time per call and step on a small CPU.
        acc, mean_loss = getattr(self, f"{stage}_acc"), getattr(self, f"{stage}_loss")
        if not mean_loss.update_count:  # this process saw no batch of this stage: nothing to report
            return
        name = f"{stage}/loss_epoch" if stage == "train" else f"{stage}/loss"
        self.log(name, mean_loss, on_step=False, on_epoch=True)
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=stage == "val")

    @override
    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self._update("train", outputs, batch_idx)

    @override
    def on_validation_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._update("val", outputs)

    @override
    def on_test_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._update("test", outputs)

    @override
    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    # ---------------------------------------------------------------- checkpoints
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The data a checkpoint was trained on travels with it: the data module compares it with this run's
        (``FashionMNISTDataModule.check_trained_on``; a data module without that check is not asked)."""
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer (load_from_checkpoint): nothing to compare with
            trainer = None
        check = getattr(trainer.datamodule if trainer is not None else None, "check_trained_on", None)
        if callable(check):
            check(checkpoint, str(trainer.ckpt_path) if trainer.ckpt_path else None)

    # ---------------------------------------------------------------- optimisation
    @override
    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            optimizer = torch.optim.SGD(self.parameters(), **DEFAULT_SGD)
        else:
            optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        config = {"scheduler": scheduler, "interval": self.hparams.lr_scheduler_interval}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = self.spec.monitor
        return {"optimizer": optimizer, "lr_scheduler": config}


def _scoring(model: ImageClassifier, images: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(images)
    return model.criterion(logits, target), logits.argmax(dim=1)


def check_optimizer(optimizer: OptimizerCallable | None, lr_scheduler: LRSchedulerCallable | None) -> None:
    """torch checks an optimizer's and a scheduler's arguments when it builds them, which is inside ``fit``, after the
    processes have started and the run folder is made. Build both once now, on a stand-in parameter, so that a bad
    value (``--model.optimizer.lr=-1``) is one error before anything runs."""
    probe = [nn.Parameter(torch.zeros(1))]
    try:
        built = torch.optim.SGD(probe, **DEFAULT_SGD) if optimizer is None else optimizer(probe)
    except (ValueError, TypeError) as err:
        raise UserError(f"--model.optimizer: {err}") from None
    if lr_scheduler is not None:
        try:
            lr_scheduler(built)
        except (ValueError, TypeError) as err:
            raise UserError(f"--model.lr_scheduler: {err}") from None


def network_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain network's weights from a Lightning checkpoint: keys as ``build_resnet`` names them."""
    prefix = "net."
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def saved_network(checkpoint: dict[str, Any], ckpt_path: str | Path) -> dict[str, Any]:
    """The arguments of :func:`build_resnet` that a checkpoint's network was built with."""
    hp = checkpoint["hyper_parameters"]
    if "arch" not in hp or "num_classes" not in hp:
        raise UserError(f"{ckpt_path}: not a checkpoint of this project's model (no arch / num_classes saved)")
    return {"arch": hp["arch"], "num_classes": hp["num_classes"], "norm": hp.get("norm", "batch")}


def load_network(ckpt_path: str | Path) -> nn.Module:
    """Rebuild the network a checkpoint was trained with and load its weights (``weights_only``, strict)."""
    checkpoint = load_checkpoint(ckpt_path)
    net = build_resnet(**saved_network(checkpoint, ckpt_path))
    weights = network_state_dict(checkpoint)
    check_weights_fit(weights, net.state_dict(), ckpt_path)
    net.load_state_dict(weights, strict=True)
    return net.eval()
