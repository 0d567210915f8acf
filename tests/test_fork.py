"""Forking the template: a task of one's own under the unchanged machinery (docs/fork.md).

The machinery (app/ less the example task's modules) never imports the example task; the task tells it what it
needs through ``spec`` (app/task.py). A user's package outside the repo, and the second example task
(examples/sequence.py: dict batches, a GRU, no accuracy), train through ``cli.py`` by class path under every
strategy, stop and resume exactly, predict, and keep their run folders.
"""

import ast
import compileall
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from app.callbacks.prediction_writer import batch_labels, prediction_columns
from app.checkpoints.run_folders import release_if_unused
from app.run.arguments import Parser
from app.run.checks import names_class
from app.run.defaults import checkpoint_options
from app.task import TaskSpec, count_samples, spec_of
from tests import warm
from tests.conftest import ROOT, TINY_TASK
from tests.test_as_users_run_it import noise, run

# The example task: what a fork replaces. Everything else in app/ is machinery and must not import it.
EXAMPLE_TASK = ROOT / "app" / "fashion_mnist"
SEQUENCE = ("--model=examples.sequence.SequenceRegressor", "--data=examples.sequence.SequenceData")


# ------------------------------------------------------------------------------------------ the seam, unit by unit
def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, in functions too, relative imports resolved (``from .fashion_mnist import x``
    in app/run/cli.py is ``app.fashion_mnist``), and each imported name as ``module.name``."""
    package = list(path.relative_to(root).with_suffix("").parts)
    if package[-1] != "__init__":
        package = package[:-1]
    else:
        package.pop()
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module:
                names.add(module)
            names |= {f"{module}.{alias.name}".lstrip(".") for alias in node.names}
    return names


def test_the_import_reader_sees_lazy_and_relative_imports_of_the_example(tmp_path):
    """Planted: what the seam tests must catch in a machinery module, each form of import of the example."""
    planted = tmp_path / "app" / "cli.py"
    planted.parent.mkdir()
    planted.write_text(
        "import os\n"
        "def build():\n"
        "    from .fashion_mnist.model import ImageClassifier\n"
        "    from . import fashion_mnist\n"
        "    import app.fashion_mnist.data\n"
        "    from .callbacks import warmup\n"
    )
    found = _imports(planted, root=tmp_path)
    assert {"app.fashion_mnist.model", "app.fashion_mnist", "app.fashion_mnist.data", "app.callbacks"} <= found
    assert "app.fashion_mnist.model.ImageClassifier" in found and "os" in found
    inside = tmp_path / "app" / "callbacks" / "__init__.py"
    inside.parent.mkdir()
    inside.write_text("from ..fashion_mnist import networks\n")
    assert "app.fashion_mnist" in _imports(inside, root=tmp_path)


@pytest.mark.slow
def test_the_machinery_never_imports_the_example_task():
    """Statically (every import statement, in functions too) and at run time (what importing it loads)."""
    machinery = [p for p in (ROOT / "app").rglob("*.py") if EXAMPLE_TASK not in p.parents]
    assert len(machinery) > 30
    for path in machinery:
        wrong = sorted(name for name in _imports(path) if name.startswith("app.fashion_mnist"))
        assert not wrong, f"{path.relative_to(ROOT)} imports the example task: {wrong}"
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in machinery)
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "'app.fashion_mnist" not in loaded and "'app.run.cli'" in loaded, loaded[-2000:]


# ---------------------------------------------------------------------- the example's names in the machinery's text
def example_names() -> dict[str, list[str]]:
    """What of the example task must not appear in the machinery's text, by kind, taken from the example itself: its
    metric (spec.monitor, and as a checkpoint's file name writes it), its own flags (its classes' ``__init__``
    arguments; not LightningCLI's optimizer and scheduler, nor the loader's batch size and workers, which any task
    has), its class names and the words that name its data."""
    import inspect

    from app.fashion_mnist.data import FashionMNISTDataModule
    from app.fashion_mnist.model import ImageClassifier

    monitor = ImageClassifier.spec.monitor
    anyones = {"self", "optimizer", "lr_scheduler", "batch_size", "num_workers"}
    flags = [
        f"--{group}.{name}"
        for group, cls in (("model", ImageClassifier), ("data", FashionMNISTDataModule))
        for name in inspect.signature(cls.__init__).parameters
        if name not in anyones
    ]
    return {
        "metric": [monitor, re.sub(r"[^\w.-]", "_", monitor)],
        "flag": flags,
        "word": [
            ImageClassifier.__name__,
            FashionMNISTDataModule.__name__,
            "Fashion-MNIST",
            ImageClassifier.spec.data_source,
        ],
    }


def seam_leaks(root: Path, names: dict[str, list[str]]) -> list[tuple[str, str]]:
    """``(kind, where)`` for every place the machinery under ``root/app`` names the example task: an import or a dotted
    name of its package, a slash path into its folders, its metric, flags or words (``names``: :func:`example_names`),
    or an entry of the machinery's private-use list for one of its files."""
    from tests.private_api import listed_private_uses

    task = root / "app" / "fashion_mnist"
    found = []
    patterns = {
        kind: re.compile("|".join(rf"(?<![\w/.-]){re.escape(n)}(?![\w-])" for n in words))
        for kind, words in names.items()
    }
    for path in sorted(p for p in (root / "app").rglob("*.py") if task not in p.parents):
        where, text = path.relative_to(root).as_posix(), path.read_text()
        dotted = [name for name in _imports(path, root) if name.startswith("app.fashion_mnist")]
        if dotted or "app.fashion_mnist" in text:
            found.append(("dotted", f"{where}: {dotted or 'app.fashion_mnist'}"))
        if "app/fashion_mnist" in text or "tests/fashion_mnist" in text:
            found.append(("slash", where))
        for kind, pattern in patterns.items():
            if match := pattern.search(text):
                found.append((kind, f"{where}: {match.group()}"))
    listed = listed_private_uses(root / "app" / "lightning_internals.py")
    found += [
        ("private use", f"app/lightning_internals.py: {entry}") for entry in listed if "fashion_mnist" in entry[0]
    ]
    return found


# In a fork (the example deleted, as in the test below that makes one) there is nothing of it left to leak.
needs_the_example = pytest.mark.skipif(not EXAMPLE_TASK.is_dir(), reason="app/fashion_mnist/ is gone: a fork")


@needs_the_example
def test_the_machinery_text_names_nothing_of_the_example():
    """No import, dotted name or slash path of the example, none of its metric, flags or words, in any machinery
    file (code, messages, docstrings, comments): a fork renames them all, and the machinery's text must stay true."""
    leaks = seam_leaks(ROOT, example_names())
    assert not leaks, "the machinery names the example task:\n" + "\n".join(f"{k}: {w}" for k, w in leaks)


PLANTED_LEAKS = {
    "dotted": "from app.fashion_mnist.networks import build_resnet\n",
    "slash": "# see app/fashion_mnist/networks.py\n",
    "metric": 'MONITOR = "val/acc"\n',
    "flag": 'HINT = "pass --model.arch=resnet_tiny"\n',
    "word": '"""Plots Fashion-MNIST."""\n',
    "private use": None,  # an entry of app/lightning_internals.py's list
}


@needs_the_example
@pytest.mark.parametrize("kind", sorted(PLANTED_LEAKS))
def test_each_kind_of_leak_planted_in_a_copy_is_caught(tmp_path, kind):
    shutil.copytree(ROOT / "app", tmp_path / "app", ignore=shutil.ignore_patterns("fashion_mnist", "__pycache__"))
    names = example_names()
    assert seam_leaks(tmp_path, names) == []
    if kind == "private use":
        internals = tmp_path / "app" / "lightning_internals.py"
        text = internals.read_text()
        entry = (
            '    ("app/fashion_mnist/networks.py", "_make_layer"): ("torchvision.models.resnet:ResNet", "a stage"),\n'
        )
        internals.write_text(
            text.replace(
                "PRIVATE_USES: dict[tuple[str, str], tuple[str, str]] = {\n",
                "PRIVATE_USES: dict[tuple[str, str], tuple[str, str]] = {\n" + entry,
                1,
            )
        )
    else:
        target = tmp_path / "app" / "run" / "plot.py"
        target.write_text(target.read_text() + PLANTED_LEAKS[kind])
    assert kind in {k for k, _ in seam_leaks(tmp_path, names)}


# What a task may import from the template: the contract (app.task), the loader, the errors, the safe checkpoint
# reader, whole-file writes and paths on any storage (docs/fork.md)
TASK_API = (
    "app.task",
    "app.loader",
    "app.errors",
    "app.checkpoints.io",
    "app.checkpoints.atomic",
    "app.checkpoints.storage",
)


def test_the_machinery_names_no_task_and_no_network():
    """No machinery file names the example by a string (a class path, a module to import) or imports torchvision
    (whose ResNet a strategy would then know): cli.py passes the task and its tools in, the network lists its own
    pipeline layers."""
    machinery = [p for p in (ROOT / "app").rglob("*.py") if EXAMPLE_TASK not in p.parents]
    for path in machinery:
        strings = [
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
        named = [text for text in strings if "app.fashion_mnist" in text or "ImageClassifier" in text]
        assert not named, f"{path.relative_to(ROOT)} names the example task: {named}"
        network = sorted(name for name in _imports(path) if name.split(".")[0] == "torchvision")
        assert not network, f"{path.relative_to(ROOT)} imports {network}"


def test_a_task_imports_only_the_task_api_of_the_machinery():
    """The example task and examples/ use the template as a fork's task does (:data:`TASK_API`), never internals
    (app.lightning_internals) or a strategy's class."""
    for path in [*EXAMPLE_TASK.rglob("*.py"), *(ROOT / "examples").rglob("*.py")]:
        used = {name for name in _imports(path) if name.split(".")[0] == "app" and "fashion_mnist" not in name}
        modules = {name for name in used if name in TASK_API or name.rpartition(".")[0] in TASK_API}
        assert used == modules, f"{path.relative_to(ROOT)} imports {sorted(used - modules)} of the machinery"


def test_the_machinery_tests_never_use_the_example_task():
    """tests/*.py train the tests' own task (tests/tiny.py): a fork that replaces app/fashion_mnist and
    tests/fashion_mnist keeps them. Only tests/fashion_mnist/ imports the example, names its presets or reads its data
    (its data_dir fixture lives there: a test outside asking for it is not collected)."""
    machinery = [p for p in (ROOT / "tests").glob("*.py") if p.name != "test_fork.py"]  # this file names the seam
    assert len(machinery) > 20
    for path in machinery:
        wrong = sorted(name for name in _imports(path) if name.startswith("app.fashion_mnist"))
        assert not wrong, f"{path.relative_to(ROOT)} imports the example task: {wrong}"
        text = path.read_text()
        for name in ("cpu_test.yaml", "CPU_TEST_CONFIG", "fashion_mnist.yaml", "quickstart.yaml", "data_dir"):
            assert name not in text or path.name == "conftest.py" and name != "data_dir", f"{path.name}: {name}"


@pytest.mark.slow
def test_a_fork_without_the_example_still_has_every_machinery_test(tmp_path):
    """The fork itself: the tree without app/fashion_mnist and tests/fashion_mnist, cli.py pointed at another task.
    Every machinery test module still imports (a test that imported bench/, which measures the example, did not),
    and the machinery's fast tests all pass there (the in-process runs train the tests' own task), the private-API
    tests among them: no machinery list names a file of the deleted task. Then a test run through cli.py's default
    task trains."""
    fork = tmp_path / "fork"
    ignore = shutil.ignore_patterns(".git", ".venv", "lightning_logs", "__pycache__", "fashion_mnist", ".*cache")
    shutil.copytree(ROOT, fork, ignore=ignore)
    cli = (fork / "cli.py").read_text()
    cli = re.sub(r'^MODEL = ".*"$', 'MODEL = "examples.sequence.SequenceRegressor"', cli, flags=re.M)
    (fork / "cli.py").write_text(re.sub(r'^DATA = ".*"$', 'DATA = "examples.sequence.SequenceData"', cli, flags=re.M))
    assert not (fork / "app" / "fashion_mnist").exists() and "examples.sequence" in (fork / "cli.py").read_text()
    environ = {**os.environ, "PYTHONPATH": str(fork), "PYTEST_ADDOPTS": ""}  # (the caller's -v changes the output)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=fork, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    assert re.search(r"^(\d{3}) tests collected", collected.stdout, re.M), collected.stdout[-500:]
    # compiled first, as in the tree it was copied from: the fast tests' guard counts the CPU their children spend,
    # and a child compiling every module it imports would be charged for it
    compileall.compile_dir(fork / "app", quiet=1) and compileall.compile_dir(fork / "tests", quiet=1)
    # (one process: this test's worker shares the cores with the suite's other; -k: a selection, held to no budget)
    fast = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow",
         "-k", "not a_fork_without_the_example", "tests"],
        cwd=fork, env={**environ, "CI": ""}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert fast.returncode == 0 and " passed" in fast.stdout, fast.stdout[-3000:]
    assert "app/fashion_mnist/ is gone" in fast.stdout, fast.stdout[-3000:]  # the seam's tests: nothing to leak
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cli.py", "-k",
         "validate_without_ckpt_path or only_the_subcommand or rerunning_a_runs_config"],
        cwd=fork, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0 and " passed" in ran.stdout, ran.stdout[-3000:]


def test_count_samples_reads_any_usual_batch():
    assert count_samples(torch.zeros(5, 3)) == 5
    assert count_samples((torch.zeros(4, 1, 28, 28), torch.zeros(4))) == 4
    assert count_samples({"x": torch.zeros(3, 16, 4), "y": torch.zeros(3)}) == 3
    assert count_samples([{"ids": torch.zeros(2, 7)}]) == 2
    assert count_samples("text") == 0


def test_spec_defaults_and_a_wrong_spec():
    assert spec_of(object()) == TaskSpec()

    class Wrong:
        spec = {"monitor": "val_loss"}

    with pytest.raises(TypeError, match=r"Wrong.spec must be an app.task.TaskSpec"):
        spec_of(Wrong)


def test_checkpoint_names_follow_the_monitored_metric():
    ranked = checkpoint_options(TaskSpec(monitor="val/acc", mode="max"))
    assert ranked["monitor"] == "val/acc" and ranked["mode"] == "max"
    assert ranked["filename"] == "epoch={epoch}-val_acc={val/acc:.4f}"
    newest = checkpoint_options(TaskSpec())
    assert "monitor" not in newest and newest["save_last"] is True


def test_prediction_columns_from_any_predict_step():
    assert prediction_columns(torch.tensor([0.5, 1.5])) == {"pred": [0.5, 1.5]}
    probs = torch.tensor([[0.1, 0.9], [0.8, 0.2]])
    columns = prediction_columns({"preds": probs.argmax(1), "probs": probs, "score": torch.tensor([[1, 2], [3, 4]])})
    assert columns["pred"] == [1, 0] and columns["prob"] == pytest.approx([0.9, 0.8])
    assert columns["score"] == [[1, 2], [3, 4]]
    assert batch_labels({"x": torch.zeros(2, 3), "target": torch.tensor([1.0, 2.0])}) == [1.0, 2.0]
    assert batch_labels(torch.zeros(2, 3)) is None
    with pytest.raises(TypeError, match="drop_callbacks"):
        prediction_columns([1, 2])


@pytest.mark.parametrize(
    ("header", "row", "kept"),
    [
        ("epoch,step,val_mse", "0,7,0.5", True),  # a metric of the task's own, whatever its name
        ("epoch,step,lr-Adam", "0,12,0.01", True),  # logged after training started
        ("epoch,step,lr-Adam", "0,0,0.01", False),  # bookkeeping before the first step
    ],
)
def test_a_run_folder_with_anything_trained_or_logged_is_kept(tmp_path, header, row, kept):
    folder = tmp_path / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(f"{header}\n{row}\n")
    release_if_unused([folder])
    assert folder.is_dir() == kept


def test_plot_draws_another_tasks_per_epoch_metrics(tmp_path):
    """Its per-epoch metrics get a panel of their own; a metric logged per step (train_loss) is not one."""
    from app.run.plot import epoch_metrics, panels, step_metrics

    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "epoch,step,train_loss,val_mse,perf/images_per_s\n0,3,0.9,,\n0,7,0.8,,\n0,7,,0.5,100\n1,11,0.7,,\n1,15,,0.4,110\n"
    )
    series = epoch_metrics(run)
    assert series["val_mse"] == [(0, 0.5), (1, 0.4)] and "train_loss" not in series
    assert step_metrics(run) == ["train_loss"]
    assert panels(series, steps=step_metrics(run)) == [
        ("loss", ()),  # logged per step only: a panel of its steps
        ("mse", ("val_mse",)),
        ("images/s (training)", ("perf/images_per_s",)),
    ]


def test_plot_gives_each_kind_of_metric_its_scale_and_draws_step_values_per_step(tmp_path):
    """A fork's loss and accuracy shared one axis (the accuracy flat at the top), and Lightning's ``X_step`` (a value
    logged with on_step and on_epoch) was drawn as if per epoch: a panel per kind of metric, splits side by side,
    the ``_step`` values faint under their epoch means."""
    from app.run.plot import figure, panels, step_metrics

    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "epoch,step,loss/train_step,loss/train_epoch,loss/val,score/val\n"
        "0,3,0.9,,,\n0,7,0.8,,,\n0,7,,0.85,0.7,0.4\n1,11,0.6,,,\n1,15,0.5,,,\n1,15,,0.55,0.5,0.6\n"
    )
    from app.run.plot import epoch_metrics

    series = epoch_metrics(run)
    assert sorted(series) == ["loss/train_epoch", "loss/val", "score/val"]  # no loss/train_step as if per epoch
    assert step_metrics(run) == ["loss/train_step"]
    layout = panels(series, steps=step_metrics(run))
    assert layout == [("loss", ("loss/train_epoch", "loss/val")), ("score", ("score/val",))]
    fig = figure(run)
    loss, score = fig.axes
    assert [line.get_label() for line in loss.lines] == ["loss/train_step (per step)", "loss/train_epoch", "loss/val"]
    assert [line.get_label() for line in score.lines] == ["score/val"] and score.get_ylim()[1] < 1


def test_a_named_class_that_cannot_be_imported_is_one_line_saying_where(tmp_path, monkeypatch, capsys):
    from app.run.cli import main

    (tmp_path / "buggy.py").write_text("import torch\n\nrate = 1 / 0\n")
    (tmp_path / "needs.py").write_text("import not_installed_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {
        "buggy.Net": f"importing buggy failed: ZeroDivisionError: division by zero (at {tmp_path / 'buggy.py'}:3)",
        "needs.Net": "importing needs failed: ModuleNotFoundError: No module named 'not_installed_dep'",
        "nopkg.Net": "no module named 'nopkg'; check the name, and that the folder holding it is on PYTHONPATH",
    }
    for class_path, message in expected.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", f"--model={class_path}", f"--trainer.default_root_dir={tmp_path}"], **TINY_TASK)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --model={class_path}: {message}"), err


def test_which_command_lines_name_a_class(tmp_path, monkeypatch):
    # the --config files of the command line being run (cli.py reads them first): none here, whatever an earlier
    # in-process run of this worker read (a config naming a model class made the fourth line fail, by test order)
    monkeypatch.setattr(Parser, "config_files", {})
    assert names_class(["fit", "--model=mypkg.Net"], "model")
    assert names_class(["fit", "--model", "Net"], "model")
    assert names_class(["fit", "--data.class_path=mypkg.Data"], "data")
    assert not names_class(["fit", "--model.arch=resnet_tiny", "--data=x"], "model")
    config = tmp_path / "model.yaml"
    config.write_text("class_path: mypkg.Net\ninit_args: {hidden: 3}\n")
    assert names_class(["fit", f"--model={config}"], "model")
    config.write_text("arch: resnet_tiny\n")
    assert not names_class(["fit", f"--model={config}"], "model")


# ------------------------------------------------------------------------------- a user's own package, from outside
USER_PACKAGE = '''
"""A forker's task: 3x8x8 tensors, (x, y) batches, a metric called val_loss, no spec, a plain DataLoader."""
import os

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyCNN(LightningModule):
    def __init__(self, channels: int = 4, lr: float = 0.05, crash_at_step: int = -1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Conv2d(3, channels, 3), nn.Flatten(), nn.Linear(channels * 36, 5))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.hparams.crash_at_step:
            raise RuntimeError("user bug at step %d" % self.global_step)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Blobs(LightningDataModule):
    def __init__(self, size: int = 96, batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage):
        g = torch.Generator().manual_seed(0)
        self.set = TensorDataset(torch.randn(self.hparams.size, 3, 8, 8, generator=g),
                                 torch.randint(0, 5, (self.hparams.size,), generator=g))

    def train_dataloader(self):
        return DataLoader(self.set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.set, batch_size=self.hparams.batch_size)

    predict_dataloader = val_dataloader
'''


def _user_command(root: Path, *args: str, subcommand: str = "fit") -> list[str]:
    return [
        *(sys.executable, str(ROOT / "cli.py"), subcommand, "--model=userpkg.TinyCNN", "--data=userpkg.Blobs"),
        *(f"--trainer.default_root_dir={root}", "--trainer.accelerator=cpu", "--trainer.max_epochs=2"),
        *args,
    ]


def _user_run(cmd: list[str], cwd: Path, packages: Path, fresh: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` with the user's packages on the path: in a fresh interpreter, as a person starts it, or (a test's
    later runs, ``fresh=False``) forked from a warm one (tests/warm.py), the same run less the imports."""
    env = {
        **os.environ,
        "PYTHONPATH": str(packages),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    launch = subprocess.run if fresh else warm.run
    return launch(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_users_own_package_trains_resumes_predicts_and_keeps_its_folder(tmp_path):
    """Written outside the repo, named by class path, run from a third folder: ddp trains it (its metric
    names, its batches, no spec), a crash keeps the folder it trained in, the resume says what its own loader cannot
    keep, predict writes its rows, and the wrong model for a checkpoint is one line."""
    packages, root, elsewhere = tmp_path / "site", tmp_path / "runs", tmp_path / "cwd"
    (packages / "userpkg").mkdir(parents=True)
    (packages / "userpkg" / "__init__.py").write_text(USER_PACKAGE)
    elsewhere.mkdir()
    ddp = ("--trainer.strategy=ddp", "--trainer.devices=2")

    crashed = _user_run(_user_command(root, *ddp, "--model.crash_at_step=8"), elsewhere, packages)
    assert crashed.returncode != 0 and "user bug at step 8" in crashed.stderr
    v0 = root / "lightning_logs" / "version_0"
    assert (v0 / "metrics.csv").is_file(), "a run that trained an epoch keeps its folder, whatever its metric names"
    assert any(r.get("val_loss") for r in csv.DictReader((v0 / "metrics.csv").open()))
    assert (v0 / "checkpoints" / "last.ckpt").is_file()

    resumed = _user_run(
        _user_command(root, *ddp, "--model.crash_at_step=-1", "--ckpt_path", "last"), elsewhere, packages, fresh=False
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "training loader is not app.loader.make_loader's" in resumed.stderr
    assert [line for line in noise(resumed.stderr) if "make_loader" not in line] == []
    v1 = root / "lightning_logs" / "version_1"
    assert torch.load(v1 / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12  # 2 epochs x 6

    predict = _user_command(root, "--ckpt_path", "last", subcommand="predict")
    predicted = _user_run(predict, elsewhere, packages, fresh=False)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = list(csv.DictReader((root / "lightning_logs" / "version_2" / "predictions.csv").open()))
    assert len(rows) == 96 and set(rows[0]) == {"index", "name", "label", "pred"}
    assert {int(r["pred"]) for r in rows} <= set(range(5))

    wrong = warm.run(
        [sys.executable, str(ROOT / "cli.py"), "test", f"--ckpt_path={v1 / 'checkpoints' / 'last.ckpt'}"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(packages)},
    )
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        f"error: {v1 / 'checkpoints' / 'last.ckpt'}: not a checkpoint of app.fashion_mnist.model.ImageClassifier "
        "(written by userpkg.TinyCNN); pass --model=userpkg.TinyCNN --data=userpkg.Blobs, or another --ckpt_path"
    ]


TUNED_TASK = '''
"""A forker's task with LightningCLI's callables for the optimizer and the schedule (its own flag names)."""
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from userpkg import TinyCNN


class TunedCNN(TinyCNN):
    def __init__(
        self,
        optimizer: OptimizerCallable = torch.optim.Adam,
        schedule: LRSchedulerCallable | None = None,
        crash_at_step: int = -1,
    ):
        super().__init__(crash_at_step=crash_at_step)
        self.save_hyperparameters()  # (this class's arguments: TinyCNN's step reads crash_at_step)
        self.optimizer_factory, self.schedule_factory = optimizer, schedule

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.schedule_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.schedule_factory(optimizer)}
'''


def _lrs(version: Path) -> set[float]:
    """The lr of every optimizer step, as LearningRateMonitor read it from the optimizer (metrics.csv)."""
    rows = csv.DictReader((version / "metrics.csv").open())
    return {float(value) for row in rows for key, value in row.items() if key.startswith("lr-") and value}


@pytest.mark.slow
def test_a_forks_own_lr_and_optimizer_arguments_given_on_resume_are_what_trains(tmp_path):
    """A forker's task reads its own --model.lr in configure_optimizers: resumed with --model.lr=0.5, the run said
    "except --model.lr=0.5" and went on at the restored 0.05 (issue 45). Only the example task put the settings over
    the restored optimizer; the machinery does it now for any task: its own lr, and LightningCLI's optimizer and
    schedule callables with other arguments. What the optimizer trains with is read back from it."""
    packages, root, elsewhere = tmp_path / "site", tmp_path / "runs", tmp_path / "cwd"
    (packages / "userpkg").mkdir(parents=True)
    (packages / "userpkg" / "__init__.py").write_text(USER_PACKAGE)
    (packages / "userpkg" / "tuned.py").write_text(TUNED_TASK)
    elsewhere.mkdir()
    every = "--trainer.log_every_n_steps=1"
    first = _user_run(_user_command(root, every, "--trainer.max_epochs=1"), elsewhere, packages)
    assert first.returncode == 0, first.stderr[-3000:]
    resume = _user_command(root, every, "--model.lr=0.5", "--ckpt_path=last")
    resumed = _user_run(resume, elsewhere, packages, fresh=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert "settings, except --model.lr=0.5" in output
    assert "Resumed with the settings given over the restored state: lr 0.05 -> 0.5" in output
    v0, v1 = sorted((root / "lightning_logs").glob("version_*"))
    assert _lrs(v0) == {0.05} and _lrs(v1) == {0.5}
    saved = torch.load(v1 / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == 0.5

    tuned = ("--model=userpkg.tuned.TunedCNN", "--model.optimizer=torch.optim.AdamW", every)
    schedule = ("--model.schedule=torch.optim.lr_scheduler.StepLR", "--model.schedule.gamma=0.5")
    first = _user_run(
        _user_command(
            root := tmp_path / "tuned", *tuned, "--model.optimizer.lr=0.01", *schedule, "--model.schedule.step_size=1",
            "--trainer.max_epochs=1",
        ),
        elsewhere,
        packages,
        fresh=False,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _user_run(
        _user_command(
            root, *tuned, "--model.optimizer.lr=0.002", "--model.optimizer.weight_decay=0.1", *schedule,
            "--model.schedule.step_size=1", "--ckpt_path=last",
        ),
        elsewhere,
        packages,
        fresh=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    # the schedule had halved 0.01 after epoch 0: the new lr keeps that factor
    line = re.search(
        r"Resumed with the settings given over the restored state: lr 0.005 -> (\S+), weight_decay \S+ -> 0.1\n", output
    )
    assert line and float(line.group(1)) == pytest.approx(0.001), output[-3000:]
    v0, v1 = sorted((root / "lightning_logs").glob("version_*"))
    [lr] = _lrs(v1)
    assert _lrs(v0) == {0.01} and lr == pytest.approx(0.001)
    [group] = torch.load(v1 / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert group["initial_lr"] == 0.002 and group["weight_decay"] == 0.1 and group["lr"] == pytest.approx(0.0005)


@pytest.mark.slow
def test_a_users_own_entry_script_with_its_classes_inside(tmp_path):
    """``main(model=..., data=...)`` from the user's own script (classes defined in it), under ddp: the script
    is re-run per rank; a monitor the model never logs is one line before any training."""
    script = tmp_path / "train.py"
    script.write_text(
        USER_PACKAGE
        + textwrap.dedent(
            """
            from app.run.cli import main
            from app.task import TaskSpec

            class Ranked(TinyCNN):
                spec = TaskSpec(monitor="val_acc", mode="max")

            if __name__ == "__main__":
                import sys
                main(model=Ranked if "--ranked" in sys.argv else TinyCNN, data=Blobs,
                     args=[a for a in sys.argv[1:] if a != "--ranked"])
            """
        )
    )
    common = ["fit", f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.max_epochs=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, str(script), *common, "--trainer.strategy=ddp", "--trainer.devices=2"],
        cwd=ROOT / "docs",
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    bad = warm.run(  # the test's later run: forked from a warm interpreter, as the as-users tests do
        [sys.executable, str(script), *common, "--ranked"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2
    assert [line for line in bad.stderr.splitlines() if "rror" in line] == [
        "error: ModelCheckpoint ranks checkpoints by 'val_acc', which Ranked did not log in validation (it logged: "
        "val_loss); set spec = TaskSpec(monitor=..., mode=...) in Ranked (app/task.py), or give your own "
        "--trainer.callbacks+=ModelCheckpoint --trainer.callbacks.monitor=..."
    ]
    assert not (tmp_path / "runs" / "lightning_logs" / "version_1").exists()


# ------------------------------------------------------------------------------------ the second example task
def _sequence(root: Path, *args: str, subcommand: str = "fit") -> list[str]:
    return [
        *(sys.executable, str(ROOT / "cli.py"), subcommand, *SEQUENCE, f"--trainer.default_root_dir={root}"),
        *("--trainer.accelerator=cpu", "--data.train_size=512", "--data.batch_size=32", "--trainer.max_epochs=1"),
        *args,
    ]


@pytest.mark.slow
def test_the_sequence_task_under_every_strategy_with_the_callbacks(tmp_path):
    """dp, ddp, ddp_spawn, self-launched horovod and fsdp train it with SyncBatchNorm, LRWarmup and activation
    checkpointing on; ddp, ddp_spawn, horovod and fsdp end at the same weights; checkpoints carry its metric's
    name."""
    callbacks = [f"--trainer.callbacks+=app.callbacks.{name}" for name in ("SyncBatchNorm", "LRWarmup")]
    callbacks += ["--trainer.callbacks+=app.callbacks.ActivationCheckpointing"]
    weights = {}
    for strategy in ("dp", "ddp", "ddp_spawn", "horovod", "fsdp"):
        root = tmp_path / strategy
        result = run(
            _sequence(root, f"--trainer.strategy={strategy}", "--trainer.devices=2", *callbacks),
            cwd=tmp_path,
            fresh=strategy == "dp",
        )
        assert result.returncode == 0, f"{strategy}: {result.stderr[-3000:]}"
        assert "ActivationCheckpointing: 1 modules recompute in backward (('GRU',))" in result.stderr
        epoch_line = next(line for line in result.stdout.splitlines() if line.startswith("epoch 0 |"))
        assert "val mse" in epoch_line and f"2 x cpu ({strategy})" in epoch_line, epoch_line
        checkpoints = sorted(p.name for p in (root / "lightning_logs" / "version_0" / "checkpoints").iterdir())
        assert checkpoints[0].startswith("epoch=0-val_mse=") and checkpoints[1] == "last.ckpt", checkpoints
        unexpected = [line for line in noise(result.stderr) if "dp runs its replicas in one process" not in line]
        assert unexpected == [], f"{strategy}: {unexpected}"
        weights[strategy] = torch.load(root / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    for strategy in ("ddp_spawn", "horovod", "fsdp"):
        for name, value in weights["ddp"]["state_dict"].items():
            torch.testing.assert_close(weights[strategy]["state_dict"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_sequence_task_under_pipeline_is_told_in_one_line_what_to_name(tmp_path):
    """Its GRU and its head are two top-level submodules: which one is "the network" to cut is the forker's call,
    and the line says where to make it (TaskSpec(layers=...)); nothing is written."""
    result = run(_sequence(tmp_path / "runs", "--trainer.strategy=pipeline", "--trainer.devices=2"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "error: --trainer.strategy=pipeline cuts one network into stages, but SequenceRegressor holds parameters in "
        "gru, head; name the network with TaskSpec(layers=...)"
    ], result.stderr[-3000:]
    assert not (tmp_path / "runs" / "lightning_logs").exists()


@pytest.mark.slow
def test_the_sequence_task_stops_resumes_exactly_and_predicts(tmp_path):
    """SIGTERM after step 3 of 8 (a stop mid-epoch) under ddp, then the same command plus --ckpt_path last: the
    weights equal an unbroken run's; predict writes one row per test sequence with its target as the label."""
    ddp = ("--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_epochs=2")
    whole = run(_sequence(tmp_path / "whole", *ddp), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    signal = ("--trainer.callbacks+=tests.signal_at_step.SignalAtStep", "--trainer.callbacks.step=3")
    stopped = run(_sequence(tmp_path / "cut", *ddp, *signal), cwd=tmp_path, fresh=False)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    stop = re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", stopped.stdout)
    assert stop and 3 <= int(stop.group(1)) < 8, stopped.stdout[-2000:]  # mid-epoch (ranks agree on the step)
    resumed = run(_sequence(tmp_path / "cut", *ddp, "--ckpt_path", "last"), cwd=tmp_path, fresh=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "make_loader" not in resumed.stderr  # its loader is the template's: the promise holds, no warning
    a = torch.load(tmp_path / "whole/lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "cut/lightning_logs/version_1/checkpoints/last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 16
    for name, value in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], value), name

    predicted = run(_sequence(tmp_path / "cut", "--ckpt_path", "last", subcommand="predict"), cwd=tmp_path, fresh=False)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "cut/lightning_logs/version_2/predictions.csv").open()))
    assert len(rows) == 256 and list(rows[0]) == ["index", "name", "label", "pred"]
    assert all(float(r["label"]) != -1 for r in rows)
    config = json.dumps(
        __import__("yaml").safe_load((tmp_path / "cut/lightning_logs/version_1/config.yaml").read_text())["model"]
    )
    assert "examples.sequence.SequenceRegressor" in config  # config.yaml re-runs the same task


# ------------------------------------------------------------------------------------------------ the Python API
API_SCRIPT = """
import sys

from lightning.pytorch import Trainer

from app.run.defaults import last_checkpoint, trainer_defaults
from examples.sequence import SequenceData, SequenceRegressor


class MyRegressor(SequenceRegressor):  # defined in the script itself, as users do
    pass


if __name__ == "__main__":
    root, epochs = sys.argv[1], int(sys.argv[2])
    model, data = MyRegressor(hidden=8), SequenceData(train_size=128, val_size=64, batch_size=16)
    trainer = Trainer(**trainer_defaults(model, root), strategy="ddp", devices=2, accelerator="cpu", max_epochs=epochs)
    trainer.fit(model, data, ckpt_path=last_checkpoint(root))
"""


@pytest.mark.slow
def test_the_python_api_gets_what_the_cli_gives(tmp_path):
    """``Trainer(**trainer_defaults(model, root))`` under ddp: a claimed run folder per run, the checkpoint ranked by
    the task's metric, atomic checkpoints with the template's format, and ``last_checkpoint`` resumes."""
    from app.checkpoints.io import FORMAT_KEY

    script = tmp_path / "train.py"
    script.write_text(API_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for epochs in (1, 2):  # the first run as a person starts it; the resume forked warm (tests/warm.py)
        launch = subprocess.run if epochs == 1 else warm.run
        result = launch(
            [sys.executable, str(script), str(tmp_path / "runs"), str(epochs)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"epoch {epochs - 1} | train loss" in result.stdout
    runs = tmp_path / "runs" / "lightning_logs"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    assert any(p.name.startswith("epoch=1-val_mse=") for p in (runs / "version_1" / "checkpoints").iterdir())
    last = torch.load(runs / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 8 and last[FORMAT_KEY] == 2  # 2 epochs x 4 steps, resumed from version_0
