"""Checks made right after parsing, before anything runs: the trainer settings Lightning would take and fail on
later, and the task's classes a command line names (which LightningCLI mode they need, and whether they import)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import re
from pathlib import Path

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from app.errors import UserError
from app.launch.launcher import mpi_world_size
from app.parallelism import configured_to_start_own_workers, parallelism
from app.run.arguments import Parser, flag_values
from app.task import import_class

# The template's strategies, in the order of the README's table; every other registered name is Lightning's.
OURS = ("auto", "dp", "ddp", "ddp_spawn", "fsdp", "pipeline", "horovod")
# Lightning registers these whatever is installed; each needs a package of its own.
NEEDS = {"deepspeed": "deepspeed", "xla": "torch_xla", "tpu": "torch_xla"}


def usable_strategy_names() -> tuple[list[str], list[str]]:
    """The registered names this install can run: the template's, then Lightning's others (the ``*_find_unused_
    parameters_*`` spellings left out: each is its ddp kind with one option)."""
    names = set(StrategyRegistry.available_strategies()) | {"auto"}
    ours = [name for name in OURS if name in names]
    others = sorted(
        name
        for name in names - set(ours)
        if "_find_unused_parameters_" not in name
        and all(package_available(package) for word, package in NEEDS.items() if word in name)
    )
    return ours, others


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check_strategy_name(strategy) -> None:
    """An unknown name, or a one-process strategy inside an MPI launch, fails here with the usable names listed."""
    if not isinstance(strategy, str) or strategy == "auto":
        return
    names = sorted(StrategyRegistry.available_strategies())
    if strategy not in names:
        close = difflib.get_close_matches(strategy, names, n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        if "." in strategy:  # a class given as a name: jsonargparse passes a plain string on
            hint = (
                f" A class is given as --trainer.strategy.class_path={strategy} (its arguments as "
                "--trainer.strategy.init_args.NAME=VALUE)."
            )
        ours, others = usable_strategy_names()
        raise UserError(
            f"--trainer.strategy={strategy!r} is not a strategy.{hint} Available: {', '.join(ours)}; and Lightning's "
            f"{', '.join(others)} (docs/strategies.md)"
        )
    if configured_to_start_own_workers(strategy) and mpi_world_size() > 1:  # dp, ddp_spawn, ddp_fork, ddp_notebook
        raise UserError(
            f"--trainer.strategy={strategy} starts its own workers, but this process is one of {mpi_world_size()} MPI "
            "ranks; under mpirun/horovodrun use --trainer.strategy=horovod (or ddp with one rank per device)"
        )


def trainer_setting_error(err: Exception, trainer_config) -> UserError | None:
    """Lightning's own complaint about a Trainer setting (it names it in backquotes) as one line naming the flag."""
    reason = " ".join(str(err).split())
    settings = inspect.signature(Trainer.__init__).parameters
    for name in re.findall(r"`(?:Trainer\()?(\w+)", reason):
        if name in settings:
            return UserError(f"--trainer.{name}={trainer_config.get(name)}: {reason}")
    return None


def check_trainer_numbers(trainer_config) -> None:
    """Settings Lightning takes without a check and fails on later with a bare ZeroDivisionError."""
    accumulate = trainer_config.get("accumulate_grad_batches")
    if not isinstance(accumulate, int) or accumulate < 1:
        raise UserError(
            f"--trainer.accumulate_grad_batches={accumulate}: use a whole number >= 1 (the batches per optimizer step)"
        )


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_oversubscription(trainer: Trainer, cores: int | None = None) -> str | None:
    """The cost, in one line, of more CPU devices on this node than it has cores (None when there are not)."""
    from lightning.pytorch.accelerators import CPUAccelerator

    if cores is None and mpi_world_size() > 1 and usable_cores() < (os.cpu_count() or 1):
        return None  # mpirun bound each rank to cores of its own: it placed the node's ranks, one device each
    cores = cores or usable_cores()
    devices = trainer.num_devices
    if not isinstance(trainer.accelerator, CPUAccelerator) or devices <= cores:
        return None
    one_process = parallelism(trainer.strategy).devices_per_process > 1  # dp: its replicas are threads
    what = "threads of one process" if one_process else "processes"
    return (
        f"--trainer.devices={devices}: {devices} CPU devices on {cores} cores; the {what} take turns on the cores, "
        f"so this run is slower than with --trainer.devices={cores} or fewer (docs/strategies.md, devices on a CPU)"
    )


def check_devices(devices) -> None:
    try:
        count = int(devices)
    except (TypeError, ValueError):
        return  # "auto", a list or "0,1": Lightning checks those
    if count == 0 or count < -1:
        raise UserError(
            f"--trainer.devices={devices}: use a positive count, -1 or auto (all GPUs), or a list like [0,1]"
        )


def init_parameters(cls: type) -> list[str] | None:
    """The names ``cls(...)`` takes, or None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return [name for name in parameters if name != "self"]


def named_classes(argv: list[str], group: str) -> list[str]:
    """The class paths (or names) that the command line or its ``--config`` files give the ``group`` (``--model=
    pkg.Class``, ``--model.class_path``, a YAML ``model: {class_path: ...}``); ``"?"`` for one inside inline YAML."""
    found = [value for _, _, value in flag_values(argv, f"--{group}.class_path")]
    for _, _, value in flag_values(argv, f"--{group}"):
        found += _class_in_value(value)
    return found + _classes_in_config_files(group)


def _classes_in_config_files(group: str) -> list[str]:
    """The ``class_path`` each --config file of the command line gives the ``group``, at its top or under a
    subcommand's key."""
    found = []
    for data in Parser.config_files.values():
        for holder in [data] + [data.get(sub) for sub in LightningCLI.subcommands() if isinstance(data, dict)]:
            path = holder.get(group, {}).get("class_path") if isinstance(holder, dict) else None
            if isinstance(holder, dict) and isinstance(holder.get(group), dict) and isinstance(path, str):
                found.append(path)
    return found


def _class_in_value(value: str) -> list[str]:
    """The class a ``--model`` value names: a YAML file's ``class_path``, a class path or name, ``"?"`` for inline
    YAML or JSON."""
    if Path(value).is_file():  # --model=file.yaml
        try:
            data = yaml.safe_load(Path(value).read_text())
        except yaml.YAMLError:
            return []  # jsonargparse names the file
        return [data["class_path"]] if isinstance(data, dict) and isinstance(data.get("class_path"), str) else []
    if re.fullmatch(r"[A-Za-z_][\w.]*", value):  # a class path or a class name
        return [value]
    return ["?"] if "class_path" in value else []


def names_class(argv: list[str], group: str) -> bool:
    """Whether the command line or one of its ``--config`` files names the ``group``'s class."""
    return bool(named_classes(argv, group))


def check_class_imports(argv: list[str]) -> None:
    """A named class whose module cannot be imported: one line saying why and where, instead of jsonargparse's
    "either not accessible or invalid" (a user's own module with a bug, a missing package, a typo in the module)."""
    for group in ("model", "data"):
        for class_path in named_classes(argv, group):
            module, _, name = class_path.rpartition(".")
            if not module:
                continue  # a bare class name, or inline YAML: jsonargparse resolves it
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name and (module == err.name or module.startswith(err.name + ".")):
                    raise UserError(
                        f"--{group}={class_path}: no module named {err.name!r}; check the name, and that the folder "
                        "holding it is on PYTHONPATH (or installed)"
                    ) from None
                raise UserError(f"--{group}={class_path}: importing {module} failed: {_where(err)}") from None
            except Exception as err:  # noqa: BLE001 - the user's own module: say what and where
                raise UserError(f"--{group}={class_path}: importing {module} failed: {_where(err)}") from None


def _where(err: BaseException) -> str:
    """``ZeroDivisionError: division by zero (at /path/mod.py:12)``: the exception and its innermost frame."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and "<frozen" not in f.filename]
    at = f" (at {user[-1].filename}:{user[-1].lineno})" if user else ""
    return f"{type(err).__name__}: {err}{at}"


def task_classes(argv: list[str], model: str | type | None, data: str | type | None) -> dict:
    """LightningCLI's class arguments: the default task's classes, fixed (flat ``--model.ARG``, flat YAML), unless
    the command line names another class, which then works as in any LightningCLI (``--model=pkg.Class
    --model.hidden=64``; its own defaults, none of the default class's). With no default, the command line must
    name the class."""
    kwargs = {}
    for group, default, base, key in (
        ("model", model, LightningModule, "model_class"),
        ("data", data, LightningDataModule, "datamodule_class"),
    ):
        named = names_class(argv, group) or default is None
        kwargs[key] = base if named else (import_class(default) if isinstance(default, str) else default)
        kwargs[f"subclass_mode_{group}"] = named
    return kwargs
