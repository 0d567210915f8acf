"""What the machinery reads from a task: the contract between your LightningModule / LightningDataModule and the
template's CLI, callbacks, strategies, checkpoint rules and plot. Nothing else of a task is read.

A LightningModule declares it as a class attribute, ``spec``; every field has a default, so a module that declares
nothing still trains under every strategy::

    from app.task import TaskSpec

    class MyModel(LightningModule):
        spec = TaskSpec(monitor="val_loss", mode="min", network=("hidden", "layers"), blocks=("GRU",))

The fields, one line each (the full list with the defaults: docs/fork.md): ``monitor`` and ``mode`` (the metric that
ranks checkpoints), ``network`` (the arguments that decide the weights' shapes), ``blocks`` (what activation
checkpointing wraps), ``layers`` and ``pipeline_layers`` (what the pipeline strategy cuts, and in which order),
``lr_flag`` (the flag hints name), ``samples`` (a batch's size), ``step_values`` (what the progress bar shows
between logged steps), ``default_optimizer`` (the ``--model.optimizer`` default), ``data_folder`` (the data
module's folder argument), ``class_names``, ``predict_names`` and ``epoch_note`` (what the data module says of its
classes, predicted samples and data), ``plot_panels``, ``data_source`` and ``stand_in_data`` (``cli.py plot``'s
panels and title). Some of these are the data module's: the module's spec says how to read them, by default from an
attribute of the data module of that name, such as::

    class MyData(LightningDataModule):
        class_names = ["cat", "dog"]  # predictions.csv's class column

        @property
        def epoch_note(self) -> str | None:  # the end of every epoch line of the run report
            return "SYNTHETIC data" if self.offline else None

    # epoch 3 | train loss 0.4120 | val mse 0.0412 | 12.3 s | 4,567 samples/s | 1 x cpu (single_device) | SYNTHETIC data

The machinery reads a spec only through :func:`spec_of` and the helpers below. The steps of a fork and what each
promise needs of a data module: docs/fork.md.
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
    """The logged metric that ranks checkpoints (``--ckpt_path best``) and names the run's headline score on its
    epoch lines (a task's ``ReduceLROnPlateau`` may read it too, as the example's does). ``None``: no ranking,
    ``best`` is the newest checkpoint. A name the model never logs stops the run after the first validation (the
    sanity check, when it runs) with one line, before any training is lost."""
    mode: Literal["min", "max"] = "min"
    """Whether a larger (``max``) or smaller (``min``) ``monitor`` is better."""
    network: tuple[str, ...] = ()
    """The ``__init__`` arguments that decide the shapes of the weights (``hidden``, ``layers``, ...). A checkpoint
    brings its own values for these to ``--ckpt_path`` runs; giving another value is an error naming both."""
    blocks: tuple[str, ...] = ()
    """Submodule class names or paths (globs allowed) that activation checkpointing wraps by default."""
    layers: str = ""
    """The network that ``--trainer.strategy=pipeline`` cuts into stages, by its path (``"net"``); its forward must
    run its layers one after another, in the order ``pipeline_layers`` gives. Default: the only top-level submodule
    that holds parameters."""
    lr_flag: str | None = None
    """The flag that sets the learning rate, named in hints (a diverged run's line). Default: found from the
    module's ``__init__`` arguments (:func:`lr_flag_of`); a hint names no flag when none is found."""
    samples: Callable[[Any], int] | None = None
    """How many samples a batch holds (the run report's samples/s); default: :func:`count_samples`."""
    pipeline_layers: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None = None
    """The layers of the network (``layers``) in the order its forward runs them, which the pipeline strategy deals
    to its stages. Default: the network's own ``pipeline_layers()`` when it has one, else an ``nn.Sequential``'s
    children (:func:`layers_in_order`)."""
    step_values: Callable[[Any], Mapping[str, Any]] | None = None
    """The latest training step's values (name -> tensor) that the progress bar shows when it redraws, logged or not
    (``ProgressBar(show=...)`` names which). Default: the module's ``step_values`` dict when it has one, else only
    what was logged."""
    default_optimizer: Mapping[str, Any] | None = None
    """The ``--model.optimizer`` default (``{"class_path": ..., "init_args": {...}}``) that ``cli.py`` shows in
    ``--help`` and records in config.yaml, for a module that takes an ``optimizer`` and is the default task (not one
    named with ``--model=``). None: LightningCLI's (the module's own default)."""
    data_folder: str | None = None
    """The data module's ``__init__`` argument that names a folder of files (``"data_dir"``, say): config.yaml
    records it as an absolute path, and ``--ckpt_path last`` compares two runs' folders, not their spellings."""
    class_names: Callable[[Any], Sequence[str] | None] | None = None
    """What each class is called, from the data module: ``predictions.csv`` gets a ``class`` column beside integer
    predictions. Default: the data module's ``class_names`` attribute, when it has one."""
    predict_names: Callable[[Any], Sequence[str] | None] | None = None
    """What each predicted sample is (a file name, say), from the data module: ``predictions.csv``'s ``name`` column.
    Default: the data module's ``predict_names`` attribute, when it has one; else the sample's index."""
    epoch_note: Callable[[Any], str | None] | None = None
    """What the data module says of its data at each epoch's end, on one line (that it is a stand-in, say): the end
    of every epoch line. Default: the data module's ``epoch_note`` attribute or property, when it has one."""
    plot_panels: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``cli.py plot``'s panels, ``(title, (metric, ...))`` each, in order; a task's per-epoch metrics that no panel
    names get one more panel, and the training speed one of its own. Default: one panel of every per-epoch metric."""
    data_source: str | None = None
    """The hyperparameter (a key of the run's ``hparams.yaml``: the data module's, say) that says which data the run
    read; ``cli.py plot``'s title shows its value. None: the title names no data."""
    stand_in_data: tuple[str, ...] = ()
    """Values of ``data_source`` that mean stand-in data (generated, not the real thing): the plot's title says so, in
    red, since its scores say nothing of the task's real data."""


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


def _read(declared: Callable[[Any], Any] | None, holder: Any, attribute: str) -> Any:
    """What a spec's reader returns for ``holder``, else (no reader declared) ``holder``'s attribute of that name."""
    return declared(holder) if declared is not None else getattr(holder, attribute, None)


def class_names(module: Any, datamodule: Any) -> list[str]:
    """The data module's class names, as the module's spec says to read them (empty when it names none)."""
    names = _read(spec_of(module).class_names, datamodule, "class_names")
    return [str(n) for n in names] if names else []


def predict_names(module: Any, datamodule: Any) -> list[str]:
    """What each predicted sample is called, as the module's spec says to read it (empty: by index)."""
    names = _read(spec_of(module).predict_names, datamodule, "predict_names")
    return [str(n) for n in names] if names else []


def epoch_note(module: Any, datamodule: Any) -> str:
    """The data module's note for the epoch line, on one line (empty when it has none), as the module's spec says."""
    note = _read(spec_of(module).epoch_note, datamodule, "epoch_note")
    return " ".join(str(note).split()) if note else ""


def step_values(module: Any) -> Mapping[str, Any]:
    """The module's latest training step's values (name -> tensor) for the progress bar, as its spec says."""
    return _read(spec_of(module).step_values, module, "step_values") or {}


def layers_in_order(module: Any, net: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The network's layers in the order its forward runs them, as the module's spec says (default: the network's
    ``pipeline_layers()``, else an ``nn.Sequential``'s children); None when neither says."""
    declared = spec_of(module).pipeline_layers
    if declared is not None:
        return list(declared(net))
    if callable(getattr(net, "pipeline_layers", None)):
        return list(net.pipeline_layers())
    return list(net) if isinstance(net, torch.nn.Sequential) else None


def step_value_read(trainer, batch_idx: int) -> bool:
    """For a task's ``training_step``: whether a per-step value it logs now reaches anything (a logger, at the
    ``log_every_n_steps`` steps, a stop or ``fast_dev_run``; the callbacks, at the epoch's last batch, ``max_steps``
    or before a validation). Every other step's value is overwritten unread, and each ``self.log`` costs host time,
    so a task may log only when this is true (the example's ``train/loss``). Unknown cases count as read."""
    from app.lightning_internals import step_values_read  # the fit loop's counters: Lightning has no public way

    return step_values_read(trainer, batch_idx)
