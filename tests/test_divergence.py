"""A diverging run stops with one line and exit 1, and never writes non-finite weights over a good checkpoint."""

import os
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
    assert last_line.startswith("error: training diverged: the training loss became nan by step"), last_line
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
