"""fit -> validate -> test -> predict through the real cli.py, on the tests' own task (tests/tiny.py)."""

import csv
import logging
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests import warm
from tests.conftest import ROOT, TINY_CONFIG, TINY_TASK, run_cli


def read_metrics(version_dir):
    with open(version_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def epoch_values(rows, key):
    return [float(r[key]) for r in rows if r.get(key)]


def fit_in_subprocess(workdir, *extra: str) -> subprocess.CompletedProcess:
    """``python cli.py fit`` on the tests' own task in its own process (tests/warm.py)."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), "--trainer.max_epochs=1", *extra]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(ROOT)}
    return warm.run(cmd, capture_output=True, text=True, timeout=300, cwd=workdir, env=env)


@pytest.mark.slow
def test_fit_validate_test_predict_through_cli(workdir):
    base = ["--config", str(TINY_CONFIG)]
    run_cli("fit", *base, "--trainer.max_epochs=3", "--trainer.limit_train_batches=12")

    version = workdir / "lightning_logs" / "version_0"
    checkpoints = sorted(p.name for p in (version / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and any(p.startswith("epoch=") for p in checkpoints)
    for name in ("config.yaml", "hparams.yaml", "metrics.csv"):
        assert (version / name).is_file()
    assert list(version.glob("events.out.tfevents.*"))  # TensorBoard (a dev dependency)
    assert not (workdir / "lightning_logs" / "version_1").exists()  # one run, one folder

    rows = read_metrics(version)
    losses = epoch_values(rows, "train/loss_epoch")
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert len(epoch_values(rows, "val/acc")) == 3
    assert yaml.safe_load((version / "hparams.yaml").read_text())["width"] == 4

    ckpt = str(version / "checkpoints" / "last.ckpt")
    run_cli("validate", *base, "--ckpt_path", ckpt)
    run_cli("test", *base, "--ckpt_path", ckpt)
    rows = read_metrics(workdir / "lightning_logs" / "version_2")
    (test_acc,) = epoch_values(rows, "test/acc")
    assert 0.0 <= test_acc <= 1.0
    run_cli("predict", *base, "--ckpt_path", ckpt)


def test_validate_without_ckpt_path_says_the_network_is_untrained(workdir, caplog):
    base = ["--config", str(TINY_CONFIG), "--trainer.limit_val_batches=1"]
    with caplog.at_level(logging.INFO):
        run_cli("validate", *base)
    assert (
        "no --ckpt_path: validate uses a freshly initialised, untrained network; pass --ckpt_path best" in caplog.text
    )


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--trainer.strategy=horovod", "--trainer.strategy.op=adasum"], {"op": "adasum", "fusion_mb": 25.0}),
        # a registered name with preset options keeps them; the user's own options come after and win
        (
            ["--trainer.strategy", "ddp_find_unused_parameters_true", "--trainer.strategy.timeout=0:10:00"],
            {"find_unused_parameters": True, "timeout": "0:10:00"},
        ),
        (["--trainer.strategy=ddp", "--trainer.strategy.timeout=600"], {"timeout": "0:10:00"}),  # in seconds
    ],
    ids=["horovod", "registry preset", "timeout in seconds"],
)
def test_a_strategy_name_takes_the_strategy_options(flags, want, workdir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(TINY_CONFIG), *flags, "--print_config")
    assert exit_info.value.code == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"].endswith(("HorovodStrategy", "DDPStrategy"))
    assert {k: strategy["init_args"][k] for k in want} == want


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (
            ["--trainer.strategy=horovod", "--trainer.strategy.op=median"],
            "error: --trainer.strategy.op=median: must be one of average, sum, adasum;",
        ),
        (
            ["--trainer.strategy=horovod", "--trainer.strategy.fusion=8"],
            "error: --trainer.strategy.fusion=8: HorovodStrategy has no option 'fusion' (did you mean fusion_mb?);",
        ),
        (
            ["--trainer.callbacks+=app.callbacks.DDPCommHook", "--trainer.callbacks.hook=int8"],
            "error: --trainer.callbacks.hook=int8: must be one of fp16, bf16, powersgd;",
        ),
        (
            ["--trainer.precision=bf16-mix"],
            "error: --trainer.precision=bf16-mix: must be one of 64, 32, 16, transformer-engine, "
            "transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, 32-true, 64-true, bf16;",
        ),
        (["--trainer.max_epochs=ten"], "error: --trainer.max_epochs=ten: expected a whole number;"),
        (["--trainer.gradient_clip_val=x"], "error: --trainer.gradient_clip_val=x: expected a number;"),
        (
            ["--trainer.callbacks+=app.callbacks.SyncBN"],
            "error: --trainer.callbacks: app.callbacks has no class 'SyncBN' "
            "(did you mean app.callbacks.SyncBatchNorm?);",
        ),
        # options that may be left unset (Literal[...] | None, int | None, list[int] | None): a union of their own
        (
            ["--trainer.strategy=fsdp", "--trainer.strategy.reduce_dtype=int8"],
            "error: --trainer.strategy.reduce_dtype=int8: must be one of float32, bfloat16, float16, float64;",
        ),
        (
            ["--trainer.strategy=pipeline", "--trainer.strategy.stages=two"],
            "error: --trainer.strategy.stages=two: expected a whole number;",
        ),
        (
            ["--trainer.strategy=pipeline", "--trainer.strategy.balance=[a,b]"],
            "error: --trainer.strategy.balance=['a', 'b']: expected a list of whole numbers;",
        ),
        (
            ["--trainer.strategy=pipeline", "--trainer.devices=2", "--trainer.strategy.balance=[2,2,1]"],
            "error: --trainer.strategy.balance=[2, 2, 1] gives the layers of 3 stages, one device each, but "
            "--trainer.devices=2 cannot hold them (devices = stages x replicas); give 1 or 2 numbers, or use a "
            "multiple of 3 devices",
        ),
    ],
    ids=[
        "choice",
        "typo",
        "callback choice",
        "choices of a union",
        "whole number",
        "number",
        "class path",
        "choice or unset",
        "whole number or unset",
        "list or unset",
        "balance for other devices",
    ],  # fmt: skip
)
def test_a_wrong_option_of_a_strategy_or_callback_is_one_plain_line(flags, want, workdir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(TINY_CONFIG), *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(want) and "Union" not in err and "NestedArg" not in err


@pytest.mark.slow
def test_torch_and_torchvision_of_two_builds_are_one_line(tmp_path):
    """pip mixing two indexes (a CPU torch, PyPI's CUDA torchvision) makes torchvision's first import fail with
    torch's "operator torchvision::nms does not exist" under 40 lines of traceback. A torchvision that fails the same
    way stands in for such an install (none can be made here)."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "--help"], capture_output=True, text=True, env=environ, timeout=120
    )
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: torchvision ") and "is not a build for torch " in line
    assert "operator torchvision::nms does not exist" in line and "--force-reinstall torch torchvision" in line


def test_cli_script_trains_as_a_user_runs_it(workdir):
    """The real entry point in a fresh interpreter: exit 0, the d2l-style epoch line, a checkpoint."""
    result = fit_in_subprocess(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "epoch 0 | train loss" in output
    assert re.search(r"samples/s \| [\d.]+ ms/step \| 1 x cpu \(single_device\)", output), output[-2000:]
    assert output.count("Seed set to 42") == 1  # held back while the classes are built, then printed once
    assert (workdir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "ddp", "ddp_spawn", "horovod"])
def test_one_run_writes_one_log_folder_whatever_the_strategy(strategy, workdir):
    """Only rank 0 writes: one version folder, one metrics.csv, one last.ckpt, for every strategy."""
    result = fit_in_subprocess(workdir, f"--trainer.strategy={strategy}", "--trainer.devices=2")
    assert result.returncode == 0, result.stderr[-3000:]
    logs = workdir / "lightning_logs"
    assert [p.name for p in logs.iterdir()] == ["version_0"]
    assert len(list(logs.rglob("metrics.csv"))) == 1 and len(list(logs.rglob("last.ckpt"))) == 1
    assert len(list(logs.rglob("config.yaml"))) == 1
    assert f"2 x cpu ({strategy})" in result.stdout + result.stderr


YAML_MISTAKES = {
    "choice": (
        "trainer:\n  strategy:\n    class_path: app.strategies.HorovodStrategy\n    init_args:\n      op: adasumm\n",
        "trainer.strategy.init_args.op: adasumm: must be one of average, sum, adasum;",
    ),
    "typo": (
        "trainer:\n  strategy:\n    class_path: app.strategies.HorovodStrategy\n    init_args:\n      opp: adasum\n",
        "trainer.strategy.init_args.opp: HorovodStrategy has no option 'opp' (did you mean op?);",
    ),
    "callback typo": (
        "trainer:\n  callbacks:\n    - class_path: app.callbacks.LRWarmup\n      init_args:\n        warmup_stepz: 3\n",
        "trainer.callbacks.init_args.warmup_stepz: LRWarmup has no option 'warmup_stepz' (did you mean warmup_steps?);",
    ),
    "choice or unset": (
        "trainer:\n  strategy:\n    class_path: app.strategies.FSDPStrategy\n    init_args:\n"
        "      reduce_dtype: int8\n",
        "trainer.strategy.init_args.reduce_dtype: int8: must be one of float32, bfloat16, float16, float64;",
    ),
    "model typo": (
        "model:\n  class_path: tests.tiny.TinyClassifier\n  init_args:\n    widht: 3\n",
        "model.init_args.widht: TinyClassifier has no option 'widht' (did you mean width?);",
    ),
}


@pytest.mark.parametrize("mistake", YAML_MISTAKES)
def test_the_same_mistakes_in_a_yaml_file_name_the_file_the_key_and_the_fix(mistake, workdir, capsys):
    """As on the command line, not "--trainer.strategy=adasumm Given value type: <class 'dict'>" or jsonargparse's
    union wall (issue 34, item 11)."""
    text, want = YAML_MISTAKES[mistake]
    (workdir / "mine.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(TINY_CONFIG), "--config", "mine.yaml")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: mine.yaml: {want}"), err
    assert "Union" not in err and "Given value" not in err


def test_rerunning_a_runs_config_yaml_keeps_that_run_and_logs_to_a_new_folder(workdir, caplog):
    """A run's config.yaml names its logger version; run again with --config, it must not write into (and so
    delete the logs of) that earlier run."""
    run_cli("fit", "--config", str(TINY_CONFIG), "--trainer.max_epochs=1")
    v0 = workdir / "lightning_logs" / "version_0"
    before = {p.relative_to(v0): p.read_bytes() for p in v0.rglob("*") if p.is_file()}
    assert yaml.safe_load((v0 / "config.yaml").read_text())["trainer"]["logger"][0]["init_args"]["version"] == 0
    with caplog.at_level("INFO"):
        run_cli("fit", "--config", str(v0 / "config.yaml"), "--trainer.max_epochs=1")
    assert "lightning_logs/version_0 holds an earlier run" in caplog.text
    assert {p.relative_to(v0): p.read_bytes() for p in v0.rglob("*") if p.is_file()} == before
    v1 = workdir / "lightning_logs" / "version_1"
    assert read_metrics(v1) and (v1 / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize(
    ("argv", "built"),
    [
        (["fit", "--print_config"], ["fit"]),
        (["predict", "--print_config"], ["predict"]),
        (["--help"], ["fit", "validate", "test", "predict"]),  # the top-level help lists them all
    ],
)
def test_only_the_subcommand_asked_for_gets_a_parser(argv, built, monkeypatch, capsys):
    """Each subcommand's parser takes about 0.2 s to build; ``cli.py fit`` needs fit's only."""
    from app.run.cli import Parser, main

    seen = []
    add = Parser.add_method_arguments
    monkeypatch.setattr(
        Parser, "add_method_arguments", lambda self, k, name, **kw: seen.append(name) or add(self, k, name, **kw)
    )
    with pytest.raises(SystemExit) as exit_info:
        main(argv, **TINY_TASK)
    assert exit_info.value.code in (0, None)
    assert seen == built
    assert "fit" in capsys.readouterr().out


def test_more_cpu_devices_than_cores_run_with_one_line_that_says_the_cost(workdir):
    """``--trainer.devices=3 --trainer.strategy=ddp`` on a 2-core CPU ran oversubscribed without a word, while the
    docs said more devices than the machine has were refused. On a CPU a device is a process (a thread under dp),
    so it runs, with one ``warning:`` line; as many devices as cores say nothing."""
    import warnings

    from app.errors import TemplateWarning
    from app.run.checks import usable_cores

    cores = usable_cores()
    short = ("--config", str(TINY_CONFIG), "--trainer.strategy=dp", "--trainer.max_steps=1")
    short += ("--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false")
    expected = (
        f"--trainer.devices={cores + 1}: {cores + 1} CPU devices on {cores} cores; the threads of one process take "
        f"turns on the cores, so this run is slower than with --trainer.devices={cores} or fewer "
        "(docs/strategies.md, devices on a CPU)"
    )
    for devices, said in ((cores + 1, [expected]), (cores, [])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_cli("fit", *short, f"--trainer.devices={devices}")
        assert [str(w.message) for w in caught if issubclass(w.category, TemplateWarning)] == said, devices


def test_a_bar_that_max_steps_stops_inside_an_epoch_ends_at_the_batches_it_trained(workdir, capsys):
    """Redirected output keeps the bar's last drawing: after ``max_steps=2`` it said ``1/8 ... 0.00it/s`` (the bar
    redraws twice a second, and the last batch of an epoch only). It now ends at the batches trained, with a rate."""
    args = ("--config", str(TINY_CONFIG), "--trainer.max_steps=2", "--trainer.enable_progress_bar=true")
    run_cli("fit", *args, "--trainer.logger=false", "--trainer.enable_checkpointing=false")
    [bar] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch 0/")][-1:]
    rate = re.search(r" 2/8 .* ([\d.]+)it/s", bar)
    assert rate and float(rate[1]) > 0, bar  # (a substring test took "50.00it/s" for "0.00it/s")


def test_ranks_that_mpirun_bound_to_cores_of_their_own_are_not_called_oversubscribed(monkeypatch):
    """mpirun binds each of a node's ranks to a core of its own: a rank's affinity (1 core) against the node's
    devices (2) said "2 CPU devices on 1 cores" on every rank of docs/multi-node.md's mpirun command, on a node with
    a core per rank."""
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator

    from app.run import checks

    trainer = SimpleNamespace(accelerator=CPUAccelerator(), num_devices=2, strategy=None)
    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(checks.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(checks, "mpi_world_size", lambda: 2)
    assert checks.cpu_oversubscription(trainer) is None
    monkeypatch.setattr(checks, "mpi_world_size", lambda: 1)  # not bound by a launcher: 2 processes on 1 core
    monkeypatch.setattr(checks, "parallelism", lambda strategy: SimpleNamespace(devices_per_process=1))
    assert checks.cpu_oversubscription(trainer).startswith("--trainer.devices=2: 2 CPU devices on 1 cores")
