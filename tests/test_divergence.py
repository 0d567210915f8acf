"""A diverging run stops with one line and exit 1, and never writes non-finite weights over a good checkpoint."""

import os
import re
import subprocess
import sys

import pytest
import torch

from app.callbacks import StopOnNonFinite
from tests import warm
from tests.conftest import ROOT, TINY_CONFIG
from tests.parity import MPI_ENV


def fit(cwd, root, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG)]
    cmd += [f"--trainer.default_root_dir={root}", *extra]
    environ = {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}
    return warm.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=environ)


def checkpoints(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*.ckpt"))}


def assert_finite(path) -> None:
    state = torch.load(path, weights_only=True)["state_dict"]
    assert all(t.isfinite().all() for t in state.values() if t.is_floating_point()), path


@pytest.mark.slow
def test_a_diverging_run_stops_and_keeps_the_good_checkpoints(tmp_path):
    cwd, root = tmp_path / "elsewhere", tmp_path / "runs"
    cwd.mkdir()
    good = fit(cwd, root, "--trainer.max_epochs=1")
    assert good.returncode == 0, good.stderr[-3000:]
    before = checkpoints(root)
    assert any(p.name == "last.ckpt" for p in before)

    # A second, fresh run in the same root that diverges.
    bad = fit(cwd, root, "--trainer.max_epochs=3", "--model.lr=1e30")
    assert bad.returncode == 1, bad.stderr[-3000:]
    last_line = bad.stderr.strip().splitlines()[-1]
    # the step whose loss was not finite, not the step the check read it at (every 50 batches, or the epoch's end)
    assert re.match(r"error: training diverged: the training loss became (nan|inf) at step \d+ \(epoch 0\)", last_line)
    assert "--model.lr" in last_line and "Traceback" not in bad.stderr
    assert bad.stderr.count("error:") == 1
    after = checkpoints(root)
    for path, data in before.items():
        assert after[path] == data  # the good checkpoints are untouched
    for path in after:
        assert_finite(path)  # and nothing non-finite was added
    # the diverged run trained steps: its folder (config, metrics) stays, whatever it logged
    assert (root / "lightning_logs" / "version_1" / "config.yaml").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "horovod"])
def test_a_diverging_multi_process_run_stops_every_rank_with_one_line(strategy, tmp_path):
    """Under the horovod self-launch the ranks' stop was followed by prterun's error box and a 20-line traceback
    (issue 34, item 11): rank 0's line is the run's last, said once by the launcher."""
    result = fit(
        tmp_path, tmp_path / "runs", f"--trainer.strategy={strategy}", "--trainer.devices=2", "--model.lr=1e30"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("error: training diverged") == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: training diverged"), result.stderr[-3000:]
    assert "prterun" not in result.stderr and "Warning" not in result.stderr, result.stderr[-3000:]
    assert not list((tmp_path / "runs").rglob("*.ckpt"))


def test_check_interval_is_validated():
    with pytest.raises(ValueError, match="check_every_n_steps must be >= 1"):
        StopOnNonFinite(check_every_n_steps=0)


def test_the_line_names_the_step_whose_loss_was_not_finite_between_two_reads(tmp_path):
    """The losses are read every 50 batches and at the epoch's end: a loss that was inf at step 5 of 12 only is
    found at the end of the epoch, and said as step 5's."""
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from app.errors import Diverged

    class Task(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            return loss * float("inf") if self.global_step == 5 else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay finite: only the loss is not

    trainer = Trainer(
        max_epochs=1, callbacks=[StopOnNonFinite()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.ones(12, 2)), batch_size=1)
    with pytest.raises(Diverged, match=r"the training loss became inf at step 5 \(epoch 0\)") as diverged:
        trainer.fit(Task(), data)
    assert trainer.global_step == 12  # read at the epoch's end, after step 5 was long done
    # a task with no lr argument and no declared flag: the hint names no flag (it named --model.optimizer.lr)
    assert "Lower the learning rate (now 0), or warm it up" in str(diverged.value), diverged.value


def test_the_flag_a_hint_names_is_the_one_that_sets_the_tasks_lr():
    """A fork whose optimizer reads ``--model.lr`` was told "Lower the learning rate (now 0.5: --model.optimizer.lr)".
    The flag is now the task's declared one, else the argument its ``__init__`` takes, else none."""
    from lightning.pytorch import LightningModule

    from app.task import TaskSpec, lr_flag_of

    class WithLr(LightningModule):
        def __init__(self, hidden: int = 8, lr: float = 0.5) -> None:
            super().__init__()

    class WithLearningRate(LightningModule):
        def __init__(self, learning_rate: float = 0.5) -> None:
            super().__init__()

    class WithOptimizer(LightningModule):
        def __init__(self, optimizer=None) -> None:
            super().__init__()

    class Declared(WithLr):
        spec = TaskSpec(lr_flag="--model.schedule.peak_lr")

    assert lr_flag_of(WithLr()) == "--model.lr" and lr_flag_of(WithLearningRate) == "--model.learning_rate"
    assert lr_flag_of(WithOptimizer()) == "--model.optimizer.lr"
    assert lr_flag_of(Declared()) == "--model.schedule.peak_lr"
    assert lr_flag_of(LightningModule()) is None
