"""Experiment trackers beside the run folder (app/callbacks/tracker_runs.py, app/run/trackers.py): a training stopped
and resumed is one tracker run with each step logged once, whatever the tracker, and its checkpoints stay in the run
folder where ``--ckpt_path last`` finds them. MLflow runs as a real tracking server on a SQLite store (and as a SQLite
store alone); W&B in offline mode, read back from the files it writes."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY_CONFIG
from tests.test_as_users_run_it import noise, run
from tests.trackers import mlflow_runs, wandb_segments

pytestmark = pytest.mark.slow

MLFLOW = "lightning.pytorch.loggers.MLFlowLogger"
WANDB = "lightning.pytorch.loggers.WandbLogger"
STOP = ("--trainer.callbacks+=tests.signal_at_step.SignalAtStep", "--trainer.callbacks.step=10")  # of 16 steps


def fit(root: Path, *args: str, subcommand: str = "fit") -> list[str]:
    """The tests' task, 2 epochs of 8 steps, logging every step."""
    cli = (sys.executable, str(ROOT / "cli.py"), subcommand, "--config", str(TINY_CONFIG))
    return [*cli, f"--trainer.default_root_dir={root}", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a SQLite store, on a port of its own; its URI."""
    folder = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{folder}/mlflow.db", "--workers", "1"]
    with (folder / "server.log").open("w") as log:
        server = subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.read().strip() == b"OK":
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_a_stopped_and_resumed_run_is_one_mlflow_run_with_each_step_once(tmp_path, mlflow_server):
    """MLflow beside the default loggers (a tracking server on SQLite): SIGTERM after step 11 of 16, then the same
    command plus --ckpt_path last: one MLflow run, FINISHED, named after the run folder, train/loss at steps 0..15
    once each; the next training is a run of its own with another name (a seeded Python ``random`` named every run
    alike)."""
    root, elsewhere = tmp_path / "runs", tmp_path / "cwd"
    elsewhere.mkdir()
    tracker = (f"--trainer.logger+={MLFLOW}", f"--trainer.logger.tracking_uri={mlflow_server}")
    tracker += ("--trainer.logger.experiment_name=stop-resume",)
    stopped = run(fit(root, *tracker, *STOP), cwd=elsewhere)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    [first] = mlflow_runs(mlflow_server, "stop-resume")
    assert first["steps"] == list(range(11)) and first["status"] != "FINISHED"

    resumed = run(fit(root, *tracker, "--ckpt_path", "last"), cwd=elsewhere, fresh=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"MLFlowLogger continues its run {first['id']}" in resumed.stderr
    again = run(fit(root, *tracker), cwd=elsewhere, fresh=False)
    assert again.returncode == 0, again.stderr[-3000:]

    one, other = mlflow_runs(mlflow_server, "stop-resume")
    assert {**one, "metrics": []} == {**first, "metrics": [], "status": "FINISHED", "steps": list(range(16))}
    assert one["name"] == "runs/version_0" and other["name"] == "runs/version_2"
    assert other["steps"] == list(range(16)) and other["status"] == "FINISHED"
    last = torch.load(root / "lightning_logs/version_1/checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 16 and not (elsewhere / "mlruns").exists()


def test_mlflow_alone_on_a_sqlite_store_keeps_the_run_folder(tmp_path):
    """``--trainer.logger=MLFlowLogger`` alone with a ``sqlite:///`` store (no local folder of its own): LightningCLI's
    config save asserted and the run never started; checkpoints went under mlruns/. The run folder's CSV logger comes
    first: checkpoints and config.yaml in lightning_logs/version_N, --ckpt_path last finds them, and the MLflow run
    goes on across the stop; `cli.py test` of its checkpoint logs into that run too. (Several processes: the torchrun
    test in tests/test_elastic.py.)"""
    root, elsewhere = tmp_path / "runs", tmp_path / "cwd"
    elsewhere.mkdir()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = (f"--trainer.logger={MLFLOW}", f"--trainer.logger.tracking_uri={store}")
    tracker += ("--trainer.limit_train_batches=4",)  # 8 steps
    signal_at = ("--trainer.callbacks+=tests.signal_at_step.SignalAtStep", "--trainer.callbacks.step=5")
    stopped = run(fit(root, *tracker, *signal_at), cwd=elsewhere)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    v0 = root / "lightning_logs" / "version_0"
    assert (v0 / "checkpoints" / "last.ckpt").is_file() and (v0 / "config.yaml").is_file()
    assert (v0 / "metrics.csv").is_file()
    resumed = run(fit(root, *tracker, "--ckpt_path", "last"), cwd=elsewhere, fresh=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert noise(resumed.stderr) == [], resumed.stderr[-3000:]
    tracker = (f"--trainer.logger={MLFLOW}", f"--trainer.logger.tracking_uri={store}")
    tested = run(fit(root, *tracker, "--ckpt_path", "last", subcommand="test"), cwd=elsewhere, fresh=False)
    assert tested.returncode == 0, tested.stderr[-3000:]
    [one] = mlflow_runs(store, "lightning_logs")
    assert one["status"] == "FINISHED" and one["steps"] == list(range(8)) and one["name"] == "runs/version_0"
    assert "test/acc" in one["metrics"]  # the test of the checkpoint: in its training's run
    assert sorted(p.name for p in elsewhere.iterdir()) == [] and not (root / "mlruns").exists()


def test_a_stopped_and_resumed_run_is_one_wandb_run_offline_with_each_step_once(tmp_path):
    """W&B offline beside the default loggers: the stop and the resume write two offline segments of one run id
    (``wandb sync`` uploads both into that run), each step in one of them once."""
    root, elsewhere, files = tmp_path / "runs", tmp_path / "cwd", tmp_path / "wandb"
    elsewhere.mkdir()
    tracker = (f"--trainer.logger+={WANDB}", "--trainer.logger.offline=true", f"--trainer.logger.save_dir={files}")
    tracker += ("--trainer.logger.project=stop-resume",)
    env = {"WANDB_SILENT": "true"}
    stopped = run(fit(root, *tracker, *STOP), cwd=elsewhere, env=env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run(fit(root, *tracker, "--ckpt_path", "last"), cwd=elsewhere, fresh=False, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = wandb_segments(files)
    assert first["id"] == second["id"] and first["name"] == "runs/version_0"
    assert first["steps"] == list(range(11)) and second["steps"] == list(range(11, 16))
    assert f"WandbLogger continues its run {first['id']}" in resumed.stderr
