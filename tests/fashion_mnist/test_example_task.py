"""The example task through ``cli.py`` (ImageClassifier on Fashion-MNIST): what only it has. Its augmentation resumes
exactly, a resume takes a new learning rate and label smoothing, and its own flags and files are checked in one line.

The machinery's tests (tests/test_*.py) train the tests' own task (tests/tiny.py); a fork replaces this folder with
its own task's tests.
"""

import math
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests import warm
from tests.conftest import CPU_TEST_CONFIG, ROOT
from tests.fashion_mnist.conftest import run_cli
from tests.test_reliability import assert_same_weights, env, last_ckpt, metrics, signal_at_step, versions

pytestmark = pytest.mark.slow


def fit(cwd: Path, data_dir, *args: str):
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}"]
    return warm.run([*cmd, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=240)


def test_an_augmented_run_stopped_mid_epoch_resumes_bit_identical(tmp_path, data_dir):
    """Random crops and flips seeded by the batch's name: the resumed run draws what an unbroken run draws."""
    augmented = ("--data.augment=true", "--trainer.max_epochs=2", "--trainer.limit_train_batches=4")
    for name in ("unbroken", "stopped"):
        (tmp_path / name).mkdir()
    unbroken = fit(tmp_path / "unbroken", data_dir, *augmented)
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    stopped = fit(tmp_path / "stopped", data_dir, *augmented, signal_at_step(6, "SIGTERM", 0))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = fit(tmp_path / "stopped", data_dir, *augmented, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [expected] = versions(tmp_path / "unbroken")
    assert 6 < last_ckpt(versions(tmp_path / "stopped")[0])["global_step"] < 8  # stopped inside epoch 1
    assert_same_weights(last_ckpt(versions(tmp_path / "stopped")[-1]), last_ckpt(expected))


def test_batches_cut_on_the_device_train_as_the_host_loaders_through_a_stop_and_resume(tmp_path, data_dir):
    """``--data.on_device=true`` (the training set on the device, batches cut there): stopped mid-epoch and resumed,
    the same weights as an unbroken run on the host's loader, augmentation included (on the CPU both draw there)."""
    augmented = ("--data.augment=true", "--trainer.max_epochs=2", "--trainer.limit_train_batches=4")
    for name in ("host", "device"):
        (tmp_path / name).mkdir()
    host = fit(tmp_path / "host", data_dir, *augmented)
    assert host.returncode == 0, host.stderr[-3000:]
    on_device = (*augmented, "--data.on_device=true")
    stopped = fit(tmp_path / "device", data_dir, *on_device, signal_at_step(5, "SIGTERM", 0))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = fit(tmp_path / "device", data_dir, *on_device, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 5 <= last_ckpt(versions(tmp_path / "device")[0])["global_step"] < 8  # stopped inside epoch 1
    [expected] = versions(tmp_path / "host")
    assert_same_weights(last_ckpt(versions(tmp_path / "device")[-1]), last_ckpt(expected))


def test_on_device_with_workers_is_one_clear_error(workdir, data_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", "--data.on_device=true",
                "--data.num_workers=2")  # fmt: skip
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "--data.on_device=true cuts batches on the device" in err and "--data.num_workers=2" in err
    assert not (workdir / "lightning_logs").exists()


def test_a_machine_of_many_cores_is_not_told_to_add_workers_the_loaders_do_not_need(workdir, data_dir, monkeypatch):
    """Lightning advises workers for every loader with fewer than two where a machine has more than two cores, as
    users' machines and the GPU hosts do (this one has two: the count of cores Lightning reads is stood in for). The
    example's batches are one indexing op and need none: no such line, where a loader of Lightning's own demo still
    gets it."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)

    def advice(run) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        return [str(w.message) for w in caught if "does not have many workers" in str(w.message)]

    assert advice(lambda: run_cli(
        "fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
    )) == []  # fmt: skip
    assert (workdir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").exists()  # it trained
    demo = Trainer(fast_dev_run=1, accelerator="cpu", logger=False, enable_progress_bar=False)
    assert len(advice(lambda: demo.fit(BoringModel()))) == 2  # train and val: the stand-in is what Lightning reads


def test_a_resume_uses_the_training_settings_given_and_records_them(workdir, data_dir):
    """The network and unstated settings come from the checkpoint; a stated lr and label smoothing are used (the
    restored optimizer state gets the new lr), named in one notice, and written to the run's config.yaml."""
    first = fit(workdir, data_dir, "--trainer.max_epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = fit(
        workdir,
        data_dir,
        "--trainer.max_epochs=2",
        "--ckpt_path=last",
        "--model.optimizer.lr=0.01",
        "--model.label_smoothing=0.1",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "settings, except --model.label_smoothing=0.1, --model.optimizer.lr=0.01" in resumed.stderr
    v0, v1 = versions(workdir)
    assert set(metrics(v1)["lr-SGD"].values()) == {"0.01"}
    config = yaml.safe_load((v1 / "config.yaml").read_text())["model"]
    assert config["optimizer"]["init_args"]["lr"] == 0.01 and config["label_smoothing"] == 0.1
    saved = yaml.safe_load((v0 / "config.yaml").read_text())["model"]["optimizer"]["init_args"]
    assert {k: v for k, v in config["optimizer"]["init_args"].items() if k != "lr"} == {
        k: v for k, v in saved.items() if k != "lr"
    }
    assert last_ckpt(v1)["optimizer_states"][0]["param_groups"][0]["lr"] == 0.01


def test_a_resume_given_the_runs_own_config_again_keeps_the_scheduled_lr(tmp_path, data_dir):
    """configs/fashion_mnist.yaml names the optimizer's lr and a cosine schedule. Resumed with the same file, as users
    resume, the run put the file's lr (0.1) over the restored one that the schedule had moved (0.0989): the resumed
    epochs trained at another lr than an unbroken run's (found on the GPU). An argument given again unchanged keeps
    the restored value; only a changed one goes over it (the test above)."""
    recipe = yaml.safe_load((ROOT / "configs" / "fashion_mnist.yaml").read_text())["model"]
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(yaml.safe_dump({"model": {k: recipe[k] for k in ("optimizer", "lr_scheduler")}}))
    for name in ("unbroken", "stopped"):
        (tmp_path / name).mkdir()
    given = ("--config", str(schedule))
    unbroken = fit(tmp_path / "unbroken", data_dir, *given, "--trainer.max_epochs=3")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    first = fit(tmp_path / "stopped", data_dir, *given, "--trainer.max_epochs=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = fit(tmp_path / "stopped", data_dir, *given, "--trainer.max_epochs=3", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "settings, except" not in resumed.stderr  # nothing was changed
    [expected] = versions(tmp_path / "unbroken")
    assert_same_weights(last_ckpt(versions(tmp_path / "stopped")[-1]), last_ckpt(expected))


def test_a_resume_given_another_scheduler_argument_trains_on_with_it(tmp_path, data_dir):
    """The notice said the given T_max wins, but Lightning restored the scheduler's state, saved T_max included:
    the resumed run went on with the old schedule. The argument given now goes over the restored state."""
    schedule = "--model.lr_scheduler=torch.optim.lr_scheduler.CosineAnnealingLR"
    first = fit(tmp_path, data_dir, schedule, "--model.lr_scheduler.init_args.T_max=30", "--trainer.max_epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = fit(
        tmp_path, data_dir, schedule, "--model.lr_scheduler.init_args.T_max=4", "--trainer.max_epochs=2",
        "--ckpt_path=last",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "settings, except --model.lr_scheduler=" in resumed.stderr and "'T_max': 4" in resumed.stderr
    [state] = last_ckpt(versions(tmp_path)[-1])["lr_schedulers"]
    assert state["T_max"] == 4 and state["last_epoch"] == 2
    # torch steps a cosine schedule from the lr it finds (0.0997 after one epoch of T_max=30): 0.0584; T_max=30: 0.0989
    after_first = 0.05 * (1 + math.cos(math.pi / 30))
    expected = after_first * (1 + math.cos(math.pi * 2 / 4)) / (1 + math.cos(math.pi / 4))
    assert state["_last_lr"][0] == pytest.approx(expected)


def _corrupt(data: Path, name: str, change) -> None:
    from app.fashion_mnist.idx import read_idx, write_idx

    path = data / "FashionMNIST-synthetic" / "raw" / name
    write_idx(path, change(read_idx(path)))


BAD_INPUT = {
    "batch_size=0": (["--data.batch_size=0"], "--data.batch_size"),
    "other optimizer": (["--ckpt_path=last", "--model.optimizer=AdamW"], "--model.optimizer=torch.optim.AdamW was"),
    "negative lr": (["--model.optimizer.lr=-0.1"], "--model.optimizer: Invalid learning rate: -0.1"),
    "negative lr on resume": (["--ckpt_path=last", "--model.optimizer.lr=-1"], "--model.optimizer: Invalid learning"),
    "bad scheduler value": (
        ["--model.lr_scheduler=OneCycleLR", "--model.lr_scheduler.max_lr=0.1", "--model.lr_scheduler.total_steps=0"],
        "--model.lr_scheduler: Expected positive integer total_steps",
    ),
    "contradicting arch": (["--ckpt_path=last", "--model.arch=resnet18"], "--model.arch=resnet18 was given"),
    "data_dir is a file": (["--data.data_dir=run.txt"], "--data.data_dir=run.txt: run.txt is a file"),
    "no files, no network": (["--data.source=fashion_mnist", "--data.data_dir=empty"], "--data.source=fashion_mnist"),
    "truncated IDX": (["--data.data_dir=truncated"], "train-images-idx3-ubyte: truncated"),
    "label out of range": (["--data.data_dir=labels"], "label 10 out of range 0..9"),
    "wrong image shape": (["--data.data_dir=shape"], "images are (32, 32), expected 28x28"),
}


@pytest.fixture(scope="module")
def bad_input_dir(tmp_path_factory, data_dir):
    """A folder with an earlier run of the example (it must survive) and one broken data folder per case."""
    cwd = tmp_path_factory.mktemp("example-bad-input")
    result = fit(cwd, data_dir, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2")
    assert result.returncode == 0, result.stderr[-3000:]
    (cwd / "run.txt").write_text("a file, not a folder")
    (cwd / "empty").mkdir()
    for name, file, change in [
        ("truncated", "train-images-idx3-ubyte", None),
        ("labels", "train-labels-idx1-ubyte", lambda t: t.index_fill(0, torch.tensor([7]), 10)),
        ("shape", "train-images-idx3-ubyte", lambda t: torch.zeros(len(t), 32, 32, dtype=torch.uint8)),
    ]:
        shutil.copytree(data_dir, cwd / name)
        if change is None:
            path = cwd / name / "FashionMNIST-synthetic" / "raw" / file
            path.write_bytes(path.read_bytes()[:-1000])
        else:
            _corrupt(cwd / name, file, change)
    return cwd


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_of_the_example_is_one_line_exit_2_and_nothing_overwritten(
    case, bad_input_dir, data_dir, capsys, monkeypatch
):
    from app.fashion_mnist.data import FashionMNISTDataModule

    monkeypatch.chdir(bad_input_dir)
    monkeypatch.setattr(FashionMNISTDataModule, "_download", lambda self: (_ for _ in ()).throw(OSError("no network")))
    run_dir = bad_input_dir / "lightning_logs" / "version_0"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    args, expected = BAD_INPUT[case]
    data_args = [] if any(a.startswith("--data.data_dir") for a in args) else [f"--data.data_dir={data_dir}"]
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(CPU_TEST_CONFIG), *data_args, "--trainer.max_epochs=1", *args)
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and expected in last_line, last_line
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert [p.name for p in (bad_input_dir / "lightning_logs").iterdir()] == ["version_0"]


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
