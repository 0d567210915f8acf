"""The Lightning internals that app/lightning_internals.py uses still exist with the shape it uses.

If one of these fails after a Lightning upgrade, the named helper there needs a new way to do its job.
"""

from __future__ import annotations

import importlib
import inspect
import re

import lightning
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.strategies import Strategy

from app.lightning_internals import (
    PRIVATE_USES,
    RUN_TIME_PATCHES,
    ResultsLauncher,
    drop_layer_sync,
    resume_from,
    take_over_local_ranks,
)
from tests.conftest import ROOT
from tests.private_api import run_time_patches, scan, task_private_uses

# The machinery's list and the tasks' own (each task's package lists its private uses: app/fashion_mnist/__init__.py)
LISTED = {**PRIVATE_USES, **task_private_uses(ROOT)}


def parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_written_against_lightning_2():
    assert lightning.__version__.startswith("2."), (
        f"app/lightning_internals.py was written for 2.6, not {lightning.__version__}"
    )


def test_launcher_protocol():
    assert parameters(ResultsLauncher._collect_rank_zero_results) == ["trainer", "results"]
    assert parameters(ResultsLauncher._recover_results_in_main_process) == ["worker_output", "trainer"]
    assert "_configure_launcher" in vars(Strategy)
    assert "self._launcher" in inspect.getsource(Strategy.launcher.fget)


def test_the_launched_fit_takes_a_ckpt_path(tmp_path):
    """A restart of the horovod ranks replaces the ckpt_path argument of what Lightning launches for fit."""
    trainer = Trainer(default_root_dir=tmp_path, logger=False)
    assert "ckpt_path" in parameters(Trainer._fit_impl)
    assert "self._fit_impl" in inspect.getsource(Trainer.fit)
    args, kwargs = resume_from(trainer._fit_impl, ("model", None, None, "data", "given.ckpt"), {}, "last.ckpt")
    assert inspect.signature(trainer._fit_impl).bind(*args, **kwargs).arguments["ckpt_path"] == "last.ckpt"
    assert args[0] == "model" and "given.ckpt" not in (*args, *kwargs.values())


def test_logger_connector(tmp_path):
    connector = Trainer(default_root_dir=tmp_path, logger=False)._logger_connector
    assert parameters(connector.on_batch_end) == []
    assert parameters(connector.update_train_step_metrics) == []


def test_model_checkpoint_save_last():
    assert parameters(ModelCheckpoint._should_save_on_train_epoch_end) == ["trainer"]
    assert parameters(ModelCheckpoint._should_skip_saving_checkpoint) == ["trainer"]
    assert parameters(ModelCheckpoint._save_last_checkpoint) == ["trainer", "monitor_candidates"]
    assert parameters(ModelCheckpoint._monitor_candidates) == ["trainer"]


def test_layer_sync(tmp_path):
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, logger=False
    )
    assert isinstance(trainer.strategy._layer_sync, TorchSyncBatchNorm)
    drop_layer_sync(trainer.strategy)
    assert trainer.strategy._layer_sync is None


def test_child_process_observer_watches_the_launchers_own_list(tmp_path):
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    procs = []
    assert _ChildProcessObserver(main_pid=0, child_processes=procs)._child_processes is procs
    # the ddp launcher hands the observer its own list: emptying that list ends the watch
    assert "_launch_process_observer(self.procs)" in inspect.getsource(_SubprocessScriptLauncher.launch)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", logger=False)
    trainer.strategy.launcher.procs.extend(["rank 1"])
    assert take_over_local_ranks(trainer) == ["rank 1"] and trainer.strategy.launcher.procs == []


def test_cli_parse_ckpt_path_step():
    source = inspect.getsource(LightningCLI.__init__)
    order = [
        source.find(step) for step in ("self.parse_arguments(", "self._parse_ckpt_path()", "self.before_instantiate")
    ]
    assert -1 not in order and order == sorted(order), "LightningCLI no longer reads ckpt_path hparams in __init__"


PRIVATE = re.compile(
    r"from lightning[\w.]* import .*\b_[A-Za-z]|lightning[\w.]*\._[a-z]"
    r"|\b(trainer|strategy|callback|connector|launcher|pl_module)\._[a-z]"
    # undocumented state reached through public attributes: the loops' counters, the checkpoint's loop layout, the
    # launcher's process list, strategy methods replaced at run time
    r"|(?<!\\)\.(fit_loop|epoch_loop|batch_progress|val_check_batch|total_batch_idx)\b"
    r"|\[[\"'](loops|fit_loop)[\"']\]|\.procs\b|[\"']procs[\"']"
    r"|\bstrategy\.(barrier|save_checkpoint|broadcast|reduce|all_gather|teardown)\s*=[^=]"
)


@pytest.mark.parametrize(
    "line",
    [
        "loop = trainer.fit_loop.epoch_loop",
        "every = trainer.val_check_batch",
        'progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]',
        'children = getattr(trainer.strategy.launcher, "procs", [])',
        "strategy.barrier = lambda *args: None",
        "trainer.strategy._layer_sync = None",
    ],
)
def test_the_guard_catches_attribute_chains_and_layouts(line):
    assert PRIVATE.search(line), line


@pytest.mark.parametrize(
    "line", ["trainer.strategy.barrier()", "if trainer.global_step == step:", "strategy.checkpoint_io = io"]
)
def test_the_guard_lets_public_use_pass(line):
    assert not PRIVATE.search(line), line


def test_no_private_lightning_reach_elsewhere_in_app():
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        if path.name == "lightning_internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "private Lightning internals outside app/lightning_internals.py:\n" + "\n".join(found)


# ------------------------------------------------------------------ private names read from the syntax tree
def test_every_private_name_of_a_library_used_in_app_is_listed_with_its_reason():
    """tests/private_api.py finds every private name of torch, Lightning, torchvision or argparse that app/ and bench/
    use outside app/lightning_internals.py; each (file, name) must be in its PRIVATE_USES (or, in a task's own files,
    the task's), and each entry still used."""
    # bench/ measures the example task too: in a fork without it, the benches that import it are left (and their
    # entries with them) to the fork to point at its own task (docs/fork.md)
    gone = not (ROOT / "app" / "fashion_mnist").is_dir()
    measures_example = tuple(
        p.name for p in (ROOT / "bench").glob("*.py") if gone and "app.fashion_mnist" in p.read_text()
    )
    # bench/torchft/: scripts of a study of another library (torchft, not a dependency: they import it, and parse
    # their arguments at import), run where it is installed
    study = tuple(p.name for p in (ROOT / "bench" / "torchft").glob("*.py"))
    uses = scan(ROOT) + scan(ROOT, package="bench", skip=measures_example + study)
    unlisted = [f"{u.path}:{u.line}: {u.how}" for u in uses if (u.path, u.name) not in LISTED]
    assert not unlisted, "private names not listed in app/lightning_internals.py's PRIVATE_USES (or the task's):\n" + (
        "\n".join(unlisted)
    )
    skipped = {f"bench/{name}" for name in measures_example}
    stale = {entry for entry in LISTED if entry[0] not in skipped} - {(u.path, u.name) for u in uses}
    assert not stale, f"listed in PRIVATE_USES but no longer used: {sorted(stale)}"


def test_every_library_object_patched_at_run_time_is_listed_with_its_reason():
    """A public method or attribute of a library object replaced on the live object (``logger.log_metrics = ...``,
    ``trainer.accumulate_grad_batches = ...``) is listed in RUN_TIME_PATCHES, and each entry is still made."""
    uses = run_time_patches(ROOT) + run_time_patches(ROOT, package="bench", skip=())
    unlisted = [f"{u.path}:{u.line}: {u.how}" for u in uses if (u.path, u.name) not in RUN_TIME_PATCHES]
    assert not unlisted, "run-time patches not listed in app/lightning_internals.py's RUN_TIME_PATCHES:\n" + (
        "\n".join(unlisted)
    )
    stale = set(RUN_TIME_PATCHES) - {(u.path, u.name) for u in uses}
    assert not stale, f"listed in RUN_TIME_PATCHES but no longer made: {sorted(stale)}"


def _has(owner: str, name: str) -> bool:
    """Whether ``owner`` ("module" or "module:Class") has ``name``: an attribute, ``self.name`` set in the source of
    a class in its MRO, or a string key ``"name"`` in its source."""
    module_name, _, class_name = owner.partition(":")
    holder = importlib.import_module(module_name)
    if class_name:
        holder = getattr(holder, class_name)
    if hasattr(holder, name):
        return True
    sources = [inspect.getsource(c) for c in inspect.getmro(holder) if c is not object] if class_name else []
    sources.append(inspect.getsource(holder))
    return any(re.search(rf"\bself\.{name}\b|[\"']{name}[\"']", source) for source in sources)


@pytest.mark.parametrize("use", sorted(LISTED), ids="{0[0]}:{0[1]}".format)
def test_each_listed_private_name_is_where_the_list_says(use):
    """The contract: an upgrade that takes a listed name away fails here, by name, not deep in a run."""
    owner, reason = LISTED[use]
    assert reason.strip()
    assert _has(owner, use[1]), f"{owner} has no {use[1]} any more: {use[0]} needs another way ({reason})"


@pytest.mark.parametrize("use", sorted(RUN_TIME_PATCHES), ids="{0[0]}:{0[1]}".format)
def test_each_run_time_patch_replaces_what_the_list_says(use):
    owner, reason = RUN_TIME_PATCHES[use]
    assert reason.strip()
    assert _has(owner, use[1]), f"{owner} has no {use[1]} any more: {use[0]} patches nothing ({reason})"


def test_the_contract_check_fails_for_a_name_that_is_gone():
    assert not _has("torch.optim.lr_scheduler:LRScheduler", "_gone_lr")
    assert not _has("lightning.pytorch.cli", "_no_such_key")


PLANTED = """
import argparse
import os

import torch._dynamo as dynamo  # finds _dynamo
import torch.nn.modules as modules
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.nn.modules.batchnorm import _BatchNorm  # finds _BatchNorm


class Mine(Strategy):
    def _configure_launcher(self):  # finds _configure_launcher
        self._launcher = None  # finds _launcher
        self._mine = 1  # the module's own: not a library's


class Spawned(DDPStrategy):
    def _configure_launcher(self):  # finds _configure_launcher
        super()._configure_launcher()  # finds _configure_launcher


def read(trainer, parser: argparse.ArgumentParser, strategy, checkpoint, state):
    flags = parser._actions  # finds _actions
    connector = trainer._accelerator_connector  # finds _accelerator_connector
    layer = modules.batchnorm._BatchNorm  # finds _BatchNorm
    saved = checkpoint["hyper_parameters"].get("_class_path")  # finds _class_path
    lr = state["_last_lr"]  # finds _last_lr
    ours = {"_mine_too": 1}["_mine_too"]  # a key the module writes itself
    dynamo.reset()
    os._exit(getattr(strategy, "_start_method", None))  # finds _start_method
"""


def test_the_guard_finds_each_kind_of_planted_use(tmp_path, monkeypatch):
    """Imports, overrides, inherited attributes, super() calls, reads on other objects and getattr strings; not the
    module's own private names, nor os._exit (documented)."""
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = {(use.line, use.name) for use in scan(tmp_path, package="planted")}
    lines = PLANTED.splitlines()
    expected = {(i + 1, name) for i, line in enumerate(lines) for name in re.findall(r"# finds (\w+)", line)}
    assert len(expected) == 12 and found == expected


PLANTED_PATCHES = """
def patch(trainer, logger, callback, args, optimizer):
    trainer.accumulate_grad_batches = 4  # finds accumulate_grad_batches
    logger.log_metrics = print  # finds log_metrics
    callback.last_model_path = "x"  # finds last_model_path
    optimizer.step = None  # finds step
    args.accelerator = "cpu"  # parsed arguments: not a library object
    trainer.my_note = 1  # no library name


class Mine:
    def __init__(self):
        self.monitor = "loss"  # its own attribute, on self
"""


def test_the_patch_guard_finds_each_planted_patch(tmp_path):
    package = tmp_path / "planted"
    package.mkdir()
    (package / "mod.py").write_text(PLANTED_PATCHES)
    found = {(use.line, use.name) for use in run_time_patches(tmp_path, package="planted")}
    lines = PLANTED_PATCHES.splitlines()
    expected = {(i + 1, name) for i, line in enumerate(lines) for name in re.findall(r"# finds (\w+)", line)}
    assert len(expected) == 4 and found == expected


def test_every_method_that_overrides_a_librarys_says_so():
    """``@override`` on every method of app/ that replaces one of torch's, Lightning's or jsonargparse's, as Lightning
    marks its own: a reader sees which hooks a class takes over, and a renamed hook is found by type checkers."""
    import ast

    from tests.private_api import LIBRARIES

    missing = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        module = importlib.import_module(
            ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        )
        for node in ast.parse(path.read_text()).body:
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not isinstance(cls, type):
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.partition(".")[0] in LIBRARIES]
            missing += [f"{path.relative_to(ROOT)}: {cls.__name__}.{name}" for name in unmarked_overrides(cls, bases)]
    assert len(missing) == 0, "methods that override a library's without @override:\n" + "\n".join(missing)


def unmarked_overrides(cls: type, bases: list[type]) -> list[str]:
    """The methods, properties, static and class methods of ``cls`` that replace one of ``bases``' without
    ``@override``."""
    missing = []
    for name, value in vars(cls).items():
        function = value.fget if isinstance(value, property) else value
        function = getattr(function, "__func__", function)  # a staticmethod's or classmethod's function
        if name.startswith("__") or not inspect.isfunction(function) or not any(name in vars(b) for b in bases):
            continue
        if not getattr(function, "__override__", False) and not getattr(value, "__override__", False):
            missing.append(name)
    return missing


def test_the_override_guard_sees_static_and_class_methods_and_properties():
    from lightning.pytorch import Callback
    from torch.autograd import Function
    from typing_extensions import override

    class Planted(Function):
        @staticmethod
        def forward(ctx, x):  # unmarked
            return x

        @staticmethod
        @override
        def backward(ctx, dy):
            return dy

    class Hooks(Callback):
        @property
        def state_key(self):  # unmarked
            return "x"

        def on_fit_start(self, trainer, pl_module):  # unmarked
            pass

        @override
        def on_fit_end(self, trainer, pl_module):
            pass

    assert unmarked_overrides(Planted, [Function, *Function.__mro__[1:]]) == ["forward"]
    assert unmarked_overrides(Hooks, [Callback]) == ["state_key", "on_fit_start"]


def test_loop_counters_and_the_checkpoints_loop_layout(tmp_path):
    """What items 7 and 8 read and write, on a real fit and its checkpoint."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from app.lightning_internals import (
        batch_count,
        epochs_done,
        fit_loop_state,
        put_fit_loop_state,
        shift_batch_count,
        step_values_read,
    )

    seen = {}

    class Probe(BoringModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.setdefault("read", []).append(step_values_read(self.trainer, batch_idx))
            seen["count"] = batch_count(self.trainer)

    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=1,
        log_every_n_steps=50, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Probe())
    assert seen["read"] == [False, False, False, True] and seen["count"] == 4
    shift_batch_count(trainer, 2)
    assert batch_count(trainer) == 6
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    checkpoint = torch.load(tmp_path / "x.ckpt", weights_only=True)
    assert epochs_done(checkpoint) == 1 and epochs_done({}) == 0
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]  # what restart_validation edits
    assert set(progress) >= {"total", "current", "is_last_batch"}
    state = fit_loop_state(trainer)
    put_fit_loop_state(checkpoint, state)
    assert checkpoint["loops"]["fit_loop"] is state


def test_a_loader_built_before_the_restore_gets_its_saved_position(tmp_path):
    """Item 7's loader step, on a real fit: a module that reads ``estimated_stepping_batches`` in
    ``configure_optimizers`` (Lightning builds the loader then, before the restore) resumes from a mid-epoch
    checkpoint; Lightning leaves the saved state waiting, :func:`apply_loader_position` hands it over, and the
    resumed epoch's first batch is the one after the stop. The tests' fork (tests/test_fork_resume.py) checks the
    weights."""
    from lightning.pytorch import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    from app.lightning_internals import apply_loader_position
    from app.loader import make_loader

    data = RandomDataset(32, 16)
    first: list[int] = []

    class Early(BoringModel):
        def train_dataloader(self):
            return make_loader(self.trainer, data, train=True, batch_size=2)

        def configure_optimizers(self):
            assert self.trainer.estimated_stepping_batches == 16  # builds the training loader, before any restore
            return super().configure_optimizers()

    class Stop(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")  # where ModelCheckpoint saves every n steps
                trainer.should_stop = True

    class Resume(Callback):
        def on_train_start(self, trainer, pl_module):
            loader = trainer.train_dataloader
            first.append(apply_loader_position(trainer))
            first.append(loader.first_batch())

    settings = dict(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    Trainer(**settings, callbacks=[Stop()]).fit(Early())
    Trainer(**settings, callbacks=[Resume()]).fit(Early(), ckpt_path=tmp_path / "mid.ckpt")
    assert first == [True, 3]  # applied late; the epoch goes on at batch 3


def test_the_fsdp_name_list_the_accelerator_connector_checks():
    """Item 10: Lightning's own FSDP strategy keeps the names it registered in a class list, which the connector
    checks against a CPU accelerator; freed, the template's fsdp takes the name on a CPU."""
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.trainer.connectors import accelerator_connector

    from app.strategies import FSDPStrategy as TemplateFSDP

    assert isinstance(FSDPStrategy._registered_strategies, list)
    assert "get_registered_strategies" in inspect.getsource(accelerator_connector._AcceleratorConnector)
    assert "fsdp" not in FSDPStrategy.get_registered_strategies()  # app.strategies.register() freed it (conftest)
    assert isinstance(Trainer(strategy="fsdp", accelerator="cpu", devices=1, logger=False).strategy, TemplateFSDP)


def test_the_training_step_helpers_by_name_on_a_real_fit(tmp_path):
    """validation_follows, step_row, log_step_now and refresh_last_checkpoint, called where the template calls them
    (``on_train_batch_end``, a save point) on a real fit: a Lightning upgrade that renames what they read fails here,
    by name, not deep inside a run."""
    from lightning.pytorch import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel

    from app.lightning_internals import log_step_now, refresh_last_checkpoint, step_row, validation_follows

    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"])
            return out

    last = ModelCheckpoint(dirpath=tmp_path / "refreshed", save_last=True, save_top_k=0)
    seen = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            row = step_row(trainer)
            log_step_now(trainer)
            seen.append((trainer.current_epoch, batch_idx, validation_follows(trainer), row))

        def on_train_epoch_end(self, trainer, pl_module):
            refresh_last_checkpoint(last, trainer, at_train_epoch_end=last._should_save_on_train_epoch_end(trainer))

    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=2, limit_train_batches=3, limit_val_batches=1,
        log_every_n_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Probe(), last],
    )  # fmt: skip
    trainer.fit(Logged())
    assert [follows for *_, follows, _ in seen] == [False, False, True] * 2  # the epoch's last batch validates
    rows = [row for *_, row in seen]
    assert [row["step"] for row in rows] == list(range(6)) and all("train_loss" in row["values"] for row in rows)
    assert {row["epoch"] for row in rows} == {0, 1}
    assert (tmp_path / "refreshed" / "last.ckpt").is_file()


def test_the_checkpoint_layout_helpers_by_name(tmp_path):
    """fit_loop_of, restart_validation and resume_into_validation change a real checkpoint's loop state, which a new
    fit loop then loads; saving_alone captures a save instead of writing it and gives the strategy its methods back;
    spawned_ranks_launcher knows ddp_spawn's launcher; free_strategy_name edits FSDPStrategy's list."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import FSDPStrategy

    from app.lightning_internals import (
        fit_loop_of,
        free_strategy_name,
        restart_validation,
        resume_into_validation,
        saving_alone,
        spawned_ranks_launcher,
    )

    def trainer(**more):
        return Trainer(
            default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1,
            logger=False, enable_progress_bar=False, enable_model_summary=False, **more,
        )  # fmt: skip

    fitted = trainer()
    fitted.fit(BoringModel())
    fitted.save_checkpoint(tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=True)
    loop = fit_loop_of(checkpoint)
    assert loop is checkpoint["loops"]["fit_loop"]
    resume_into_validation(loop)
    progress = loop["epoch_loop.batch_progress"]
    assert progress["current"]["completed"] == progress["current"]["processed"]
    restart_validation(loop)
    assert loop["epoch_loop.val_loop.batch_progress"]["current"]["started"] == 0
    fresh = trainer()
    fresh.fit_loop.load_state_dict(loop)  # Lightning takes the changed state: every key is one it has

    with saving_alone(fitted.strategy) as captured:
        fitted.save_checkpoint(tmp_path / "b.ckpt")
    assert "state_dict" in captured["checkpoint"] and not (tmp_path / "b.ckpt").exists()
    assert "barrier" not in vars(fitted.strategy)

    assert spawned_ranks_launcher(trainer(strategy="ddp_spawn", devices=2).strategy) is not None
    assert spawned_ranks_launcher(trainer(strategy="ddp", devices=2).strategy) is None
    FSDPStrategy._registered_strategies.append("planted_fsdp")
    free_strategy_name("planted_fsdp")
    assert "planted_fsdp" not in FSDPStrategy._registered_strategies


def test_the_training_loops_stop_flag_broadcast(tmp_path):
    """take_over_stop_flag: the loop calls _broadcast_sigterm_tensor at every batch when several processes train, and
    Trainer.received_sigterm reads the signal connector's flag."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from app.lightning_internals import give_back_stop_flag, take_over_stop_flag

    assert parameters(_TrainingEpochLoop._broadcast_sigterm_tensor) == []
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = Trainer(default_root_dir=tmp_path, logger=False)
    trainer._signal_connector.received_sigterm = True
    assert trainer.received_sigterm and take_over_stop_flag(trainer) and not trainer.received_sigterm
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    give_back_stop_flag(trainer)
    loop = trainer.fit_loop.epoch_loop
    assert loop._broadcast_sigterm_tensor.__func__ is _TrainingEpochLoop._broadcast_sigterm_tensor


def test_inherited_per_step_hooks_are_not_called_and_defined_ones_are(tmp_path):
    """13. skip_inherited_hooks: Lightning passes a callback's hook that is not callable by (so a hook the callback
    only inherits costs nothing per step), and a real fit with RunReport calls every hook a callback defines, each
    batch, and none of the ones it inherits: the profiler, which wraps each call Lightning makes, sees only those."""
    from lightning.pytorch import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import PassThroughProfiler
    from lightning.pytorch.trainer import call

    from app.callbacks import RunReport
    from app.callbacks.run_report import PER_STEP_HOOKS

    assert "if callable(fn)" in inspect.getsource(call._call_callback_hooks)

    class Called(PassThroughProfiler):
        names: list = []

        def start(self, action_name: str) -> None:
            self.names.append(action_name)

    seen = []

    class Defines(Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            seen.append(trainer.global_step)

    class Inherits(Callback):
        pass

    defines, inherits = Defines(), Inherits()
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, limit_train_batches=3, limit_val_batches=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[defines, inherits, RunReport()], profiler=Called(),
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert seen == [0, 1, 2]  # a defined hook: every step
    assert all(getattr(inherits, hook) is None for hook in PER_STEP_HOOKS)
    assert callable(defines.on_before_zero_grad) and defines.on_train_batch_end is None
    called = [name for name in Called.names if name.startswith("[Callback]") and name.split(".")[-1] in PER_STEP_HOOKS]
    assert sum(name.endswith("Defines.on_before_zero_grad") for name in called) == 3  # (a qualified name)
    assert not [name for name in called if "Inherits." in name]
    assert "[Callback]RunReport.on_train_batch_end" in called  # RunReport's own per-step hooks
