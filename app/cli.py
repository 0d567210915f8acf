"""The command line: a thin LightningCLI with the template's defaults, and one-line errors for bad input."""

from __future__ import annotations

import difflib
import importlib
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

import app  # noqa: F401  (registers the dp and horovod strategies)
from app.callbacks import RankWatchdog
from app.checkpoint_io import SafeCheckpointIO
from app.data import FashionMNISTDataModule
from app.errors import UserError
from app.model import DEFAULT_SGD, ImageClassifier, check_compatible, load_checkpoint
from app.strategies.launch import mpi_world_size

DEFAULT_CALLBACKS = [
    {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
    {"class_path": "lightning.pytorch.callbacks.RichModelSummary", "init_args": {"max_depth": 2}},
    {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
    {
        "class_path": "app.callbacks.ModelCheckpoint",
        "init_args": {
            "monitor": "val/acc",
            "mode": "max",
            "save_last": True,
            "filename": "epoch={epoch}-val_acc={val/acc:.4f}",
            "auto_insert_metric_name": False,
        },
    },
    {"class_path": "app.callbacks.RunReport"},
    {"class_path": "app.callbacks.PredictionWriter"},
    {"class_path": "app.callbacks.Preemption"},
]


def default_loggers() -> list[dict]:
    """CSV always (metrics.csv); TensorBoard too when it is installed. Both write to lightning_logs/version_N."""
    loggers = [
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": ".", "name": "lightning_logs"}}
    ]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    tb = {"save_dir": ".", "name": "lightning_logs", "default_hp_metric": False}
    return loggers + [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": tb}]


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults(
            {
                "model.optimizer": {"class_path": "torch.optim.SGD", "init_args": dict(DEFAULT_SGD)},
                "trainer.max_epochs": 10,
                "trainer.callbacks": DEFAULT_CALLBACKS,
                "trainer.logger": default_loggers(),
            }
        )
        # On in every run: --watchdog.timeout=SECONDS (see app/callbacks/rank_watchdog.py).
        parser.add_lightning_class_args(RankWatchdog, "watchdog")
        parser.add_argument(
            "--allow_remote_ckpt",
            type=bool,
            default=False,
            help="Allow an http(s):// --ckpt_path (downloaded, then loaded with weights_only=True like any other).",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_strategy_name(config.trainer.strategy)
        # --trainer.enable_progress_bar=false / enable_model_summary=false also drop our default rich callbacks
        # (Lightning refuses a progress bar or summary callback when they are disabled).
        disabled = {
            "RichProgressBar": config.trainer.enable_progress_bar,
            "RichModelSummary": config.trainer.enable_model_summary,
        }
        callbacks = config.trainer.callbacks or []
        config.trainer.callbacks = [
            c for c in callbacks if disabled.get(str(getattr(c, "class_path", "")).rsplit(".", 1)[-1]) is not False
        ]

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        # Loggers pick "the next free version_N" each on its own, and whichever asks second sees the folder the
        # first one made. Give every logger that shares the first one's folder the first one's version.
        first, *others = trainer.loggers or [None]
        for logger in others:
            if getattr(logger, "root_dir", None) == getattr(first, "root_dir", None) and logger._version is None:
                logger._version = first.version
        # Atomic checkpoint writes and weights_only loads, whatever the strategy.
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer.strategy.checkpoint_io = SafeCheckpointIO(allow_remote=bool(config.get("allow_remote_ckpt")))
        return trainer

    # ``LightningCLI`` calls ``before_<subcommand>`` just before ``trainer.<subcommand>(ckpt_path=...)``.
    def before_fit(self) -> None:
        self._check_ckpt_path()

    before_validate = before_test = before_predict = before_fit

    def _check_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path last`` ourselves, and refuse a bad checkpoint before any work starts."""
        config = self.config_init[self.subcommand]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path == "last":
            found = find_last_checkpoint(self.trainer)
            if found is None:
                rank_zero_info(f"--ckpt_path last: no last.ckpt under {log_root(self.trainer)}/ yet; starting fresh")
            else:
                rank_zero_info(f"--ckpt_path last: resuming from {found}")
            ckpt_path = config["ckpt_path"] = None if found is None else str(found)
        if ckpt_path is None or ckpt_path in ("best", "hpc"):
            return
        allow_remote = bool(self.config[self.subcommand].get("allow_remote_ckpt"))
        checkpoint = load_checkpoint(ckpt_path, allow_remote=allow_remote)
        check_compatible(checkpoint, ckpt_path, dict(self.model.hparams))


def log_root(trainer) -> Path:
    """The folder that holds the runs' ``version_N`` folders (``lightning_logs`` by default)."""
    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is not None and getattr(logger, "root_dir", None):
        return Path(logger.root_dir)
    return Path(trainer.default_root_dir) / "lightning_logs"


def find_last_checkpoint(trainer) -> Path | None:
    """The newest ``last.ckpt`` of any earlier run (each run logs to its own ``version_N``), or None."""
    candidates = list(log_root(trainer).glob("version_*/checkpoints/last.ckpt"))
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):  # a ModelCheckpoint with an explicit folder
            candidates += list(Path(callback.dirpath).glob("last.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


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


# Subcommands that are not Lightning's: they take their own flags (``python cli.py plot --help``).
TOOLS = {"plot": "app.plot", "export": "app.export"}


def main(args: list[str] | None = None) -> CLI | None:
    argv = sys.argv[1:] if args is None else list(args)
    try:
        if argv and argv[0] in TOOLS:
            importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
            return None
        return CLI(
            ImageClassifier,
            FashionMNISTDataModule,
            seed_everything_default=42,
            args=args,
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
