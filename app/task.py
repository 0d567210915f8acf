"""What the machinery reads from a task: the contract between your LightningModule / LightningDataModule and the
template's CLI, callbacks and checkpoint rules. Nothing else of a task is read.

A LightningModule declares it as a class attribute; every field has a default, so a module that declares nothing
still trains under every strategy::

    from app.task import TaskSpec

    class MyModel(LightningModule):
        spec = TaskSpec(monitor="val_loss", mode="min", network=("hidden", "layers"), blocks=("GRU",))

A data module may name its classes (``class_names``, a list of str), which ``predictions.csv`` then shows, and
may say something about its data on every epoch line of the run report (``epoch_note``, a short str or None: an
attribute or a property, read at each epoch's end), such as that the data is a stand-in::

    class MyData(LightningDataModule):
        @property
        def epoch_note(self) -> str | None:
            return "SYNTHETIC data" if self.offline else None

    # epoch 3 | train loss 0.4120 | val acc 0.8712 | 12.3 s | 4,567 samples/s | 1 x cpu (single_device) | SYNTHETIC data

The contract, the steps of a fork and what each promise needs of a data module: docs/fork.md.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class TaskSpec:
    """What a LightningModule tells the template about itself."""

    monitor: str | None = None
    """The logged metric that ranks checkpoints (``--ckpt_path best``) and feeds ReduceLROnPlateau. ``None``: no
    ranking, ``best`` is the newest checkpoint. A name the model never logs stops the run after the first
    validation (the sanity check, when it runs) with one line, before any training is lost."""
    mode: Literal["min", "max"] = "min"
    """Whether a larger (``max``) or smaller (``min``) ``monitor`` is better."""
    network: tuple[str, ...] = ()
    """The ``__init__`` arguments that decide the shapes of the weights (``arch``, ``hidden``, ...). A checkpoint
    brings its own values for these to ``--ckpt_path`` runs; giving another value is an error naming both."""
    blocks: tuple[str, ...] = ()
    """Submodule class names or paths (globs allowed) that activation checkpointing wraps by default."""
    layers: str = ""
    """The network that ``--trainer.strategy=pipeline`` cuts into stages, by its path (``"net"``); its forward must
    run its layers one after another: an ``nn.Sequential``, or a module whose ``pipeline_layers()`` returns them in
    order (the example's ResNet has one). Default: the only top-level submodule that holds parameters."""
    lr_flag: str | None = None
    """The flag that sets the learning rate, named in hints (a diverged run's line). Default: found from the
    module's ``__init__`` arguments (:func:`lr_flag_of`); a hint names no flag when none is found."""
    samples: Callable[[Any], int] | None = None
    """How many samples a batch holds (the run report's samples/s); default: :func:`count_samples`."""


DEFAULT_SPEC = TaskSpec()


def match_modules(root: torch.nn.Module, targets: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
    """The submodules of ``root`` that a target names, by class name or by path as in ``named_modules()`` (globs
    allowed: ``net.layer*``), outermost matches only, in ``named_modules()`` order. How the machinery finds a task's
    blocks (``spec.blocks``): activation checkpointing recomputes them, fsdp shards each on its own."""
    chosen: list[tuple[str, torch.nn.Module]] = []
    for path, module in root.named_modules():
        if not path or any(path.startswith(parent + ".") for parent, _ in chosen):
            continue
        name = getattr(module, "_original_class", type(module)).__name__  # under activation checkpointing too
        if name in targets or any(fnmatch.fnmatchcase(path, t) for t in targets):
            chosen.append((path, module))
    return chosen


def import_class(class_path: str) -> type:
    """The class a dotted path names (``app.callbacks.RunReport``)."""
    module, name = class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def spec_of(module: Any) -> TaskSpec:
    """The module's (or its class's) :class:`TaskSpec`, or the defaults when it declares none."""
    spec = getattr(module, "spec", None)
    if spec is not None and not isinstance(spec, TaskSpec):
        name = module.__name__ if isinstance(module, type) else type(module).__name__
        raise TypeError(f"{name}.spec must be an app.task.TaskSpec, not {type(spec).__name__}")
    return spec or DEFAULT_SPEC


def lr_flag_of(module: Any) -> str | None:
    """The flag that sets the module's learning rate: its spec's ``lr_flag``; else ``--model.lr`` (or
    ``--model.learning_rate``) when its ``__init__`` takes that argument, ``--model.optimizer.lr`` when it takes an
    ``optimizer`` (LightningCLI's optimizer callable); else None (not knowable: no flag is better than a wrong one)."""
    declared = spec_of(module).lr_flag
    if declared is not None:
        return declared
    cls = module if isinstance(module, type) else type(module)
    try:
        arguments = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    for name in ("lr", "learning_rate"):
        if name in arguments:
            return f"--model.{name}"
    return "--model.optimizer.lr" if "optimizer" in arguments else None


def count_samples(batch: Any) -> int:
    """The samples in a batch of any usual shape: a tensor (its first dimension), a tuple or list (its first
    element's), a dict (its first tensor's). 0 when none is found."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            if (n := count_samples(value)) > 0:
                return n
        return 0
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes) and batch:
        return count_samples(batch[0])
    return 0


def batch_samples(module: Any, batch: Any) -> int:
    """Samples in ``batch``, by the module's spec when it says how, else :func:`count_samples`."""
    counter = spec_of(module).samples
    return int(counter(batch)) if counter is not None else count_samples(batch)


def class_names(datamodule: Any) -> list[str]:
    """The data module's ``class_names`` (empty when it names none)."""
    names = getattr(datamodule, "class_names", None)
    return [str(n) for n in names] if names else []


def epoch_note(datamodule: Any) -> str:
    """The data module's ``epoch_note``, on one line (empty when it has none): what every epoch line adds."""
    note = getattr(datamodule, "epoch_note", None)
    return " ".join(str(note).split()) if note else ""


def step_value_read(trainer, batch_idx: int) -> bool:
    """For a task's ``training_step``: whether a per-step value it logs now reaches anything (a logger, at the
    ``log_every_n_steps`` steps, a stop or ``fast_dev_run``; the callbacks, at the epoch's last batch, ``max_steps``
    or before a validation). Every other step's value is overwritten unread, and each ``self.log`` costs host time,
    so a task may log only when this is true (the example's ``train/loss``). Unknown cases count as read."""
    from app.lightning_internals import step_values_read  # the fit loop's counters: Lightning has no public way

    return step_values_read(trainer, batch_idx)
