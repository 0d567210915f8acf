"""The example task's own command line (ImageClassifier on Fashion-MNIST): its flags, presets and files."""

import os
import sys

import pytest
import torch
import yaml

from app.fashion_mnist.model import ImageClassifier, load_network, network_state_dict
from app.fashion_mnist.networks import build_resnet
from tests import warm
from tests.conftest import CPU_TEST_CONFIG, ROOT
from tests.fashion_mnist.conftest import run_cli


def test_a_relative_data_dir_is_saved_as_the_folder_it_named(workdir, data_dir, caplog):
    """So that a run's config.yaml runs again from anywhere; the run says its batch size."""
    relative = os.path.relpath(data_dir, workdir)
    short = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1")
    with caplog.at_level("INFO"):
        run_cli("fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={relative}", *short)
    config = yaml.safe_load((workdir / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert config["data"]["data_dir"] == str(data_dir.absolute())
    assert "Batch size: 16 per device x 1 devices x 1 nodes = 16 per step" in caplog.text


@pytest.mark.slow
def test_checkpoint_loads_into_plain_network_with_same_predictions(workdir, data_dir):
    run_cli("fit", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir), "--trainer.max_epochs=1")
    ckpt_path = workdir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)  # plain data only

    net = build_resnet("resnet_tiny")
    net.load_state_dict(network_state_dict(checkpoint), strict=True)  # no "module." or wrapper prefixes
    assert not any(k.startswith(("module.", "_forward_module.")) for k in checkpoint["state_dict"])
    module = ImageClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)

    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        expected = module.eval()(x)
        assert torch.equal(net.eval()(x), expected)
        assert torch.equal(load_network(ckpt_path)(x), expected)


def test_the_d2l_preset_trains_with_plain_sgd_as_its_comment_says(workdir, capsys):
    """configs/d2l.yaml named only ``lr: 0.1``; LightningCLI merged that into the default optimizer's arguments, so
    "plain SGD" trained with momentum 0.9, Nesterov and weight decay 5e-4 (its measured 0.9126 too)."""
    with pytest.raises(SystemExit):
        run_cli("fit", "--config", str(ROOT / "configs" / "d2l.yaml"), "--print_config")
    optimizer = yaml.safe_load(capsys.readouterr().out)["model"]["optimizer"]
    assert optimizer["class_path"] == "torch.optim.SGD"
    assert {k: optimizer["init_args"][k] for k in ("lr", "momentum", "nesterov", "weight_decay")} == {
        "lr": 0.1,
        "momentum": 0.0,
        "nesterov": False,
        "weight_decay": 0.0,
    }


def test_print_config_reruns_to_the_same_config(workdir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--model.arch=resnet_tiny", "--data.batch_size=32", "--trainer.max_epochs=4", "--print_config")
    assert exit_info.value.code == 0
    first = capsys.readouterr().out
    (workdir / "printed.yaml").write_text(first)
    with pytest.raises(SystemExit):
        run_cli("fit", "--config", "printed.yaml", "--print_config")
    assert capsys.readouterr().out == first
    config = yaml.safe_load(first)
    assert config["model"]["arch"] == "resnet_tiny" and config["trainer"]["max_epochs"] == 4
    assert config["model"]["optimizer"]["class_path"] == "torch.optim.SGD"


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_parses(config, workdir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(config), "--print_config")
    assert exit_info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["arch"]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--model.arch=resnet19"], "error: --model.arch=resnet19: must be one of resnet18, resnet34, resnet50,"),
        (["--model.channels_last=maybe"], "error: --model.channels_last=maybe: expected true or false;"),
        (["--model.lr=0.1"], "error: unrecognized arguments: --model.lr=0.1 (did you mean --model.optimizer.lr?);"),
        (["--data.source=fashion_mnist", "--data.data_dir=."], "--data.source=synthetic"),
    ],
    ids=["choices", "bool", "optimizer argument", "no files"],
)
def test_a_wrong_option_of_the_example_is_one_plain_line(flags, want, workdir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--data.source=synthetic", *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and want in err and "Union" not in err


def test_bad_value_is_one_line_error_with_exit_2(workdir):
    result = warm.run(
        [sys.executable, str(ROOT / "cli.py"), "fit", "--data.batch_size=0", "--data.source=synthetic"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=workdir,
    )
    # the error is all the run prints: Lightning's "Seed set to 42" waits until the classes are built
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: --data.batch_size must be a positive integer, got 0"]
    assert not (workdir / "lightning_logs").exists()

    # the trainer's settings are checked right after parsing
    devices = [sys.executable, str(ROOT / "cli.py"), "fit", "--trainer.devices=0", "--data.source=synthetic"]
    result = warm.run(devices, capture_output=True, text=True, timeout=120, cwd=workdir)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: --trainer.devices=0: use a positive count, -1 or auto (all GPUs), or a list like [0,1]"
    ]

    # torch checks an optimizer's arguments when it builds one: the model builds it once before the run starts
    lr = [sys.executable, str(ROOT / "cli.py"), "fit", "--model.optimizer.lr=-0.1", "--data.source=synthetic"]
    result = warm.run(lr, capture_output=True, text=True, timeout=120, cwd=workdir)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: --model.optimizer: Invalid learning rate: -0.1"]
    assert not (workdir / "lightning_logs").exists()


def test_launch_presets_compose_with_the_full_recipe(workdir, capsys):
    for name, strategy, nodes in [
        ("ddp_4gpu", "ddp", 1),
        ("multinode_ddp", "ddp", 2),
        ("multinode_horovod", "horovod", 2),
    ]:
        with pytest.raises(SystemExit):
            run_cli(
                "fit",
                "--config",
                str(ROOT / "configs" / "fashion_mnist.yaml"),
                "--config",
                str(ROOT / "configs" / f"{name}.yaml"),
                "--print_config",
            )
        config = yaml.safe_load(capsys.readouterr().out)
        assert config["model"]["arch"] == "resnet18" and config["data"]["augment"] is True
        trainer = config["trainer"]
        assert (trainer["strategy"], trainer["num_nodes"], trainer["devices"]) == (strategy, nodes, 4)
        callbacks = [c["class_path"] for c in trainer["callbacks"]]
        assert callbacks == ["app.callbacks.LRWarmup"]  # the defaults are added when the trainer is built


def test_the_gpu_overlay_keeps_the_full_recipe_and_cuts_batches_on_the_device(workdir, capsys):
    """configs/gpu_fast.yaml over the recipe: the batches come from the device (measured fastest on an H200, issue
    44), which needs the loader in the training process: no workers."""
    with pytest.raises(SystemExit):
        run_cli(
            "fit", "--config", str(ROOT / "configs" / "fashion_mnist.yaml"),
            "--config", str(ROOT / "configs" / "gpu_fast.yaml"), "--print_config",
        )  # fmt: skip
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["data"]["on_device"] is True and config["data"]["num_workers"] == 0
    assert config["data"]["augment"] is True and config["model"]["arch"] == "resnet18"
    assert (config["model"]["compile_mode"], config["trainer"]["precision"]) == ("reduce-overhead", "bf16-mixed")


def test_cli_py_help_names_the_example_tools(tmp_path):
    """cli.py passes its task's tools to the machinery: --help names export beside plot, and export runs."""
    result = warm.run([sys.executable, str(ROOT / "cli.py"), "--help"], cwd=tmp_path, capture_output=True, text=True)
    out = " ".join(result.stdout.split())
    assert result.returncode == 0 and "'cli.py export --ckpt_path CKPT --out model.pt2'" in out and "cli.py plot" in out
    export = warm.run(
        [sys.executable, str(ROOT / "cli.py"), "export", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert export.returncode == 0 and "--ckpt_path" in export.stdout
