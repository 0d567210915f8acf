"""The command line: a thin LightningCLI with the template's defaults, and one-line errors for bad input."""

from __future__ import annotations

import difflib
import errno
import importlib
import inspect
import logging
import os
import re
import sys
import warnings
from pathlib import Path

import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

import app  # noqa: F401  (registers the dp and horovod strategies)
from app.callbacks import RankWatchdog
from app.callbacks.elastic import ElasticRunFolder
from app.checkpoint_io import SafeCheckpointIO, check_compatible, load_checkpoint, saved_class
from app.elastic import (
    TorchrunJob,
    agent_id,
    finished_run_of,
    keep_metrics_for_restart,
    run_of,
    take_launcher_numbers,
    torchrun_job,
)
from app.errors import UserError
from app.lightning_internals import epochs_done
from app.run_dir import check_writable, claim_versions, folder_logger_root, is_first_process, release_if_unused
from app.strategies.launch import launcher_ranks, mpi_world_size
from app.task import DEFAULT_SPEC, TaskSpec, spec_of

# The task a run trains when the command line names no class (``--model=pkg.Class``, ``--data=pkg.Class`` or a YAML
# ``class_path``). The machinery never imports it: a fork passes its own to main() in cli.py (docs/fork.md).
DEFAULT_MODEL = "app.fashion_mnist.model.ImageClassifier"
DEFAULT_DATA = "app.fashion_mnist.data.FashionMNISTDataModule"

# Added to every fit/validate/test/predict, beside the run's own callbacks (a YAML ``trainer.callbacks:`` list or
# ``--trainer.callbacks+=``), unless the run gives a callback of the same kind (its own ModelCheckpoint, progress
# bar, ...), turns the feature off (``--trainer.logger=false``, ``--trainer.enable_checkpointing=false``,
# ``enable_progress_bar``, ``enable_model_summary``), or names it in ``--drop_callbacks``.
DEFAULT_CALLBACKS = [
    {"class_path": "app.callbacks.ProgressBar"},
    {"class_path": "lightning.pytorch.callbacks.RichModelSummary", "init_args": {"max_depth": 2}},
    {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
    {"class_path": "app.callbacks.ModelCheckpoint"},  # its settings come from the task's spec: checkpoint_options
    {"class_path": "app.callbacks.RunReport"},
    {"class_path": "app.callbacks.PredictionWriter"},
    {"class_path": "app.callbacks.Preemption"},
    {"class_path": "app.callbacks.Elastic"},
    {"class_path": "app.callbacks.StopOnNonFinite"},
]
# A run's own callback that is an instance of the kind replaces the default.
_KIND = {
    "ProgressBar": "lightning.pytorch.callbacks.ProgressBar",
    "RichModelSummary": "lightning.pytorch.callbacks.ModelSummary",
    "LearningRateMonitor": "lightning.pytorch.callbacks.LearningRateMonitor",
    "ModelCheckpoint": "lightning.pytorch.callbacks.ModelCheckpoint",
    "PredictionWriter": "lightning.pytorch.callbacks.BasePredictionWriter",
}
DEFAULT_CALLBACK_NAMES = [c["class_path"].rsplit(".", 1)[-1] for c in DEFAULT_CALLBACKS]

CKPT_PATH_HELP = (
    "Checkpoint to start from: a file (lightning_logs/version_N/checkpoints/last.ckpt, or epoch=E-val_acc=A.ckpt "
    "there), 'last' (the newest run's last.ckpt; fit starts fresh when there is none) or 'best' (the best checkpoint "
    "of the newest run). Its network settings (--model.arch, norm, num_classes) are used."
)
TOOLS_EPILOG = (
    "Besides Lightning's subcommands: 'cli.py plot lightning_logs/version_N' draws a run's curves to a PNG, and "
    "'cli.py export --ckpt_path CKPT --out model.pt' writes the trained network for inference; each takes --help."
)


def _import(class_path: str) -> type:
    module, name = class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _init_parameters(cls: type) -> list[str] | None:
    """The names ``cls(...)`` takes, or None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return [name for name in parameters if name != "self"]


def checkpoint_options(spec: TaskSpec) -> dict:
    """The default ModelCheckpoint's settings for a task: the best by its monitored metric (``epoch=3-val_acc=0.9123
    .ckpt``), or without one the newest epoch's; ``last.ckpt`` always."""
    options = {"save_last": True, "auto_insert_metric_name": False}
    if spec.monitor is None:
        return {**options, "filename": "epoch={epoch}-step={step}"}
    safe = re.sub(r"[^\w.-]", "_", spec.monitor)  # val/acc -> val_acc: no folder in the file name
    filename = f"epoch={{epoch}}-{safe}={{{spec.monitor}:.4f}}"
    return {**options, "monitor": spec.monitor, "mode": spec.mode, "filename": filename}


def default_callbacks(trainer_config: dict, own: list, drop: list[str], spec: TaskSpec = DEFAULT_SPEC) -> list:
    """The default callbacks (built) that a run with these trainer settings and own callbacks gets."""
    for name in drop:
        if name not in DEFAULT_CALLBACK_NAMES:
            close = difflib.get_close_matches(name, DEFAULT_CALLBACK_NAMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            names = ", ".join(DEFAULT_CALLBACK_NAMES)
            raise UserError(f"--drop_callbacks: {name!r} is not a default callback{hint}; they are {names}")
    logger = trainer_config.get("logger")
    switched_off = {
        "ProgressBar": trainer_config.get("enable_progress_bar") is False,
        "RichModelSummary": trainer_config.get("enable_model_summary") is False,
        "LearningRateMonitor": logger is False or logger is None or logger == [],
        "ModelCheckpoint": trainer_config.get("enable_checkpointing") is False,
    }
    built = []
    for entry, name in zip(DEFAULT_CALLBACKS, DEFAULT_CALLBACK_NAMES, strict=True):
        kind = _import(_KIND.get(name, entry["class_path"]))
        if name in drop or switched_off.get(name) or any(isinstance(c, kind) for c in own):
            continue
        options = checkpoint_options(spec) if name == "ModelCheckpoint" else entry.get("init_args", {})
        built.append(_import(entry["class_path"])(**options))
    return built


def default_loggers(save_dir: str = ".") -> list[dict]:
    """CSV always (metrics.csv); TensorBoard too when it is installed. Both write to lightning_logs/version_N."""
    csv = {"save_dir": save_dir, "name": "lightning_logs"}
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": csv}]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    tb = {"save_dir": save_dir, "name": "lightning_logs", "default_hp_metric": False}
    return loggers + [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": tb}]


def nested_option_error(line: str) -> str | None:
    """jsonargparse's union error for an option of a class given by name or class path (``--trainer.strategy.op``,
    ``--trainer.callbacks.hook``), as one sentence: the flag, what is wrong, and the choices or the closest option."""
    group = re.search(r'Parser key "([\w.]+)": Does not validate against any of the Union subtypes', line)
    given = re.search(r"NestedArg\(key='([\w.]+)', val='([^']*)'\)", line)
    if not (group and given):
        return None
    key, value = given.groups()
    flag = f"--{group.group(1)}.{key}={value}"
    problem = re.search(
        rf"Problem with given class_path '([\w.]+)': (?:Parser key \"{re.escape(key)}\": (.*?)(?= - |$)|"
        rf"(Option '{re.escape(key)}' is not accepted))",
        line,
    )
    if problem is None:
        return None
    class_path, wrong_value, unknown = problem.groups()
    name = class_path.rsplit(".", 1)[1]
    if unknown:
        options = [p for p in inspect.signature(_import(class_path).__init__).parameters if p not in ("self", "args")]
        close = difflib.get_close_matches(key, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"{flag}: {name} has no option {key!r}{hint}; its options: {', '.join(options)}"
    choices = re.search(r"Expected a typing\.Literal\[(.*?)\]", wrong_value)
    if choices:
        return f"{flag}: must be one of {', '.join(c.strip().strip(chr(39)) for c in choices.group(1).split(','))}"
    return f"{flag}: {wrong_value.split(' Given value type:')[0].strip()}"


PLAIN_TYPES = {"<class 'int'>": "a whole number", "<class 'float'>": "a number", "<class 'bool'>": "true or false"}


def plain_types(types: list[str]) -> str:
    """``["<class 'int'>", "<class 'float'>"]`` -> "a number" (a whole number is a number too)."""
    if "<class 'float'>" in types:
        types = [t for t in types if t != "<class 'int'>"]
    return " or ".join(PLAIN_TYPES[t] for t in types)


def union_error(line: str) -> str | None:
    """jsonargparse's union error for a value that fits none of an option's types, as one sentence: the choices
    when the types are literals (``--trainer.precision``), the closest class when a class path names none."""
    key = re.search(r'Parser key "([\w.]+)":', line)
    if key is None:
        return None
    flag = f"--{key.group(1)}"
    missing = re.search(r"Problem with given class_path '([\w.]+)': module '([\w.]+)' has no attribute '(\w+)'", line)
    if missing:
        _, module, name = missing.groups()
        try:
            names = [n for n, v in vars(importlib.import_module(module)).items() if isinstance(v, type)]
        except ImportError:
            names = []
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f" (did you mean {module}.{close[0]}?)" if close else ""
        return f"{flag}: {module} has no class {name!r}{hint}"
    one = re.search(r"Expected a typing\.Literal\[(.*?)\]\. Got value: (.*?)(?:; see:|$)", line)
    if one:
        choices = [c.strip().strip("'") for c in one.group(1).split(",")]
        return f"{flag}={one.group(2)}: must be one of {', '.join(choices)}"
    one = re.search(r"Expected a (<class '(?:int|float|bool)'>)\. Got value: (.*?)(?:; see:|$)", line)
    if one:
        return f"{flag}={one.group(2)}: expected {plain_types([one.group(1)])}"
    subtypes = re.search(r"Subtypes: \[(.*?)\] Errors:", line)
    given = re.search(r"Given value: (.*)$", line)
    if not (subtypes and given):
        return None
    types = re.findall(
        r"typing\.Literal\[[^\]]*\]|<class '[\w.]+'>|[\w.\[\], ]+?(?=, typing|, <class|$)", subtypes.group(1)
    )
    value = given.group(1).split(";")[0].strip()
    if types and all(t in PLAIN_TYPES or t == "<class 'NoneType'>" for t in types):  # --trainer.max_epochs=abc
        return f"{flag}={value}: expected {plain_types([t for t in types if t in PLAIN_TYPES])}"
    if not types or not all(t.startswith("typing.Literal[") or t == "<class 'NoneType'>" for t in types):
        return None
    choices: list[str] = []
    for literal in (t for t in types if t.startswith("typing.Literal[")):
        for choice in re.findall(r"'([^']*)'|(-?\d+)", literal.removeprefix("typing.Literal[")):
            text = choice[0] or choice[1]
            if text not in choices:
                choices.append(text)
    return f"{flag}={value}: must be one of {', '.join(choices)}"


# An optimizer's arguments, given as --model.lr: they are --model.optimizer.lr.
OPTIMIZER_ARGS = {"lr", "momentum", "weight_decay", "nesterov", "betas", "eps", "dampening", "amsgrad"}


class Parser(LightningArgumentParser):
    """Parse errors as one line (no 70-line usage), with the closest flag when one was mistyped."""

    config_files: dict[Path, object] = {}  # the --config files of this command line, as read (check_config_files)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = " ".join(message.split())
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        unknown = re.findall(r"(--[\w.\-]+)", line) if "nrecognized" in line else []
        # a key of a YAML config: "... does not accept option 'trainer.max_epoch'"
        unknown += ["--" + key for key in re.findall(r"does not accept option '([\w.\-]+)'", line)]
        for flag in unknown:
            # not a group the flag is inside of (--model for --model.lr); an optimizer's argument is under the optimizer
            candidates = [f for f in flags if not flag.startswith(f + ".")]
            close = difflib.get_close_matches(flag, candidates, n=1, cutoff=0.75)
            if flag.startswith("--model.") and flag.count(".") == 1 and flag[8:] in OPTIMIZER_ARGS:
                close = [f"--model.optimizer.{flag[8:]}"]
            if close:
                line += f" (did you mean {close[0] if flag in line else close[0][2:]}?)"
                break
        for flag in unknown:  # a key of a YAML config: which file holds it
            holder = next((path for path, data in self.config_files.items() if has_key(data, flag[2:])), None)
            if holder is not None and str(holder) not in line:
                line = f"{holder}: {line}"
                break
        line = nested_option_error(line) or union_error(line) or line
        prog = parser.prog.replace(" [options]", "")
        script, _, rest = prog.partition(" ")
        if Path(sys.argv[0]).name == script:  # the script as the user typed it: from another folder, its path
            prog = f"{sys.argv[0]} {rest}".strip()
        raise UserError(f"{line}; see: python {prog} --help")

    def add_method_arguments(self, *args, **kwargs):
        """The subcommands' arguments (``--ckpt_path`` among them, whose help is ours)."""
        added = super().add_method_arguments(*args, **kwargs)
        for action in self._actions:
            if action.dest == "ckpt_path":
                action.help = CKPT_PATH_HELP
        return added


class HeldRecords(logging.Filter):
    """Holds a logger's records back until :meth:`release`; :meth:`drop` discards them.

    Lightning seeds (and logs "Seed set to 42") before it builds the model and the data module, which check their
    arguments: an error there would follow the seed line. The line waits until the classes are built."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger, self.records = logging.getLogger(name), []
        self.logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def drop(self) -> None:
        self.logger.removeFilter(self)
        self.records.clear()

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()


class CLI(LightningCLI):
    def __init__(self, *args, **kwargs) -> None:
        self._claimed: list[Path] = []
        self._seed_line: HeldRecords | None = None
        self._args = kwargs.get("args")
        self._optimizer_overrides: dict = {}
        self._loaded: dict[str, dict] = {}  # checkpoints read by the CLI's checks, each read once
        self._elastic_ckpt: str | None = None  # the last.ckpt a torchrun restart resumes from
        self._elastic_run: ElasticRunFolder | None = None
        argv = sys.argv[1:] if self._args is None else self._args
        self._requested = argv[0] if isinstance(argv, list) and argv else None
        UserError.latest = None
        try:
            super().__init__(*args, **kwargs)
        except BaseException as err:
            if getattr(getattr(self, "trainer", None), "global_step", 0) == 0:
                release_if_unused(self._claimed)  # a run that failed before doing anything leaves no folder
            if self._seed_line is not None:
                self._seed_line.drop()
            latest = UserError.latest
            # a class (strategy, callback, model) refused a value while jsonargparse built it: jsonargparse
            # reports the message inside a union error of its own; say only ours
            wrapped = isinstance(err, ValueError) and latest is not None and latest is not err
            if wrapped and " ".join(str(latest).split()) in " ".join(str(err).split()):
                raise latest from None
            if isinstance(err, MisconfigurationException | ValueError) and not isinstance(err, UserError):
                # Lightning checks some settings only when the run starts (val_check_interval against the batches)
                config = self.config[self.subcommand] if getattr(self, "subcommand", None) else {}
                user_error = trainer_setting_error(err, config.get("trainer", {}))
                if user_error is not None:
                    raise user_error from None
            raise

    def subcommands(self) -> dict[str, set[str]]:
        """Lightning's subcommands, only the one asked for when the command line starts with it (``cli.py fit``):
        each subcommand's parser takes about 0.2 s to build, and only one of them runs."""
        every = LightningCLI.subcommands()
        return {self._requested: every[self._requested]} if self._requested in every else every

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.epilog = TOOLS_EPILOG  # plot and export are ours, dispatched in main()

    def parse_arguments(self, parser, args) -> None:
        """Lightning's, with a strategy's options accepted after its short name (:func:`strategy_options_by_name`),
        and the trainer's settings checked before anything runs (Lightning seeds and prints "Seed set to" next)."""
        argv = sys.argv[1:] if args is None else args
        if not isinstance(argv, list):
            super().parse_arguments(parser, args)
        else:
            self.config = parser.parse_args(strategy_options_by_name(argv))
        subcommand = self.config.get("subcommand")
        trainer = (self.config[subcommand] if subcommand else self.config).trainer
        check_strategy_name(trainer.strategy)
        check_devices(trainer.devices)
        check_trainer_numbers(trainer)
        self._seed_line = HeldRecords("lightning.fabric.utilities.seed")  # printed once the classes are built

    def after_instantiate_classes(self) -> None:
        if self._seed_line is not None:
            self._seed_line.release()
        data = self._init_args(self._subconfig(self.config), "data")
        if data is not None and isinstance(data.get("data_dir"), str):
            # config.yaml (written at setup) names the files this run read, whichever folder it runs again from;
            # the data module and its messages keep the folder as given
            data.data_dir = os.path.abspath(os.path.expanduser(data.data_dir))

    def add_arguments_to_parser(self, parser) -> None:
        defaults = {"trainer.max_epochs": 10, "trainer.logger": default_loggers()}
        # A model that takes --model.optimizer may name its default (the example task: SGD), shown in --help and
        # recorded in config.yaml. Only for a class fixed in advance: under --model=pkg.Class a default set here
        # would carry over into another class's arguments.
        optimizer = getattr(self.model_class, "default_optimizer", None)
        if not self.subclass_mode_model and optimizer and "optimizer" in _init_parameters(self.model_class):
            defaults["model.optimizer"] = optimizer
        parser.set_defaults(defaults)
        # On in every run: --watchdog.timeout=SECONDS (see app/callbacks/rank_watchdog.py).
        parser.add_lightning_class_args(RankWatchdog, "watchdog")
        parser.add_argument(
            "--drop_callbacks",
            type=list[str],
            default=[],
            help=f"Default callbacks to leave out, by class name: {', '.join(DEFAULT_CALLBACK_NAMES)}.",
        )
        parser.add_argument(
            "--allow_remote_ckpt",
            type=bool,
            default=False,
            help="Allow an http(s):// --ckpt_path (downloaded, then loaded with weights_only=True like any other).",
        )

    def _subconfig(self, config):
        return config[self.subcommand] if self.subcommand else config

    def _init_args(self, config, group: str):
        """The ``model`` or ``data`` arguments of a parsed config, whether the class was fixed or named."""
        value = config.get(group)
        subclass = self.subclass_mode_model if group == "model" else self.subclass_mode_data
        return value.get("init_args") if subclass and value is not None else value

    def _chosen_model_class(self, subcommand: str) -> type:
        if not self.subclass_mode_model:
            return self.model_class
        return _import(self.config[subcommand].model.class_path)

    def before_instantiate_classes(self) -> None:
        config = self._subconfig(self.config)
        # The default loggers write under --trainer.default_root_dir, as Lightning's own default logger does;
        # a logger given with another save_dir keeps it.
        root = config.trainer.default_root_dir
        loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
        defaults = {d["class_path"] for d in default_loggers()}
        for logger in loggers:
            init_args = getattr(logger, "init_args", None)
            if root and getattr(logger, "class_path", None) in defaults and init_args.get("save_dir") == ".":
                init_args.save_dir = str(root)
        if is_first_process():
            check_writable(root or Path.cwd())
        if is_first_process() and self.subcommand == "fit" and config.trainer.logger in (False, []):
            check_loggerless_root(Path(root or "."), config)
        # Under a launcher, a config file's devices (written for a run of one process) yields to the processes per
        # node it started; only --trainer.devices on the command line is checked against them.
        argv = sys.argv[1:] if self._args is None else list(self._args)
        devices_given = any(a == "--trainer.devices" or a.startswith("--trainer.devices=") for a in argv)
        job = torchrun_job()
        if job is not None:
            take_launcher_numbers(config.trainer, job, devices_given)
        mpi = launcher_ranks()
        if mpi is not None and not devices_given:
            config.trainer.devices = mpi[3]
        continued = self._elastic_restart(config, loggers, job)
        if not config.trainer.get("fast_dev_run"):  # (fast_dev_run logs nothing: Lightning swaps the loggers out)
            self._claimed = claim_versions(loggers, continued)  # version_N made now: no other run can take it
        if job is not None and job.restarts_possible and self.subcommand == "fit":
            self._elastic_run = ElasticRunFolder(job, self._claimed, continued, self._elastic_ckpt)

    def _elastic_restart(self, config, loggers: list, job: TorchrunJob | None) -> dict[Path, int]:
        """A restart by torchrun goes on in the run folder of the job's first start, from its last.ckpt if any."""
        if job is None or not job.restarts_possible or self.subcommand != "fit":
            return {}
        continued = {}
        for logger in loggers:
            root = folder_logger_root(logger)
            version = None if root is None else run_of(root, job)
            if version is None and root is not None:
                done = finished_run_of(root, job, agent_id())
                if done is not None:
                    rank_zero_info(
                        f"torchrun restarted the job after its run finished ({root}/version_{done}, marked finished; "
                        "a worker failed after training, e.g. at exit): nothing left to train"
                    )
                    raise SystemExit(0)
            if version is None or root in continued:
                continue
            continued[root] = version
            # config.yaml stays the first start's; each restart records what it ran with beside it
            name = f"config.restart{job.restart_count}.yaml" if job.restart_count else "config.rejoined.yaml"
            restart_config = {"config_filename": name, "overwrite": True}
            self.save_config_kwargs = {**self.save_config_kwargs, **restart_config}
            folder = root / f"version_{version}"
            if is_first_process():
                keep_metrics_for_restart(folder)
            last = folder / "checkpoints" / "last.ckpt"
            if last.is_file() and not self._elastic_ckpt:
                self._elastic_ckpt = str(last.resolve())
                config.ckpt_path = self._elastic_ckpt
        return continued

    def instantiate_trainer(self, **kwargs):
        config = self._subconfig(self.config_init)
        if config.trainer.get("logger") in (False, []):
            self.save_config_callback = None  # no run folder for config.yaml: it would go into the root itself
        own = list(config.trainer.get("callbacks") or [])
        drop = config.get("drop_callbacks") or []
        kwargs["callbacks"] = default_callbacks(config.trainer, own, drop, spec_of(self.model)) + own
        if self._elastic_run is not None:
            kwargs["callbacks"].insert(0, self._elastic_run)  # its setup's check comes before any other collective
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, TypeError, ValueError) as err:
            if isinstance(err, UserError):
                raise
            reason = " ".join(str(err).split())
            if re.search(r"\b(devices?|accelerator|gpus?|cuda|mps|tpu)\b", reason, re.IGNORECASE):
                t = config.trainer
                raise UserError(
                    f"--trainer.accelerator={t.accelerator} --trainer.devices={t.devices}: {reason} "
                    f"({torch.cuda.device_count()} CUDA device(s) visible here; on CPU, devices is the number of "
                    "processes)"
                ) from None
            if isinstance(err, MisconfigurationException | ValueError):
                raise trainer_setting_error(err, config.trainer) or UserError(reason) from None
            raise
        # Atomic checkpoint writes and weights_only loads, whatever the strategy.
        trainer.strategy.checkpoint_io = SafeCheckpointIO(allow_remote=bool(config.get("allow_remote_ckpt")))
        return trainer

    # ``LightningCLI`` calls ``before_<subcommand>`` just before ``trainer.<subcommand>(ckpt_path=...)``.
    def before_fit(self) -> None:
        self._check_ckpt_path()
        self.model.optimizer_overrides = self._optimizer_overrides

    before_validate = before_test = before_predict = before_fit

    def _parse_ckpt_path(self) -> None:  # LightningCLI's private step (app/lightning_internals.py, item 5)
        """Lightning's own step, made safe, strict and explicit. One rule for every form of ``--ckpt_path``:

        - the network (``--model.arch``, ``norm``, ``num_classes``) is the checkpoint's; giving one of them with
          another value (on the command line or in a ``--config`` file) is an error naming both values;
        - a training setting given explicitly (``--model.optimizer...``, ``--model.label_smoothing``, ...) wins over
          the checkpoint's, with a one-line notice naming it; one not given is the checkpoint's;
        - ``fit`` resumes the optimizer's state, with the optimizer arguments given explicitly (its lr, momentum,
          ...) put over the restored ones (the example task's ``on_load_checkpoint``).

        The run's config.yaml records the values used. The file is loaded safely (``weights_only``; one-line errors
        for a missing, truncated, remote or unsafe file).
        """
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path in ("last", "best"):
            ckpt_path = resolve_last_or_best(ckpt_path, self.config[subcommand], self._load)
        if not ckpt_path or ckpt_path == "hpc":
            return
        allow_remote = bool(self.config[subcommand].get("allow_remote_ckpt"))
        checkpoint = self._load(ckpt_path, allow_remote)
        saved = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
        model_class = self._chosen_model_class(subcommand)
        class_path = f"{model_class.__module__}.{model_class.__qualname__}"
        writer = saved_class(checkpoint)
        known = _init_parameters(model_class)
        unknown = sorted(set(saved) - set(known)) if known is not None else []
        if (writer and writer != class_path) or unknown:
            wrote = f"written by {writer}" if writer else f"unknown hyperparameters {unknown}"
            fix = f"pass --model={writer}" if writer else "pass the --model class it was trained with"
            data_writer = checkpoint.get("datamodule_hyper_parameters", {}).get("_class_path")
            if writer and data_writer:
                fix += f" --data={data_writer}"
            raise UserError(f"{ckpt_path}: not a checkpoint of {class_path} ({wrote}); {fix}, or another --ckpt_path")
        network = spec_of(model_class).network
        explicit = self._explicit_model_settings(subcommand)
        given = self._init_args(self.config[subcommand], "model")
        for key in network:
            if key in saved and key in explicit and given.get(key) != saved[key]:
                raise UserError(
                    f"{ckpt_path} holds a network with --model.{key}={saved[key]}, but --model.{key}={given.get(key)} "
                    f"was given; drop the flag (the checkpoint's value is used) or pass another --ckpt_path"
                )
        taken = {k: v for k, v in saved.items() if k in network or k not in explicit}
        if subcommand == "fit" and "optimizer" in explicit:
            self._optimizer_overrides = optimizer_overrides(explicit["optimizer"], saved.get("optimizer"), ckpt_path)
            if isinstance(saved.get("optimizer"), dict):  # the restored optimizer, with the given arguments over it
                init_args = {**saved["optimizer"].get("init_args", {}), **self._optimizer_overrides}
                taken["optimizer"] = {**saved["optimizer"], "init_args": init_args}
        notes = [
            f"--model.{k}={explicit[k]}"
            for k in sorted(explicit)
            if k not in (*network, "optimizer") and k in saved and explicit[k] != saved[k]
        ]
        notes += [f"--model.optimizer.{k}={v}" for k, v in self._optimizer_overrides.items()]
        if notes:
            rank_zero_info(f"--ckpt_path {ckpt_path}: the checkpoint's network and settings, except {', '.join(notes)}")
        model = {"class_path": class_path, "init_args": taken} if self.subclass_mode_model else taken
        self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def _load(self, ckpt_path, allow_remote: bool = False) -> dict:
        key = str(ckpt_path) if "://" in str(ckpt_path) else str(Path(ckpt_path).resolve())
        if key not in self._loaded:
            self._loaded[key] = load_checkpoint(ckpt_path, allow_remote=allow_remote)
        return self._loaded[key]

    def _explicit_model_settings(self, subcommand: str) -> dict:
        """The ``--model`` settings this command gives itself (flags and --config files), without the defaults."""
        args = self._args if isinstance(self._args, list) else sys.argv[1:]
        given = self.parser.parse_args(args, defaults=False)[subcommand].get("model")
        if given is not None and self.subclass_mode_model:
            given = given.get("init_args")
        return {k: _plain(v) for k, v in vars(given).items()} if given else {}

    def _check_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path last`` and ``best`` ourselves, and refuse weights that do not fit, before any work.

        The resolved path is what the run's config.yaml records, so ``cli.py plot`` can join a resumed run to
        the run its checkpoint came from.
        """
        config = self.config_init[self.subcommand]
        ckpt_path = given = config.get("ckpt_path")
        if given in ("last", "best"):
            found = find_last_checkpoint(self.trainer)
            if found is not None and given == "best":
                found = best_checkpoint_of(found, self._load)
            if found is None:
                if given == "best" or self.subcommand != "fit":
                    what = "best checkpoint" if given == "best" else "last.ckpt"
                    raise UserError(
                        f"--ckpt_path {given}: no {what} under {log_root(self.trainer)}/ yet; train first, or pass "
                        "a checkpoint file"
                    )
                rank_zero_info(f"--ckpt_path last: no last.ckpt under {log_root(self.trainer)}/ yet; starting fresh")
            ckpt_path = None if found is None else str(found)
        if ckpt_path is None or ckpt_path == "hpc":
            config["ckpt_path"] = self.config[self.subcommand]["ckpt_path"] = ckpt_path
            if ckpt_path is None and self.subcommand != "fit":
                rank_zero_info(
                    f"no --ckpt_path: {self.subcommand} uses a freshly initialised, untrained network; pass "
                    "--ckpt_path best, last or a checkpoint file to use trained weights"
                )
            return
        allow_remote = bool(self.config[self.subcommand].get("allow_remote_ckpt"))
        checkpoint = self._load(ckpt_path, allow_remote)
        self._loaded.clear()  # Lightning reads the file once more to restore from it: its fit() takes a path
        check_compatible(checkpoint, ckpt_path, self.model)
        if self.subcommand == "fit" and not checkpoint.get("optimizer_states"):
            raise UserError(
                f"{ckpt_path}: holds the network's weights but no optimizer state (written with save_weights_only), "
                "so fit cannot resume from it; validate, test, predict and export accept it"
            )
        if self.subcommand == "fit":
            nothing_left_to_train(checkpoint, ckpt_path, self.trainer)
        prefix = f"--ckpt_path {given}: " if given != ckpt_path else ""
        if ckpt_path == self._elastic_ckpt:
            job = torchrun_job()
            what = f"restart {job.restart_count} of at most {job.max_restarts}" if job.restart_count else "re-formed"
            rank_zero_info(
                f"torchrun {what}: {job.world_size} process(es) on {job.nodes} node(s), resuming from {ckpt_path} "
                f"(step {checkpoint.get('global_step', '?')}) in the same run folder"
            )
        elif self.subcommand == "fit":
            where = (
                "its checkpoints go on in the same folder (no logger)"
                if not self.trainer.loggers
                else "this run logs to a new version folder, and cli.py plot of it draws the earlier run's curve too"
            )
            rank_zero_info(f"{prefix}resuming from {ckpt_path} (step {checkpoint.get('global_step', '?')}); {where}")
        elif prefix:
            rank_zero_info(f"{prefix}{ckpt_path}")
        if "://" not in str(ckpt_path):
            ckpt_path = str(Path(ckpt_path).resolve())
        config["ckpt_path"] = self.config[self.subcommand]["ckpt_path"] = ckpt_path


def nothing_left_to_train(checkpoint: dict, ckpt_path: str, trainer) -> None:
    """A resume whose checkpoint already reached ``max_epochs`` or ``max_steps`` trains nothing (Lightning's fit loop
    is done before it starts): say so in one line and exit 0, leaving no run folder, instead of a silent empty run.
    Exit 0, not an error: a restart loop (``until cli.py fit ... --ckpt_path last``) ends when the run has."""
    epochs, step = epochs_done(checkpoint), checkpoint.get("global_step", 0)
    if trainer.max_epochs not in (None, -1) and epochs >= trainer.max_epochs:
        reached, more = f"{epochs} epoch(s), --trainer.max_epochs={trainer.max_epochs}", "--trainer.max_epochs"
    elif trainer.max_steps not in (None, -1) and step >= trainer.max_steps:
        reached, more = f"step {step}, --trainer.max_steps={trainer.max_steps}", "--trainer.max_steps"
    else:
        return
    rank_zero_info(f"{ckpt_path}: already trained {reached}; nothing left to train. Pass a larger {more} to go on")
    raise SystemExit(0)


def log_root(trainer) -> Path:
    """The folder that holds the runs' ``version_N`` folders (``lightning_logs`` by default)."""
    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is not None and getattr(logger, "root_dir", None):
        return Path(logger.root_dir)
    return Path(trainer.default_root_dir) / "lightning_logs"


def find_last_checkpoint(trainer) -> Path | None:
    """The newest ``last.ckpt`` of any earlier run (each run logs to its own ``version_N``), or None."""
    folders = [Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    return newest_last_ckpt(log_root(trainer), Path(trainer.default_root_dir), folders)


def newest_last_ckpt(runs_root: Path, default_root: Path, folders: list[Path] = ()) -> Path | None:
    candidates = list(runs_root.glob("version_*/checkpoints/last.ckpt"))
    candidates += list((default_root / "checkpoints").glob("last.ckpt"))  # runs without a logger
    for folder in folders:  # ModelCheckpoints with an explicit folder
        candidates += list(folder.glob("last.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def check_loggerless_root(root: Path, config) -> None:
    """Without a logger there is no run folder: Lightning writes the checkpoints straight into ``ROOT/checkpoints``,
    where a new run would overwrite an earlier run's. A resume (``--ckpt_path``) continues writing there."""
    t = config.trainer
    if t.enable_checkpointing is False or t.fast_dev_run:
        return
    folder = root / "checkpoints"
    if config.get("ckpt_path"):
        warnings.filterwarnings(  # the folder of the run being continued: not empty, by design
            "ignore", message=r"Checkpoint directory .* exists and is not empty", module=r"lightning\.pytorch"
        )
        return
    if any(folder.glob("*.ckpt")):
        raise UserError(
            f"{folder}: holds an earlier run's checkpoints, which this run would overwrite (with "
            "--trainer.logger=false there is no run folder: checkpoints go straight into the root); continue that "
            "run with --ckpt_path last, or pass another --trainer.default_root_dir"
        )


def resolve_last_or_best(which: str, config, load=load_checkpoint) -> str | None:
    """``--ckpt_path last``/``best`` from the parsed config, before anything is built (None: no such file yet)."""
    root = Path(config.trainer.default_root_dir or ".")
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    runs_root = root / "lightning_logs"
    for logger in loggers:
        if (folder := folder_logger_root(logger)) is not None:  # the default loggers' "." is default_root_dir
            runs_root = root / folder if logger.init_args.get("save_dir") in (".", None) else folder
            break
    found = newest_last_ckpt(runs_root, root)
    if found is not None and which == "best":
        found = best_checkpoint_of(found, load)
    return None if found is None else str(found)


def _plain(value):
    """A parsed value as plain data (jsonargparse Namespaces as dicts), to compare with a checkpoint's."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


def optimizer_overrides(given: dict, saved: dict | None, ckpt_path) -> dict:
    """The optimizer arguments given for a resumed ``fit`` (put over the restored param groups); a different
    optimizer class is an error, since its restored state would not fit."""
    given_class = given.get("class_path") if isinstance(given, dict) else None
    saved_class = (saved or {}).get("class_path", "torch.optim.SGD") if isinstance(saved, dict) else None
    if given_class and saved_class and given_class != saved_class:
        raise UserError(
            f"{ckpt_path} was trained with {saved_class}, but --model.optimizer={given_class} was given; fit resumes "
            "the optimizer's state, so drop the flag (its arguments, such as --model.optimizer.lr, can change)"
        )
    return dict((given or {}).get("init_args") or {})


def best_checkpoint_of(last: Path, load=load_checkpoint) -> Path | None:
    """The best checkpoint that the run which wrote ``last`` kept (its ModelCheckpoint's state says which)."""
    states = load(str(last)).get("callbacks", {})
    for key, state in states.items():
        best = state.get("best_model_path") if key.startswith("ModelCheckpoint") else None
        if best and Path(best).is_file():
            return Path(best)
        if best and (last.parent / Path(best).name).is_file():  # the run folder was moved
            return last.parent / Path(best).name
    return None


def check_strategy_name(strategy) -> None:
    """An unknown name, or a one-process strategy inside an MPI launch, fails here with every valid name listed."""
    if not isinstance(strategy, str) or strategy == "auto":
        return
    names = sorted(StrategyRegistry.available_strategies())
    if strategy not in names:
        close = difflib.get_close_matches(strategy, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UserError(f"--trainer.strategy={strategy!r} is not a strategy.{hint} Available: auto, {', '.join(names)}")
    if strategy in ("dp", "ddp_spawn") and mpi_world_size() > 1:
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


def check_devices(devices) -> None:
    try:
        count = int(devices)
    except (TypeError, ValueError):
        return  # "auto", a list or "0,1": Lightning checks those
    if count == 0 or count < -1:
        raise UserError(
            f"--trainer.devices={devices}: use a positive count, -1 or auto (all GPUs), or a list like [0,1]"
        )


def check_config_files(argv: list[str]) -> None:
    """A ``--config`` file that is not valid YAML: name the file and the line (jsonargparse names neither). The files
    read are kept for :class:`Parser`'s errors, which name the file of a mistyped key."""
    paths = [b for a, b in zip(argv, argv[1:], strict=False) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-c="))]
    Parser.config_files = {}
    for path in map(Path, paths):
        if path.is_file():
            try:
                Parser.config_files[path] = yaml.safe_load(path.read_text())
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
                problem = getattr(err, "problem", None) or str(err).splitlines()[0]
                raise UserError(f"{path}: not valid YAML ({where.strip()} {problem}); fix the file") from None


def has_key(data: object, dotted: str) -> bool:
    """Whether the YAML ``data`` holds ``dotted`` (``trainer.max_epoch``), at its top or under a subcommand's key."""
    if isinstance(data, dict) and any(has_key(data.get(sub), dotted) for sub in LightningCLI.subcommands()):
        return True
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def strategy_options_by_name(argv: list[str]) -> list[str]:
    """``--trainer.strategy=horovod --trainer.strategy.op=adasum`` works: jsonargparse takes a strategy's options
    only after its class path, so a registered name followed by options is replaced by its class path (and the
    registry's preset options for that name, which the user's own options then override)."""
    if not any(a.startswith("--trainer.strategy.") for a in argv):
        return argv
    from lightning.pytorch.strategies import StrategyRegistry

    out = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("--trainer.strategy="):
            at, name = i, arg.split("=", 1)[1]
        elif arg == "--trainer.strategy" and i + 1 < len(argv):
            at, name = i + 1, argv[i + 1]
        else:
            continue
        # the registry's .get() builds the strategy; the entry itself is what is wanted here
        entry = StrategyRegistry[name] if name in StrategyRegistry else None  # noqa: SIM401
        presets = entry["init_params"] if entry else {}
        if entry is None or not all(isinstance(v, str | int | float | bool) for v in presets.values()):
            continue
        cls = entry["strategy"]
        class_path = f"{cls.__module__}.{cls.__qualname__}"
        out[at] = f"--trainer.strategy={class_path}" if at == i else class_path
        out[at + 1 : at + 1] = [f"--trainer.strategy.{k}={_yaml_value(v)}" for k, v in presets.items()]
        return out
    return argv


def _yaml_value(value: str | int | float | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def says_errors() -> bool:
    """Whether this process prints a bad-input error: the first process of each node. Under ``mpirun`` or
    ``torchrun`` every rank checks the same command line and files and finds the same error; the others exit 2
    without printing it again (8 times on an 8-GPU node). A node-specific error still shows, once per node."""
    ranks = launcher_ranks()
    return (ranks[2] if ranks is not None else int(os.environ.get("LOCAL_RANK") or 0)) == 0


# Subcommands that are not Lightning's: they take their own flags (``python cli.py plot --help``).
TOOLS = {"plot": "app.plot", "export": "app.fashion_mnist.export"}


def named_classes(argv: list[str], group: str) -> list[str]:
    """The class paths (or names) that the command line or its ``--config`` files give the ``group`` (``--model=
    pkg.Class``, ``--model.class_path``, a YAML ``model: {class_path: ...}``); ``"?"`` for one inside inline YAML."""
    flag, found = f"--{group}", []
    for i, arg in enumerate(argv):
        if arg.startswith(f"{flag}.class_path="):
            found.append(arg.split("=", 1)[1])
        elif arg == f"{flag}.class_path" and i + 1 < len(argv):
            found.append(argv[i + 1])
        value = arg[len(flag) + 1 :] if arg.startswith(f"{flag}=") else None
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        if value is None:
            continue
        if Path(value).is_file():  # --model=file.yaml
            try:
                data = yaml.safe_load(Path(value).read_text())
            except yaml.YAMLError:
                continue  # jsonargparse names the file
            if isinstance(data, dict) and isinstance(data.get("class_path"), str):
                found.append(data["class_path"])
        elif re.fullmatch(r"[A-Za-z_][\w.]*", value):  # a class path or a class name
            found.append(value)
        elif "class_path" in value:  # inline YAML or JSON
            found.append("?")
    for data in Parser.config_files.values():
        for holder in [data] + [data.get(sub) for sub in LightningCLI.subcommands() if isinstance(data, dict)]:
            path = holder.get(group, {}).get("class_path") if isinstance(holder, dict) else None
            if isinstance(holder, dict) and isinstance(holder.get(group), dict) and isinstance(path, str):
                found.append(path)
    return found


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


def task_classes(argv: list[str], model: str | type, data: str | type) -> dict:
    """LightningCLI's class arguments: the default task's classes, fixed (flat ``--model.arch``, flat YAML), unless
    the command line names another class, which then works as in any LightningCLI (``--model=pkg.Class
    --model.hidden=64``; its own defaults, none of the default class's)."""
    kwargs = {}
    for group, default, base, key in (
        ("model", model, LightningModule, "model_class"),
        ("data", data, LightningDataModule, "datamodule_class"),
    ):
        named = names_class(argv, group)
        kwargs[key] = base if named else (_import(default) if isinstance(default, str) else default)
        kwargs[f"subclass_mode_{group}"] = named
    return kwargs


def main(
    args: list[str] | None = None, model: str | type = DEFAULT_MODEL, data: str | type = DEFAULT_DATA
) -> CLI | None:
    """``cli.py``: train, validate, test or predict ``model`` on ``data`` (class paths or classes), or any other
    LightningModule and LightningDataModule that the command line names by class path."""
    argv = sys.argv[1:] if args is None else list(args)
    try:
        check_config_files(argv)
        check_class_imports(argv)
        if argv and argv[0] in TOOLS:
            importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
            return None
        return CLI(
            **task_classes(argv, model, data),
            seed_everything_default=42,
            parser_class=Parser,
            parser_kwargs={"allow_abbrev": False},  # --trainer.max_epoch is a typo, not --trainer.max_epochs
            auto_configure_optimizers=False,  # one way to set the optimizer: --model.optimizer
            args=args,
        )
    except UserError as err:
        if says_errors():
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        where = f"{err.filename}: " if err.filename else ""
        hint = "free space, or pass a writable --trainer.default_root_dir"
        print(f"error: {where}{err.strerror}; {hint}", file=sys.stderr)
        sys.exit(2)
