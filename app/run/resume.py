"""Where ``--ckpt_path last`` and ``best`` point, what a resume keeps of the given settings (the optimizer's
arguments over its restored state), and when a resume has nothing left to train."""

from __future__ import annotations

import os
import re
import sys
import warnings
from functools import partial
from pathlib import Path

import yaml
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoints.io import check_compatible, load_checkpoint, saved_class
from app.checkpoints.run_folders import folder_logger_root
from app.checkpoints.storage import is_url, run_path
from app.errors import UserError
from app.launch.launcher import torchrun_job
from app.launch.slurm import requeueable_job
from app.lightning_internals import epochs_done
from app.run.arguments import strategy_options_by_name, timeout_in_seconds
from app.run.checks import init_parameters
from app.task import import_class, spec_of


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
        return run_path(logger.root_dir)
    return run_path(trainer.default_root_dir) / "lightning_logs"


def find_last_checkpoint(trainer) -> Path | None:
    """The newest ``last.ckpt`` of any earlier run (each run logs to its own ``version_N``), or None."""
    folders = [run_path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    return newest_last_ckpt(log_root(trainer), run_path(trainer.default_root_dir), folders)


def newest_last_ckpt(runs_root: Path, default_root: Path, folders: list[Path] = ()) -> Path | None:
    return next(iter(last_ckpts(runs_root, default_root, folders)), None)


def last_ckpts(runs_root: Path, default_root: Path, folders: list[Path] = ()) -> list[Path]:
    """Every earlier run's ``last.ckpt``, the newest first."""
    candidates = list(runs_root.glob("version_*/checkpoints/last.ckpt"))
    candidates += list((default_root / "checkpoints").glob("last.ckpt"))  # runs without a logger
    for folder in folders:  # ModelCheckpoints with an explicit folder
        candidates += list(folder.glob("last.ckpt"))
    return sorted(candidates, key=newness, reverse=True)


def newness(last: Path) -> tuple[float, int]:
    """A ``last.ckpt``'s time of writing, then its run's version number (storage that keeps no times, such as
    fsspec's ``memory://``, orders by version)."""
    version = re.fullmatch(r"version_(\d+)", last.parent.parent.name)
    return last.stat().st_mtime, int(version[1]) if version else -1


# Settings a run sets for itself, left out when its config.yaml is compared with a command: the checkpoint it
# resumed, the --config files the settings came from, its loggers (pointed at its own folder) and its process counts
# (a launcher's, which a resume may change).
RUNS_OWN_SETTINGS = ("ckpt_path", "config", "trainer.logger", "trainer.devices", "trainer.num_nodes")


def _flat(value, prefix: str = "") -> dict:
    if not isinstance(value, dict):
        return {prefix.rstrip("."): value}
    return {key: v for k, item in value.items() for key, v in _flat(item, f"{prefix}{k}.").items()}


def _same_value(key: str, a, b, folder: str | None = None) -> bool:
    """Whether a setting has the same value in two configs; ``folder`` (``TaskSpec.data_folder``): the data module's
    argument that names a folder, the same folder however it is spelled."""
    if folder and key.rsplit(".", 1)[-1] == folder and isinstance(a, str) and isinstance(b, str):
        a, b = (os.path.abspath(os.path.expanduser(v)) for v in (a, b))  # config.yaml names the folder absolutely
    return a == b


def settings_differ(run: dict, command: dict, folder: str | None = None) -> list[str]:
    """The settings (dotted names) in which a run's config.yaml and this command's differ, the run's own aside
    (``folder``: the data module's folder argument, compared as a folder)."""
    a, b = _flat(run), _flat(command)
    own = [k for k in {*a, *b} if any(k == p or k.startswith(f"{p}.") for p in RUNS_OWN_SETTINGS)]
    return sorted(k for k in {*a, *b} - set(own) if not _same_value(k, a.get(k), b.get(k), folder))


def run_settings(last: Path) -> dict | None:
    """The settings a ``version_N/checkpoints/last.ckpt`` was trained with (its run's config.yaml), or None."""
    try:
        return yaml.safe_load((last.parent.parent / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None


def last_of_this_command(candidates: list[Path], command: dict | None, folder: str | None = None) -> Path | None:
    """``--ckpt_path last``: the newest ``last.ckpt`` of a run started with this command's settings (the README's
    "same command as before, plus --ckpt_path last"), or of a later run that continued that one (resumed from its
    checkpoints, with a new lr, say), else the newest of all. A stopped run is then resumed even when runs with
    other settings (a trial with fewer batches, another preset) wrote a ``last.ckpt`` after it; the line says so.
    Where no run had these settings (a resume with a new lr or more epochs), the newest, as before."""
    newest = next(iter(candidates), None)
    if command is None or newest is None:
        return newest
    for last in candidates:
        settings = run_settings(last)
        if settings is not None and not settings_differ(settings, command, folder):
            last = latest_continuation(last, candidates)
            if last != newest:
                differ = settings_differ(run_settings(newest) or {}, command, folder)
                other = [f"--{name}" for name in differ] or ["settings"]
                shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
                rank_zero_info(
                    f"--ckpt_path last: {last}, the newest of a run with this command's settings (the newest of all, "
                    f"{newest}, is of a run with other {shown}; pass a checkpoint's path to resume another run)"
                )
            return last
    return newest


def latest_continuation(last: Path, candidates: list[Path]) -> Path:
    """The newest ``last.ckpt`` down the chain of runs that resumed from ``last``'s run (each run's config.yaml
    records the checkpoint it resumed from), or ``last`` itself."""
    while True:
        folder = last.parent.resolve()
        later = [
            c
            for c in candidates
            if newness(c) > newness(last)
            and isinstance(resumed := (run_settings(c) or {}).get("ckpt_path"), str)
            and run_path(resumed).resolve().parent == folder
        ]
        if not later:
            return last
        last = later[0]  # candidates are newest first


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


def resolve_last_or_best(
    which: str, config, load=None, command: dict | None = None, folder: str | None = None
) -> str | None:
    """``--ckpt_path last``/``best`` from the parsed config, before anything is built (None: no such file yet): of
    the newest run with this command's settings (``command``: what its config.yaml will say), else the newest run."""
    root = run_path(config.trainer.default_root_dir or ".")
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    runs_root = root / "lightning_logs"
    for logger in loggers:
        if (folder := folder_logger_root(logger)) is not None:  # the default loggers' "." is default_root_dir
            runs_root = root / folder if logger.init_args.get("save_dir") in (".", None) else folder
            break
    found = last_of_this_command(last_ckpts(runs_root, root), command, folder)
    if found is not None and which == "best":
        found = best_checkpoint_of(found, load)
    return None if found is None else str(found)


def plain(value):
    """A parsed value as plain data (jsonargparse Namespaces as dicts), to compare with a checkpoint's."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


def changed(given, saved) -> bool:
    """Whether a setting given for a resume differs from the checkpoint's. A class given with some of its arguments
    (``class_path`` and ``init_args``, as a --config file names a scheduler) differs only where it names another class
    or gives an argument another value: the checkpoint records every argument, defaults included."""
    if isinstance(given, dict) and isinstance(saved, dict) and "class_path" in given:
        given_args, saved_args = given.get("init_args") or {}, saved.get("init_args") or {}
        return given["class_path"] != saved.get("class_path") or any(
            k not in saved_args or saved_args[k] != v for k, v in given_args.items()
        )
    return given != saved


def optimizer_overrides(given: dict, saved: dict | None, ckpt_path) -> dict:
    """The optimizer arguments given for a resumed ``fit`` that differ from those the checkpoint was trained with:
    only these go over the restored param groups. An argument given again unchanged (the run's own ``--config``
    file, as users resume) keeps the restored value, which a schedule may have moved: a restored lr of 0.0989 in a
    cosine schedule is not reset to the file's 0.1. A different optimizer class is an error, since its restored
    state would not fit."""
    given_class = given.get("class_path") if isinstance(given, dict) else None
    saved_class = (saved or {}).get("class_path", "torch.optim.SGD") if isinstance(saved, dict) else None
    if given_class and saved_class and given_class != saved_class:
        raise UserError(
            f"{ckpt_path} was trained with {saved_class}, but --model.optimizer={given_class} was given; fit resumes "
            "the optimizer's state, so drop the flag (its arguments, such as --model.optimizer.lr, can change)"
        )
    given_args = dict((given or {}).get("init_args") or {})
    saved_args = ((saved or {}).get("init_args") or {}) if isinstance(saved, dict) else {}
    return {k: v for k, v in given_args.items() if k not in saved_args or saved_args[k] != v}


def best_checkpoint_of(last: Path, load=None) -> Path | None:
    """The best checkpoint that the run which wrote ``last`` kept (its ModelCheckpoint's state says which)."""
    states = (load or partial(load_checkpoint, shapes=True))(str(last)).get("callbacks", {})
    for key, state in states.items():
        best = state.get("best_model_path") if key.startswith("ModelCheckpoint") else None
        if best and run_path(best).exists():  # a file, or fsdp's sharded folder
            return run_path(best)
        if best and (last.parent / Path(best).name).exists():  # the run folder was moved
            return last.parent / Path(best).name
    return None


def check_writer(checkpoint: dict, ckpt_path, model_class: type, class_path: str) -> None:
    """A checkpoint written by another model class, or with hyperparameters this class does not take: one line
    naming the class (and data class) to pass."""
    saved = {k for k in checkpoint["hyper_parameters"] if not k.startswith("_")}
    writer = saved_class(checkpoint)
    known = init_parameters(model_class)
    unknown = sorted(saved - set(known)) if known is not None else []
    if (writer and writer != class_path) or unknown:
        wrote = f"written by {writer}" if writer else f"unknown hyperparameters {unknown}"
        fix = f"pass --model={writer}" if writer else "pass the --model class it was trained with"
        data_writer = checkpoint.get("datamodule_hyper_parameters", {}).get("_class_path")
        if writer and data_writer:
            fix += f" --data={data_writer}"
        raise UserError(f"{ckpt_path}: not a checkpoint of {class_path} ({wrote}); {fix}, or another --ckpt_path")


class CkptPathRule:
    """The ``--ckpt_path`` rule, as steps of :class:`app.run.cli.CLI` (a LightningCLI): the checkpoint's settings taken
    into the parsed config before the classes are built (:meth:`_parse_ckpt_path`, LightningCLI's own step), then
    ``last``/``best`` resolved and the weights checked against the built model before any work
    (:meth:`_check_ckpt_path`). The file is resolved once and read once."""

    _resolved: str | None
    _loaded: dict[str, dict]

    def _init_args(self, config, group: str):
        """The ``model`` or ``data`` arguments of a parsed config, whether the class was fixed or named."""
        value = config.get(group)
        subclass = self.subclass_mode_model if group == "model" else self.subclass_mode_data
        return value.get("init_args") if subclass and value is not None else value

    def _chosen_model_class(self, subcommand: str) -> type:
        if not self.subclass_mode_model:
            return self.model_class
        return import_class(self.config[subcommand].model.class_path)

    def _parse_ckpt_path(self) -> None:  # LightningCLI's private step (app/lightning_internals.py, item 5)
        """Lightning's own step, made safe, strict and explicit. One rule for every form of ``--ckpt_path``:

        - the network (the arguments the task's ``spec.network`` names) is the checkpoint's; giving one of them with
          another value (on the command line or in a ``--config`` file) is an error naming both values;
        - a training setting given explicitly (``--model.optimizer...``, a loss's weight, ...) wins over
          the checkpoint's, with a one-line notice naming it; one not given is the checkpoint's;
        - ``fit`` resumes the optimizer's state, with the optimizer arguments given explicitly (its lr, momentum,
          ...) that differ from the checkpoint's put over the restored ones (:class:`app.callbacks.ResumeSettings`,
          for any task); one given again unchanged keeps the restored value, which a schedule moved.

        The run's config.yaml records the values used. The file is loaded safely (``weights_only``; one-line errors
        for a missing, truncated, remote or unsafe file).
        """
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path in ("last", "best"):
            command = self._settings(subcommand)
            folder = spec_of(self._chosen_model_class(subcommand)).data_folder
            ckpt_path = self._resolved = resolve_last_or_best(
                ckpt_path, self.config[subcommand], self._load, command, folder
            )
        if not ckpt_path or ckpt_path == "hpc":
            return
        allow_remote = bool(self.config[subcommand].get("allow_remote_ckpt"))
        checkpoint = self._load(ckpt_path, allow_remote)
        saved = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
        model_class = self._chosen_model_class(subcommand)
        class_path = f"{model_class.__module__}.{model_class.__qualname__}"
        check_writer(checkpoint, ckpt_path, model_class, class_path)
        taken, notes = self._settings_taken(subcommand, ckpt_path, saved, spec_of(model_class).network)
        if notes:
            rank_zero_info(f"--ckpt_path {ckpt_path}: the checkpoint's network and settings, except {', '.join(notes)}")
        model = {"class_path": class_path, "init_args": taken} if self.subclass_mode_model else taken
        self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def _settings_taken(self, subcommand: str, ckpt_path, saved: dict, network) -> tuple[dict, list[str]]:
        """The checkpoint's model arguments this command takes (the network's always, a setting where none is given),
        and the notices naming the given settings that win over the checkpoint's."""
        explicit = self._explicit_model_settings(subcommand)
        given = self._init_args(self.config[subcommand], "model")
        for key in network:
            if key in saved and key in explicit and given.get(key) != saved[key]:
                raise UserError(
                    f"{ckpt_path} holds a network with --model.{key}={saved[key]}, but --model.{key}={given.get(key)} "
                    f"was given; drop the flag (the checkpoint's value is used) or pass another --ckpt_path"
                )
        taken = {k: v for k, v in saved.items() if k in network or k not in explicit}
        overrides: dict = {}
        if subcommand == "fit" and "optimizer" in explicit:
            overrides = optimizer_overrides(explicit["optimizer"], saved.get("optimizer"), ckpt_path)
            if isinstance(saved.get("optimizer"), dict):  # the restored optimizer, with the given arguments over it
                init_args = {**saved["optimizer"].get("init_args", {}), **overrides}
                taken["optimizer"] = {**saved["optimizer"], "init_args": init_args}
        notes = [
            f"--model.{k}={explicit[k]}"
            for k in sorted(explicit)
            if k not in (*network, "optimizer") and k in saved and changed(explicit[k], saved[k])
        ]
        notes += [f"--model.optimizer.{k}={v}" for k, v in overrides.items()]
        return taken, notes

    def _settings(self, subcommand: str) -> dict | None:
        """This command's settings as its run's config.yaml will hold them (the parser's own dump), or None where
        the parser cannot write them (then no run's config.yaml can match, and ``last`` is the newest, as before)."""
        try:
            return yaml.safe_load(self.parser.dump(self.config, skip_none=False))[subcommand]
        except Exception:  # whatever a setting's own serializer raises: choosing a run must not fail the command
            return None

    def _load(self, ckpt_path, allow_remote: bool = False) -> dict:
        key = str(ckpt_path) if is_url(ckpt_path) else str(Path(ckpt_path).resolve())
        if key not in self._loaded:
            self._loaded[key] = load_checkpoint(ckpt_path, allow_remote=allow_remote, shapes=True)
        return self._loaded[key]

    def _explicit_model_settings(self, subcommand: str) -> dict:
        """The ``--model`` settings this command gives itself (flags and --config files), without the defaults."""
        args = self._args if isinstance(self._args, list) else sys.argv[1:]
        # read as the command line was (a strategy's options after its short name: --trainer.strategy=horovod ...)
        args = strategy_options_by_name(timeout_in_seconds(args))
        given = self.parser.parse_args(args, defaults=False)[subcommand].get("model")
        if given is not None and self.subclass_mode_model:
            given = given.get("init_args")
        return {k: plain(v) for k, v in vars(given).items()} if given else {}

    def _check_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path last`` and ``best`` ourselves, and refuse weights that do not fit, before any work.

        The resolved path is what the run's config.yaml records, so ``cli.py plot`` can join a resumed run to
        the run its checkpoint came from.
        """
        config = self.config_init[self.subcommand]
        ckpt_path = given = config.get("ckpt_path")
        if given in ("last", "best"):
            found = self._last_or_best(given)
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
        self._say_resuming(ckpt_path, given, checkpoint.get("global_step", "?"))
        if not is_url(ckpt_path):
            ckpt_path = str(Path(ckpt_path).resolve())
        config["ckpt_path"] = self.config[self.subcommand]["ckpt_path"] = ckpt_path

    def _last_or_best(self, given: str) -> Path | None:
        """The file ``--ckpt_path last`` or ``best`` names: the one whose settings the parsed config took (one
        resolution), else one of a ModelCheckpoint's own folder, which only the trainer knows. None where fit starts
        fresh; an error where nothing can be done without one."""
        found = run_path(self._resolved) if self._resolved else find_last_checkpoint(self.trainer)
        if found is not None and given == "best" and not self._resolved:
            found = best_checkpoint_of(found, self._load)
        if found is None:
            if given == "best" or self.subcommand != "fit":
                what = "best checkpoint" if given == "best" else "last.ckpt"
                raise UserError(
                    f"--ckpt_path {given}: no {what} under {log_root(self.trainer)}/ yet; train first, or pass "
                    "a checkpoint file"
                )
            rank_zero_info(f"--ckpt_path last: no last.ckpt under {log_root(self.trainer)}/ yet; starting fresh")
        return found

    def _say_resuming(self, ckpt_path: str, given: str, step) -> None:
        """The one line saying what the run continues: a torchrun restart's, a SLURM requeue's, a fit's, or the file
        ``last``/``best`` named."""
        prefix = f"--ckpt_path {given}: " if given != ckpt_path else ""
        if ckpt_path == self._elastic_ckpt and (job := torchrun_job()) is not None and job.restarts_possible:
            what = f"restart {job.restart_count} of at most {job.max_restarts}" if job.restart_count else "re-formed"
            rank_zero_info(
                f"torchrun {what}: {job.world_size} process(es) on {job.nodes} node(s), resuming from {ckpt_path} "
                f"(step {step}) in the same run folder"
            )
        elif ckpt_path == self._elastic_ckpt and (slurm := requeueable_job()) is not None:
            rank_zero_info(
                f"SLURM job {slurm.job_id}, start {slurm.restart_count + 1} (requeued {slurm.restart_count} time(s)): "
                f"resuming from {ckpt_path} (step {step}) in the same run folder"
            )
        elif self.subcommand == "fit":
            where = (
                "its checkpoints go on in the same folder (no logger)"
                if not self.trainer.loggers
                else "this run logs to a new version folder, and cli.py plot of it draws the earlier run's curve too"
            )
            rank_zero_info(f"{prefix}resuming from {ckpt_path} (step {step}); {where}")
        elif prefix:
            rank_zero_info(f"{prefix}{ckpt_path}")
