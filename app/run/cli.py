"""The command line: a thin LightningCLI with the template's defaults, and one-line errors for bad input.

What it is made of, one concept a module: :mod:`app.run.arguments` (parsing and its one-line errors),
:mod:`app.run.checks` (settings and the task's classes, checked before anything runs), :mod:`app.run.defaults` (the
callbacks and loggers every run gets), :mod:`app.run.resume` (the ``--ckpt_path`` rule),
:mod:`app.checkpoints.run_folders` (one ``version_N`` per run) and :mod:`app.launch.restarts` (a torchrun restart goes
on in its run's folder). This module wires them into LightningCLI's steps and turns their errors into ``error: ...``
lines with exit code 2.
"""

from __future__ import annotations

import difflib
import errno
import importlib
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from app.callbacks import RankWatchdog
from app.callbacks.elastic import ElasticRunFolder
from app.callbacks.stop_plan import in_order, stop_plan
from app.checkpoints.io import SafeCheckpointIO
from app.checkpoints.run_folders import (
    check_writable,
    claim_versions,
    continue_run_folder,
    release_if_unused,
    release_made_folders,
)
from app.checkpoints.storage import run_path
from app.errors import TemplateWarning, UserError
from app.launch import startup
from app.launch.formation import announce_failure, before_stopping
from app.launch.host_address import check_reachable
from app.launch.launcher import (
    first_on_node,
    is_first_process,
    launcher_ranks,
    one_gpu_per_rank,
    pod_job,
    slurm_job,
    torchrun_job,
    wait_for_first_on_node,
)
from app.launch.library_noise import HeldRecords
from app.launch.pods import take_pod_numbers
from app.launch.restarts import later_start, take_launcher_numbers
from app.launch.signals import pass_sigterm_to_spawned_ranks, stopped_exit_code
from app.launch.slurm import requeueable_job, take_slurm_numbers
from app.run.arguments import (
    Parser,
    check_config_files,
    check_timeout,
    raised_by_a_class,
    strategy_class,
    strategy_options_by_name,
    timeout_in_seconds,
)
from app.run.checks import (
    check_class_imports,
    check_devices,
    check_strategy_name,
    check_trainer_numbers,
    cpu_oversubscription,
    init_parameters,
    task_classes,
    trainer_setting_error,
)
from app.run.defaults import DEFAULT_CALLBACK_NAMES, default_callbacks, default_loggers
from app.run.resume import (
    CkptPathRule,
    check_loggerless_root,
)
from app.run.trackers import continue_tracker_runs, name_tracker_runs, with_run_folder
from app.strategies import register as register_strategies
from app.strategies.horovod import HorovodStrategy
from app.task import spec_of

# Subcommands that are not Lightning's: name -> (module with a main(argv), what --help says of it). The machinery's
# own; cli.py adds its task's (the example's export) through main(tools=...).
TOOLS = {
    "plot": ("app.run.plot", "'cli.py plot lightning_logs/version_N' draws a run's curves to a PNG"),
    "consolidate": ("app.checkpoints.sharded", "'cli.py consolidate CKPT' makes one file of fsdp's sharded checkpoint"),
}


def tools_epilog(tools: dict[str, tuple[str, str]]) -> str:
    return f"Besides Lightning's subcommands: {'; '.join(usage for _, usage in tools.values())}; each takes --help."


class CLI(CkptPathRule, LightningCLI):
    def __init__(self, *args, tools: dict[str, tuple[str, str]] | None = None, **kwargs) -> None:
        self._tools = tools or TOOLS
        self._claimed: list[Path] = []
        self._seed_line: HeldRecords | None = None
        self._args = kwargs.get("args")
        self._loaded: dict[str, dict] = {}  # checkpoints read by the CLI's checks, each read once
        self._resolved: str | None = None  # the file --ckpt_path last/best named when the config was parsed
        self._elastic_ckpt: str | None = None  # the last.ckpt a torchrun restart resumes from
        self._elastic_run: ElasticRunFolder | None = None
        argv = sys.argv[1:] if self._args is None else self._args
        self._requested = argv[0] if isinstance(argv, list) and argv else None
        UserError.latest = None
        try:
            super().__init__(*args, **kwargs)
        except BaseException as err:
            if getattr(getattr(self, "trainer", None), "global_step", 0) == 0:
                self._release_unused()
            if self._seed_line is not None:
                self._seed_line.drop()
            error = self._error_to_show(err)
            if error is not None:
                raise error from None
            raise

    def _error_to_show(self, err: BaseException) -> BaseException | None:
        """What a failed command shows instead of ``err``, or None for ``err`` itself."""
        latest = UserError.latest
        # a class (strategy, callback, model) refused a value while jsonargparse built it: jsonargparse reports the
        # message inside a union error of its own; say only ours
        wrapped = isinstance(err, ValueError) and latest is not None and latest is not err
        if wrapped and " ".join(str(latest).split()) in " ".join(str(err).split()):
            return latest
        if (own := raised_by_a_class(err)) is not None and not isinstance(own, UserError):
            return own  # the task's own error and frames, not the parser's wrapping
        if isinstance(err, MisconfigurationException | ValueError) and not isinstance(err, UserError):
            # Lightning checks some settings only when the run starts (val_check_interval against the batches)
            config = self.config[self.subcommand] if getattr(self, "subcommand", None) else {}
            return trainer_setting_error(err, config.get("trainer", {}))
        return None

    @override
    def subcommands(self) -> dict[str, set[str]]:
        """Lightning's subcommands, only the one asked for when the command line starts with it (``cli.py fit``):
        each subcommand's parser takes about 0.2 s to build, and only one of them runs."""
        every = LightningCLI.subcommands()
        return {self._requested: every[self._requested]} if self._requested in every else every

    @override
    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.epilog = tools_epilog(self._tools)  # the tools are ours, dispatched in main()

    @override
    def parse_arguments(self, parser, args) -> None:
        """Lightning's, with a strategy's options accepted after its short name (:func:`strategy_options_by_name`),
        and the trainer's settings checked before anything runs (Lightning seeds and prints "Seed set to" next)."""
        argv = sys.argv[1:] if args is None else args
        if not isinstance(argv, list):
            super().parse_arguments(parser, args)
        else:
            self.config = parser.parse_args(strategy_options_by_name(timeout_in_seconds(argv)))
        subcommand = self.config.get("subcommand")
        trainer = (self.config[subcommand] if subcommand else self.config).trainer
        check_strategy_name(trainer.strategy)
        check_timeout(trainer.strategy)
        check_devices(trainer.devices)
        check_trainer_numbers(trainer)
        if subcommand:
            check_reachable(trainer.num_nodes or 1, str(trainer.accelerator))
        self._seed_line = HeldRecords("lightning.fabric.utilities.seed")  # printed once the classes are built

    @override
    def after_instantiate_classes(self) -> None:
        if self._seed_line is not None:
            self._seed_line.release()
        data = self._init_args(self._subconfig(self.config), "data")
        folder = spec_of(self.model).data_folder  # the data module's folder argument, as the task names it
        if data is not None and folder and isinstance(data.get(folder), str):
            # config.yaml (written at setup) names the files this run read, whichever folder it runs again from;
            # the data module and its messages keep the folder as given
            setattr(data, folder, os.path.abspath(os.path.expanduser(data.get(folder))))

    @override
    def add_arguments_to_parser(self, parser) -> None:
        defaults = {"trainer.max_epochs": 10, "trainer.logger": default_loggers()}
        # A model that takes --model.optimizer may name its default (TaskSpec.default_optimizer), shown in --help and
        # recorded in config.yaml. Only for a class fixed in advance: under --model=pkg.Class a default set here
        # would carry over into another class's arguments.
        optimizer = spec_of(self.model_class).default_optimizer
        if not self.subclass_mode_model and optimizer and "optimizer" in init_parameters(self.model_class):
            defaults["model.optimizer"] = dict(optimizer)
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

    @override
    def before_instantiate_classes(self) -> None:
        config = self._subconfig(self.config)
        loggers = self._loggers_under_root(config)
        if is_first_process():
            self._check_root(config)
        job = torchrun_job()
        # A job whose later starts continue its run: torchrun's restarts, or SLURM's requeues of a batch job
        restarting = job if job is not None and job.restarts_possible else requeueable_job()
        continued = self._continue_run(config, loggers, restarting)
        self._take_job_numbers(config, job, continuing=bool(continued))
        self._claim_run_folder(config, loggers, continued)
        if restarting is not None and self.subcommand == "fit":
            self._elastic_run = ElasticRunFolder(restarting, self._claimed, continued, self._elastic_ckpt)

    def _loggers_under_root(self, config) -> list:
        """The loggers, the default ones under --trainer.default_root_dir, as Lightning's own default logger; a logger
        given with another save_dir keeps it."""
        root = config.trainer.default_root_dir
        loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
        if with_run_folder(loggers, default_loggers()[0]):
            config.trainer.logger = loggers  # a tracker alone (MLflow, W&B) gets the run folder's CSV logger first
        defaults = {d["class_path"] for d in default_loggers()}
        for logger in loggers:
            init_args = getattr(logger, "init_args", None)
            if root and getattr(logger, "class_path", None) in defaults and init_args.get("save_dir") == ".":
                init_args.save_dir = str(root)
        return loggers

    def _check_root(self, config) -> None:
        root = config.trainer.default_root_dir
        check_writable(root or Path.cwd())
        if self.subcommand == "fit" and config.trainer.logger in (False, []):
            check_loggerless_root(run_path(root or "."), config)

    def _continue_run(self, config, loggers: list, restarting) -> dict[Path, int]:
        """A later start of a job that continues its run: the run folders it continues (empty for a first start), the
        checkpoint it resumes from, and the name its config is recorded under."""
        if restarting is None or self.subcommand != "fit" or not later_start(restarting):
            return {}
        continued, ckpt, config_name = continue_run_folder(loggers, restarting)
        if config_name:  # config.yaml stays the first start's; each restart records what it ran with beside it
            self.save_config_kwargs = {**self.save_config_kwargs, "config_filename": config_name, "overwrite": True}
        if ckpt:
            self._elastic_ckpt = config.ckpt_path = ckpt
        return continued

    def _take_job_numbers(self, config, job, continuing: bool) -> None:
        """The devices and nodes of the launcher, SLURM allocation or pod that started this process. A config file's
        devices (written for a run of one process) yields to them; only --trainer.devices on the command line is
        checked against them."""
        argv = sys.argv[1:] if self._args is None else list(self._args)
        devices_given = any(a == "--trainer.devices" or a.startswith("--trainer.devices=") for a in argv)
        if job is not None:
            take_launcher_numbers(config.trainer, job, devices_given, continuing=continuing)
        elif (slurm := slurm_job()) is not None and launcher_ranks() is None:  # (mpirun in an allocation: its own)
            take_slurm_numbers(config.trainer, slurm, devices_given)
        elif (pod := pod_job()) is not None:  # a PyTorchJob's pod: no launcher
            take_pod_numbers(config.trainer, pod, devices_given)
        mpi = launcher_ranks()
        if mpi is not None and _rank_has_own_gpu(config.trainer, mpi[3], devices_given):
            config.trainer.devices = 1  # the one GPU this rank sees
        elif mpi is not None and not devices_given:
            config.trainer.devices = mpi[3]

    def _claim_run_folder(self, config, loggers: list, continued: dict[Path, int]) -> None:
        """version_N made now, so that no other run can take it; the trackers' runs named after it, or continued
        where the checkpoint's run logged."""
        if not config.trainer.get("fast_dev_run"):  # (fast_dev_run logs nothing: Lightning swaps the loggers out)
            self._claimed = claim_versions(loggers, continued)
            before_stopping(self._release_unused)  # a peer failed before the group formed: nothing left behind
        ckpt = self._resolved or config.get("ckpt_path")
        if ckpt and ckpt not in ("last", "best", "hpc"):
            continue_tracker_runs(loggers, self._load(ckpt, bool(config.get("allow_remote_ckpt"))), ckpt)
        name_tracker_runs(loggers, next(iter(self._claimed), None))  # a new tracker run: after its run folder

    def _release_unused(self) -> None:
        release_if_unused(self._claimed)  # a run that failed before doing anything leaves no folder
        release_made_folders()  # nor the --trainer.default_root_dir it made

    @override
    def instantiate_trainer(self, **kwargs):
        config = self._subconfig(self.config_init)
        if config.trainer.get("logger") in (False, []):
            self.save_config_callback = None  # no run folder for config.yaml: it would go into the root itself
        own = list(config.trainer.get("callbacks") or [])
        drop = config.get("drop_callbacks") or []
        kwargs["callbacks"] = in_order(default_callbacks(config.trainer, own, drop, spec_of(self.model)), own)
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
        if (oversubscribed := cpu_oversubscription(trainer)) is not None:
            rank_zero_warn(oversubscribed, category=TemplateWarning)
        # Atomic checkpoint writes and weights_only loads, whatever the strategy.
        trainer.strategy.checkpoint_io = SafeCheckpointIO(allow_remote=bool(config.get("allow_remote_ckpt")))
        # a rank lost before the first step leaves no empty run folder (the rank watchdog runs it before it ends)
        stop_plan(trainer).before_exit.append(lambda: trainer.global_step == 0 and release_if_unused(self._claimed))
        return trainer

    # ``LightningCLI`` calls ``before_<subcommand>`` just before ``trainer.<subcommand>(ckpt_path=...)``.
    def before_fit(self) -> None:
        self._check_ckpt_path()
        pass_sigterm_to_spawned_ranks(self.trainer)  # ddp_spawn: the process a stop signal reaches is no rank

    before_validate = before_test = before_predict = before_fit


def _rank_has_own_gpu(trainer_config, per_node: int, devices_given: bool) -> bool:
    """Under mpirun with a GPU bound to each rank (:func:`app.launch.launcher.one_gpu_per_rank`), the horovod strategy
    trains each rank on the one GPU it sees: ``--trainer.devices`` (the processes per node, or not given) becomes 1
    in this process, since Lightning checks it against the GPUs visible here."""
    cls = strategy_class(trainer_config.strategy)
    return (
        cls is not None
        and issubclass(cls, HorovodStrategy)
        and str(trainer_config.accelerator) in ("auto", "gpu", "cuda")
        and (not devices_given or str(trainer_config.devices) == str(per_node))
        and one_gpu_per_rank()
    )


def check_subcommand(argv: list[str], names: list[str]) -> None:
    """A first word that names no subcommand is one line naming them all, the tools among them (argparse's own
    message lists Lightning's only)."""
    if argv and not argv[0].startswith("-") and argv[0] not in names:
        close = difflib.get_close_matches(argv[0], names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"unknown subcommand {argv[0]!r}{hint}: choose from {', '.join(names)}; see cli.py --help")


QUIET_RANK_WAIT = 15.0  # at most this long a worker that does not print a bad-input error waits for one that does


def main(
    args: list[str] | None = None,
    model: str | type | None = None,
    data: str | type | None = None,
    tools: dict[str, tuple[str, str]] | None = None,
) -> CLI | None:
    """``cli.py``: train, validate, test or predict ``model`` on ``data`` (class paths or classes: the task a run
    trains when the command line names no class; None: the command line must name one), or any other LightningModule
    and LightningDataModule that the command line names by class path. ``tools``: more subcommands of the task's
    own, ``{name: (module with a main(argv), what --help says of it)}``, beside the machinery's :data:`TOOLS`."""
    startup.install()  # importing app set up nothing: the program does
    register_strategies()
    argv = sys.argv[1:] if args is None else list(args)
    tools = {**TOOLS, **(tools or {})}
    try:
        check_config_files(argv)
        check_class_imports(argv)
        if argv and argv[0] in tools:
            tool = importlib.import_module(tools[argv[0]][0])
            # the machinery's own tools (plot) are told the default task, whose spec they read; a task's take argv
            tool.main(argv[1:], **({"model": model} if TOOLS.get(argv[0]) == tools[argv[0]] else {}))
            return None
        check_subcommand(argv, [*LightningCLI.subcommands(), *tools])
        return CLI(
            **task_classes(argv, model, data),
            tools=tools,
            seed_everything_default=42,
            parser_class=Parser,
            parser_kwargs={"allow_abbrev": False},  # --trainer.max_epoch is a typo, not --trainer.max_epochs
            auto_configure_optimizers=False,  # one way to set the optimizer: --model.optimizer
            args=args,
        )
    except UserError as err:
        fail(str(err))
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        where = f"{err.filename}: " if err.filename else ""
        fail(f"{where}{err.strerror}", hint="; free space, or pass a writable --trainer.default_root_dir", own=True)
    except Exception as err:
        if (code := stopped_exit_code(err)) is not None:  # ddp_spawn's ranks stopped on a SIGTERM and saved
            sys.exit(code)
        raise


def fail(why: str, hint: str = "", own: bool = False) -> NoReturn:
    """Bad input: one ``error:`` line (from the node's first process; ``own``: from this one, a failure of its own such
    as a full disk), the mark that stops the other nodes' ranks too (app/launch/formation.py), and exit 2."""
    if own or first_on_node():
        print(f"error: {why}{hint}", file=sys.stderr, flush=True)
    announce_failure(why)
    if not (own or first_on_node()) and (torchrun_job() is not None or launcher_ranks() is not None):
        # torchrun and mpirun end every worker once one fails: the first of the node (which says why) could be ended
        # before it printed its line, when this one, quiet, failed first (seen under load: no line at all). Waiting
        # here for it to exit lets it fail first; the launcher then ends this one.
        wait_for_first_on_node(QUIET_RANK_WAIT)
    sys.exit(2)
