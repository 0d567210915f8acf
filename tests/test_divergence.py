"""A diverging run stops with one line and exit 1, and never writes non-finite weights over a good checkpoint."""

import os
import subprocess
import sys

import pytest
import torch

from app.callbacks import StopOnNonFinite
from tests import warm
from tests.conftest import CPU_TEST_CONFIG, ROOT


def fit(cwd, root, data_dir, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(CPU_TEST_CONFIG)]
    cmd += ["--data.data_dir", str(data_dir), f"--trainer.default_root_dir={root}", *extra]
    return warm.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def checkpoints(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*.ckpt"))}


def assert_finite(path) -> None:
    state = torch.load(path, weights_only=True)["state_dict"]
    assert all(t.isfinite().all() for t in state.values() if t.is_floating_point()), path


@pytest.mark.slow
def test_a_diverging_run_stops_and_keeps_the_good_checkpoints(tmp_path, data_dir):
    cwd, root = tmp_path / "elsewhere", tmp_path / "runs"
    cwd.mkdir()
    good = fit(cwd, root, data_dir, "--trainer.max_epochs=1")
    assert good.returncode == 0, good.stderr[-3000:]
    before = checkpoints(root)
    assert any(p.name == "last.ckpt" for p in before)

    # A second, fresh run in the same root that diverges.
    bad = fit(cwd, root, data_dir, "--trainer.max_epochs=3", "--model.optimizer.lr=1e6")
    assert bad.returncode == 1, bad.stderr[-3000:]
    last_line = bad.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: training diverged: the training loss became nan by step"), last_line
    assert "--model.optimizer.lr" in last_line and "Traceback" not in bad.stderr
    assert bad.stderr.count("error:") == 1
    after = checkpoints(root)
    for path, data in before.items():
        assert after[path] == data  # the good checkpoints are untouched
    for path in after:
        assert_finite(path)  # and nothing non-finite was added
    # the diverged run trained steps: its folder (config, metrics) stays, whatever it logged
    assert (root / "lightning_logs" / "version_1" / "config.yaml").is_file()


@pytest.mark.slow
def test_a_diverging_ddp_run_stops_every_rank_with_one_line(tmp_path, data_dir):
    result = fit(
        tmp_path,
        tmp_path / "runs",
        data_dir,
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--model.optimizer.lr=1e6",
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("error: training diverged") == 1 and "Traceback" not in result.stderr
    assert not list((tmp_path / "runs").rglob("*.ckpt"))


def test_check_interval_is_validated():
    with pytest.raises(ValueError, match="check_every_n_steps must be >= 1"):
        StopOnNonFinite(check_every_n_steps=0)


def test_export_refuses_non_finite_weights(tmp_path):
    from app.errors import UserError
    from app.fashion_mnist.export import export
    from app.fashion_mnist.model import ImageClassifier

    module = ImageClassifier(arch="resnet_tiny")
    state = {f"net.{k}": v for k, v in module.net.state_dict().items()}
    state["net.fc.weight"] = torch.full_like(state["net.fc.weight"], float("nan"))
    ckpt = tmp_path / "nan.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"arch": "resnet_tiny", "num_classes": 10}}, ckpt)
    with pytest.raises(UserError, match=r"nan.ckpt: 1 weight tensor\(s\) hold inf or nan \(e.g. fc.weight\)"):
        export(ckpt, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()
    assert os.listdir(tmp_path) == ["nan.ckpt"]
