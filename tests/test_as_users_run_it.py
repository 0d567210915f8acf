"""The template as people run it: cli.py started from another folder than the run's root, classes defined in the
user's own script, Lightning's standard switches beside ours, a terminal read off the screen, stderr read for noise.

Each test's first run is a fresh interpreter, as a person starts it: import-time warnings and the module search
path are part of what is tested. A test's later runs of cli.py (a second root, a resume, a refused rerun) are
forked from a warm interpreter (tests/warm.py), which is the same run less 7 CPU-seconds of imports.
"""

import contextlib
import fcntl
import json
import logging
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Callback

from app.checkpoints.io import load_checkpoint
from app.run.cli import main
from app.run.plot import epoch_metrics
from tests import warm
from tests.conftest import ROOT, TINY_CONFIG, TINY_TASK

pytestmark = pytest.mark.slow

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
NOISE = ("warning", "deprecated", "tip:", "traceback", "recommended")


def cli_command(*args: str) -> list[str]:
    """``python cli.py fit`` on the tests' own task (tests/tiny.yaml), one epoch of 4 steps."""
    cli = (sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG))
    return [*cli, "--trainer.max_epochs=1", "--trainer.limit_train_batches=4", *args]


def run(
    cmd: list[str],
    cwd: Path,
    timeout: float = 240,
    fresh: bool = True,
    env: dict | None = None,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """``cmd`` in a fresh interpreter, or forked from a warm one (``fresh=False``) for a test's later runs. With
    ``log``, stdout goes into that file, as ``> log`` sends it (the result's ``stdout`` is the file's text)."""
    # PYTHONPATH: a YAML config may name tests.test_as_users_run_it.Marker (a user's own module on the path).
    environ = {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT), **(env or {})}
    launch = subprocess.run if fresh else warm.run
    if log is None:
        return launch(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)
    with log.open("w") as out:
        result = launch(cmd, cwd=cwd, env=environ, stdout=out, stderr=subprocess.PIPE, text=True, timeout=timeout)
    result.stdout = log.read_text()
    return result


def noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(word in line.lower() for word in NOISE)]


class Marker(Callback):
    """A user's own callback, named in a YAML config: leaves a file behind when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(str(trainer.global_step))


# ------------------------------------------------------------------------------------------------ where runs land
def test_runs_land_under_default_root_dir_and_resume_from_there(tmp_path):
    """Logs and checkpoints under --trainer.default_root_dir, not the working directory; two roots, two version_0;
    --ckpt_path last finds the root's run, continues in a new folder, and plot joins the two; ddp's stderr is clean."""
    elsewhere, root, other = tmp_path / "elsewhere", tmp_path / "root", tmp_path / "other"
    elsewhere.mkdir()
    first = run(
        cli_command(f"--trainer.default_root_dir={root}", "--trainer.strategy=ddp", "--trainer.devices=2"),
        cwd=elsewhere,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert noise(first.stderr) == [], noise(first.stderr)
    assert (root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert (root / "lightning_logs" / "version_0" / "metrics.csv").is_file()
    assert not (elsewhere / "lightning_logs").exists()

    second = run(cli_command(f"--trainer.default_root_dir={other}"), cwd=elsewhere, fresh=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (other / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()

    resumed = run(
        cli_command(f"--trainer.default_root_dir={root}", "--trainer.max_epochs=2", "--ckpt_path=last"),
        cwd=elsewhere,
        fresh=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert noise(resumed.stderr) == [], noise(resumed.stderr)  # no "dirpath changed"
    assert f"resuming from {root}/lightning_logs/version_0/checkpoints/last.ckpt" in resumed.stderr + resumed.stdout
    version_1 = root / "lightning_logs" / "version_1"
    config = yaml.safe_load((version_1 / "config.yaml").read_text())
    assert config["ckpt_path"] == str(root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert [epoch for epoch, _ in epoch_metrics(version_1)["val/acc"]] == [0, 1]  # both runs' epochs

    best = run(
        [sys.executable, str(ROOT / "cli.py"), "test", "--config", str(TINY_CONFIG),
         f"--trainer.default_root_dir={root}", "--ckpt_path=best"],
        cwd=elsewhere,
        fresh=False,
    )  # fmt: skip
    assert best.returncode == 0, best.stderr[-3000:]
    assert "--ckpt_path best: " in best.stderr + best.stdout and "epoch=" in best.stderr + best.stdout


def test_make_train_trains_and_then_shows_the_test_accuracy_of_the_run(tmp_path):
    """README's first command ended at the last epoch's val acc while its comment quoted a test accuracy. ``make
    train`` now tests the run's last checkpoint after the fit (``TEST=0``: fit only), with the user's ARGS on both."""
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = f"ARGS=--trainer.default_root_dir={root} --trainer.max_epochs=1"
    done = subprocess.run(["make", "-s", "train", f"CONFIG={TINY_CONFIG}", args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert f"--ckpt_path last: {root}/lightning_logs/version_0/checkpoints/last.ckpt" in output, output[-3000:]
    assert re.search(r"test/acc\s*│\s*[\d.]+", output), output[-3000:]  # Lightning's results table
    assert sorted(p.name for p in (root / "lightning_logs").iterdir()) == ["version_0", "version_1"]
    fit_only = subprocess.run(["make", "-n", "train", "TEST=0"], cwd=ROOT, capture_output=True, text=True)
    runs = [line.split()[1:3] for line in fit_only.stdout.splitlines() if " cli.py " in line]
    assert runs == [["cli.py", "fit"]], fit_only.stdout


@pytest.mark.parametrize(
    "switch, expect",
    [
        ("--trainer.enable_checkpointing=false", "lightning_logs/version_0/metrics.csv"),
        ("--trainer.fast_dev_run=true", None),
    ],
)
def test_lightning_switches_work_beside_the_default_callbacks(switch, expect, tmp_path):
    root = tmp_path / "root"
    result = run(cli_command(f"--trainer.default_root_dir={root}", switch), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert noise(result.stderr) == [], noise(result.stderr)
    if expect:
        assert (root / expect).is_file()
    if "checkpointing" in switch:
        assert not list(root.rglob("*.ckpt"))
    if "fast_dev_run" in switch:  # "logging and checkpointing is suppressed": no file, no empty run folder that a
        assert not root.exists() or not list(root.iterdir())  # later --ckpt_path last would resume from


def test_a_bf16_mixed_run_shows_its_model_summary_without_a_warning(tmp_path):
    """Lightning warns that the summary does not support bf16-mixed; the parameters are float32 under mixed
    precision, as the summary assumes, so app/launch/library_noise.py silences it."""
    root = tmp_path / "root"
    flags = ("--trainer.precision=bf16-mixed", "--trainer.enable_model_summary=true")
    result = run(cli_command(f"--trainer.default_root_dir={root}", *flags), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Total params" in result.stdout + result.stderr  # the summary is there
    assert "not supported by the model summary" not in result.stderr
    assert noise(result.stderr) == [], noise(result.stderr)


def test_without_a_logger_a_second_run_never_overwrites_the_first_and_a_resume_continues_it(tmp_path):
    """``--trainer.logger=false``: no run folder, so Lightning writes checkpoints straight into ROOT/checkpoints. A
    second fresh run there is one line and leaves them as they were (it overwrote them, or died on config.yaml
    with a traceback); ``--ckpt_path last`` continues the run there, quietly."""
    root = tmp_path / "root"
    command = cli_command(f"--trainer.default_root_dir={root}", "--trainer.logger=false")
    first = run(command, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert noise(first.stderr) == [], noise(first.stderr)
    last = root / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    assert not (root / "config.yaml").exists()  # no run folder to put it in; not into the root itself

    again = run(command, cwd=tmp_path, fresh=False)
    assert again.returncode == 2, again.stderr[-3000:]
    (line,) = again.stderr.strip().splitlines()
    assert "Traceback" not in again.stderr
    assert f"error: {root / 'checkpoints'}: holds an earlier run's checkpoints" in line and "--ckpt_path last" in line
    assert last.read_bytes() == before

    resumed = run(command + ["--trainer.max_epochs=3", "--ckpt_path=last"], cwd=tmp_path, fresh=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert noise(resumed.stderr) == [], noise(resumed.stderr)
    assert load_checkpoint(last)["epoch"] == 2
    assert "its checkpoints go on in the same folder (no logger)" in resumed.stdout + resumed.stderr
    assert "version folder" not in resumed.stdout + resumed.stderr and not (root / "lightning_logs").exists()


def test_a_yaml_callbacks_list_keeps_the_default_callbacks(tmp_path):
    """A config's own callbacks come on top of the defaults; a callback of a default's kind replaces that default;
    --drop_callbacks leaves one out, and a misspelt name there is one line."""
    root = tmp_path / "root"
    marker = tmp_path / "marker.txt"
    config = tmp_path / "mine.yaml"
    own = {"class_path": "tests.test_as_users_run_it.Marker", "init_args": {"path": str(marker)}}
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [own]}}))
    result = run(cli_command("--config", str(config), f"--trainer.default_root_dir={root}"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.read_text() == "4"
    assert (root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()  # default ModelCheckpoint
    assert "Run report" in result.stdout  # default RunReport

    mine = tmp_path / "my_checkpoints"
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(mine)}}
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [own, checkpoint]}}))
    args = ("--config", str(config), f"--trainer.default_root_dir={root}", "--drop_callbacks=[RunReport]")
    result = run(cli_command(*args), cwd=tmp_path, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(mine.glob("*.ckpt")) and not (root / "lightning_logs" / "version_1" / "checkpoints").exists()
    assert "Run report" not in result.stdout

    result = run(cli_command("--drop_callbacks=[RunReprt]"), cwd=tmp_path, fresh=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1:] == [
        "error: --drop_callbacks: 'RunReprt' is not a default callback (did you mean RunReport?); they are "
        "ProgressBar, RichModelSummary, LearningRateMonitor, ModelCheckpoint, RunReport, PredictionWriter, "
        "Elastic, Preemption, RandomState, ResumeSettings, StopOnNonFinite, TrackerRuns"
    ]


def test_an_error_raised_in_the_tasks_own_init_shows_the_tasks_traceback(tmp_path):
    """A ValueError from the task's own ``__init__`` (tests/tiny.py refuses ``--model.norm=foo``) arrived inside
    about 70 lines of jsonargparse's union error; it is Python's traceback of the task's own frames now, with its
    own message last, and no run folder is left."""
    result = run(cli_command("--model.norm=foo", f"--trainer.default_root_dir={tmp_path / 'runs'}"), cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "ValueError: --model.norm must be 'batch' or 'group', got 'foo'", result.stderr[-3000:]
    assert f'File "{ROOT / "tests" / "tiny.py"}", line' in result.stderr and "jsonargparse" not in result.stderr
    assert len(lines) < 20 and not (tmp_path / "runs").exists()


def test_compiling_on_a_cpu_does_not_warn_of_a_missing_cuda_runtime(caplog):
    """``--model.compile=true`` on a CPU machine with a CUDA toolkit installed printed torch's "No CUDA runtime is
    found, using CUDA_HOME=..." (inductor looks for the toolkit): app/launch/library_noise.py drops that line, and only
    that one."""
    log = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING):
        log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        log.warning("another warning")
    assert [record.getMessage() for record in caplog.records] == ["another warning"]


# ------------------------------------------------------------------------------------------------ CLI traps
def one_line_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args), **TINY_TASK)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_cli_mistakes_get_one_line_with_the_fix(capsys, tmp_path):
    tiny = ("fit", "--config", str(TINY_CONFIG))
    assert "did you mean --trainer.max_epochs?" in one_line_error(capsys, *tiny, "--trainer.max_epoch=1")
    assert "has no option 'lrr' (did you mean lr?)" in one_line_error(capsys, *tiny, "--model.lrr=0.1")
    # run from another folder, the help it points to is the script's path as typed
    typo = run([sys.executable, str(ROOT / "cli.py"), "fit", "--trainer.max_epoch=1"], cwd=tmp_path)
    assert typo.returncode == 2
    assert typo.stderr.strip().endswith(f"; see: python {ROOT / 'cli.py'} fit --help"), typo.stderr


def test_help_names_the_tools_and_what_ckpt_path_takes(capsys, tmp_path):
    """--help names the machinery's tools (plot, consolidate) and those a task's cli.py passes in, which then run."""
    tools = {"draw": ("app.run.plot", "'cli.py draw RUN' draws the run")}
    with pytest.raises(SystemExit):
        main(["--help"], **TINY_TASK, tools=tools)
    out = " ".join(capsys.readouterr().out.split())
    assert "cli.py plot lightning_logs/version_N" in out and "'cli.py draw RUN' draws the run" in out
    assert "'cli.py consolidate CKPT' makes one file of fsdp's sharded checkpoint" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["drwa"], **TINY_TASK, tools=tools)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: unknown subcommand 'drwa' (did you mean draw?): choose from fit, validate, test, predict, plot, "
        "consolidate, draw; see cli.py --help"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["draw", str(tmp_path)], **TINY_TASK, tools=tools)
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {tmp_path / 'metrics.csv'}: not found; give a run folder such as lightning_logs/version_0"
    )
    with pytest.raises(SystemExit):
        main(["fit", "--help"], **TINY_TASK)
    out = " ".join(capsys.readouterr().out.split())
    ckpt_help = out[out.index("--ckpt_path CKPT_PATH Checkpoint") :][:400]
    assert "'last'" in ckpt_help and "'best'" in ckpt_help and "lightning_logs/version_N/checkpoints/" in ckpt_help


def test_dp_run_report_names_each_device(tmp_path):
    result = run(cli_command("--trainer.strategy=dp", "--trainer.devices=2"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "│" in line and "cpu" in line]
    assert len(rows) == 2 and "cpu:0" in rows[0] and "cpu:1" in rows[1], result.stdout[-2000:]


# ------------------------------------------------------------------------------------------------ the user's script
USER_SCRIPT = """
    import argparse
    import sys
    import warnings

    import torch
    from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from app.strategies import register

    register()  # puts horovod (and dp, fsdp, pipeline) in Lightning's StrategyRegistry

    # Parsed at import, as many scripts do: each rank imports this module again and must see the same arguments.
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    ARGS = parser.parse_args()


    class Model(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            if batch_idx == 0 and self.global_rank == 0:
                warnings.warn("the user's own warning")
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)


    class Data(LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
            return DataLoader(data, batch_size=4)


    class Steps(Callback):
        def on_train_end(self, trainer, pl_module):
            print(f"rank {trainer.global_rank} trained {trainer.global_step} steps")


    def main():
        model = Model()
        before = model.net.weight.detach().clone()
        trainer = Trainer(
            strategy="horovod", devices=2, accelerator="cpu", max_epochs=ARGS.epochs, callbacks=[Steps()], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model, Data())
        print("weights changed:", not torch.equal(before, model.net.weight))


    if __name__ == "__main__":
        main()
"""


@pytest.mark.parametrize("how", ["script", "module"])
def test_horovod_self_launch_runs_classes_from_the_users_own_script(how, tmp_path):
    (tmp_path / "user_train.py").write_text(textwrap.dedent(USER_SCRIPT))
    cmd = [sys.executable, "user_train.py"] if how == "script" else [sys.executable, "-m", "user_train"]
    result = run([*cmd, "--epochs", "2"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # the ranks parsed the caller's own arguments at import (2 epochs x 4 steps), as under ddp_spawn
    assert "rank 0 trained 8 steps" in result.stdout and "rank 1 trained 8 steps" in result.stdout
    assert "weights changed: True" in result.stdout  # rank 0's weights came back to the caller's model
    assert "the user's own warning" in result.stderr  # our filters are narrow


# ------------------------------------------------------------------------------------------------ horovod faults
def rank_processes(job_marker: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if job_marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "SIGKILL"])
def test_stopping_a_self_launched_horovod_run_leaves_no_rank_behind(how, tmp_path):
    """SIGTERM to the launcher, or SIGINT to its whole process group as Ctrl-C in a terminal sends it: the ranks
    checkpoint, rank 0 says so, and the run exits 128 + signal, without an mpirun abort or error box. SIGKILL of the
    launcher: mpirun and the ranks go too. Either way no rank keeps running and the launch folder is removed; the
    redirected log has no escape codes."""
    signum = signal.SIGINT if how == "Ctrl-C" else signal.Signals[how]
    root, log = tmp_path / "root", tmp_path / "run.log"
    cmd = cli_command(f"--trainer.default_root_dir={root}", "--trainer.strategy=horovod", "--trainer.devices=2",
        "--trainer.max_epochs=1000", "--trainer.enable_progress_bar=true",
    )  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env={**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        last = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        wait_for(lambda: last.exists() or process.poll() is not None, 240, "the first epoch's checkpoint")
        assert process.poll() is None, log.read_text()[-3000:]
        launches = launch_folders_of(process.pid)  # other tests may be launching at the same time
        assert len(launches) == 1
        (launch,) = launches
        assert len(rank_processes(str(launch))) >= 2
        stamp = last.stat().st_mtime_ns
        if how == "Ctrl-C":
            os.killpg(process.pid, signum)  # the terminal signals its foreground process group
        else:
            process.send_signal(signum)
        code = process.wait(timeout=60)
        wait_for(lambda: not rank_processes(str(launch)), 30, "the ranks to exit")
        # SIGKILL: mpirun ends the ranks, and the launcher's reaper removes the folder with the pickled job then,
        # not at the next launch (issue 34, item 9)
        wait_for(lambda: not launch.exists(), 70, "the launch folder to be removed")
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "\x1b" not in text
    if signum != signal.SIGKILL:
        assert code == 128 + signum, text[-3000:]
        name = signal.Signals(signum).name
        assert re.search(rf"{name}: stopped (in the validation )?after step", text), text[-3000:]  # (as it landed)
        assert last.stat().st_mtime_ns > stamp  # the stop's own checkpoint
        assert "Abort is in progress" not in text and "non-zero status" not in text, text[-3000:]
    else:
        assert code == -signal.SIGKILL


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_sent_while_the_horovod_ranks_start_is_not_lost(signum, tmp_path):
    """SIGTERM/SIGINT to the launcher in the first seconds of mpirun's start, before any rank wrote its pid: the
    signal waits for the ranks and they stop before training; it was swallowed, and the ranks trained every epoch
    (issue 34, item 6)."""
    root, log = tmp_path / "root", tmp_path / "run.log"
    cmd = cli_command(f"--trainer.default_root_dir={root}", "--trainer.strategy=horovod", "--trainer.devices=2",
        "--trainer.max_epochs=1000",
    )  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(
            cmd, cwd=tmp_path, env={**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=out
        )
    try:
        started = lambda: [f for f in launch_folders_of(process.pid) if (f / "job.pkl").exists()]  # noqa: E731
        wait_for(lambda: started() or process.poll() is not None, 120, "mpirun's start")
        (launch,) = started()
        assert not list(launch.glob("rank-*.pid")), "the ranks started too fast for this test"
        process.send_signal(signum)
        code = process.wait(timeout=120)
        wait_for(lambda: not rank_processes(str(launch)), 30, "the ranks to exit")
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert code == 128 + signum, text[-3000:]
    name = signal.Signals(signum).name
    assert re.search(rf"{name}: stopped (before training|after step 1\b)", text), text[-3000:]
    assert not launch.exists()


def test_a_stopped_horovod_rank_does_not_outlive_its_launcher(tmp_path):
    """Rank 1 stops itself (SIGSTOP) after step 2: nothing fails, rank 0's collective with it waits for good, so rank
    0's watchdog writes the state after step 2 from its own thread, and the launcher restarts from it on one rank. A
    stopped process ignores mpirun's SIGTERM: it lived on and wrote last.ckpt after the launcher had spoken; the
    launcher SIGKILLs what is left of its ranks before it says anything (issue 34, item 9), so no rank of the run is
    left, stopped or not."""
    root = tmp_path / "root"
    stop = {"class_path": "tests.faults.Fault", "init_args": {"at": "step", "step": 2, "action": "sigstop", "rank": 1}}
    cmd = cli_command(f"--trainer.default_root_dir={root}", "--trainer.strategy=horovod", "--trainer.devices=2",
        "--trainer.strategy.max_restarts=1", "--watchdog.timeout=2", "--trainer.callbacks+=" + json.dumps(stop),
    )  # fmt: skip
    # The run's own temporary folder holds its launch folder, which each rank's command line names: the ranks of
    # this run, not those of a test beside it in another pytest worker
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    result = run(cmd, tmp_path, timeout=200, env={"TMPDIR": str(own_tmp)})
    output = result.stdout + result.stderr
    saved = re.search(r"\[rank 0\] Saved the state after step 2 to \S+last\.ckpt; the launcher restarts", output)
    assert saved, output[-3000:]  # from rank 0's watchdog thread: its collective with rank 1 hangs
    assert not rank_processes(str(own_tmp))  # no rank of this run left, stopped or not
    # mpirun's exit orphans the ranks' process group, and the kernel wakes the stopped rank (SIGCONT): its next
    # collective fails and it may save the same state after step 2 before the launcher's SIGKILL lands (within the
    # launcher's poll of mpirun). Then no rank is lost, and the restart is on both (a fresh-clone run at 52f1ab0).
    restart = re.search(
        r"horovod: (rank\(s\) 1 lost|no rank lost) .* restart 1 of at most 1 on ([12]) rank\(s\)", output
    )
    assert result.returncode == 0 and restart, output[-3000:]
    assert (restart.group(1) == "no rank lost") == (restart.group(2) == "2"), restart.group(0)


@pytest.mark.parametrize("moment", ["kill_before_replace", "kill_after_replace"])
def test_a_horovod_rank_killed_in_its_save_leaves_what_the_launcher_says(moment, tmp_path):
    """Rank 1 dies after step 2; rank 0's collective fails and it saves the state of step 2, and is SIGKILLed in that
    save, just before or just after the rename that puts last.ckpt in place: where the launcher's SIGKILL of a rank
    left after mpirun (woken by the kernel when mpirun exits) can land. Before the rename: no rank saved, and nothing
    is left of the save (not even its temporary file). After it: the launcher restarts from that last.ckpt. The rank
    reported its save only after the rename, and a kill in between had the launcher say that no rank saved the state
    while last.ckpt was there (the stopped-rank test above, once in CI)."""
    root = tmp_path / "root"
    lose = {"class_path": "tests.faults.Fault", "init_args": {"at": "step", "step": 2, "action": "kill", "rank": 1}}
    die = {"class_path": "tests.faults.Fault", "init_args": {"at": "save", "step": 2, "action": moment, "rank": 0}}
    cmd = cli_command(f"--trainer.default_root_dir={root}", "--trainer.strategy=horovod", "--trainer.devices=2",
        "--trainer.strategy.max_restarts=1", "--trainer.callbacks+=" + json.dumps(lose),
        "--trainer.callbacks+=" + json.dumps(die),
    )  # fmt: skip
    result = run(cmd, tmp_path, timeout=200)
    output = result.stdout + result.stderr
    checkpoints = root / "lightning_logs" / "version_0" / "checkpoints"
    if moment == "kill_before_replace":
        assert result.returncode == 1, output[-3000:]
        assert "No rank saved the state after a step, so the ranks are not restarted" in output, output[-3000:]
        assert not checkpoints.exists() or not list(checkpoints.iterdir())  # no last.ckpt, no hidden .tmp
    else:
        assert result.returncode == 0, output[-3000:]
        assert f"restart 1 of at most 1 on 1 rank(s), resuming from {checkpoints / 'last.ckpt'}" in output, output
        assert "No rank saved" not in output


def launch_folders_of(pid: int) -> list[Path]:
    """The self-launch folders (app.strategies.launchers.mpirun) of the launcher process ``pid``."""
    found = []
    for folder in Path(tempfile_dir()).glob("horovod-launch-*"):
        with contextlib.suppress(OSError):
            if (folder / "launcher.pid").read_text() == str(pid):
                found.append(folder)
    return found


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


# ------------------------------------------------------------------------------------------------ the terminal
def _own_terminal() -> None:
    """In the child: a session whose controlling terminal is the pty on stdin, as a shell gives a command."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def screen(
    cmd: list[str],
    cwd: Path,
    columns: int,
    rows: int = 40,
    timeout: float = 240,
    ctrl_c_after: bytes | None = None,
    ctrl_c_delay: float = 0.0,
) -> tuple[int, list[str]]:
    """Run ``cmd`` in a pseudo-terminal of ``columns`` x ``rows`` and return its exit code and what a person sees
    at the end (scrollback and screen), as a VT100 terminal draws it. With ``ctrl_c_after``, Ctrl-C is typed
    ``ctrl_c_delay`` seconds after that text has been printed (the terminal then sends SIGINT to the command's
    process group)."""
    import pyte

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {**os.environ, **MPI_ENV, "COLUMNS": str(columns), "LINES": str(rows), "TERM": "xterm-256color"}
    env["PYTHONPATH"] = str(ROOT)  # the tests' own task
    process = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdin=secondary, stdout=secondary, stderr=secondary, preexec_fn=_own_terminal
    )
    os.close(secondary)
    output = bytearray()
    deadline = time.monotonic() + timeout
    ctrl_c_at = None
    while True:
        assert time.monotonic() < deadline, "timed out"
        if ctrl_c_at is not None and time.monotonic() >= ctrl_c_at:
            os.write(primary, b"\x03")
            ctrl_c_at = None
        ready, _, _ = select.select([primary], [], [], 0.5 if ctrl_c_at is None else 0.05)
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the other side closed
                chunk = b""
            if not chunk:
                break
            output += chunk
            if ctrl_c_after is not None and ctrl_c_after in output:
                ctrl_c_at = time.monotonic() + ctrl_c_delay
                ctrl_c_after = None
        elif process.poll() is not None:
            break
    code = process.wait(timeout=30)
    os.close(primary)
    terminal = pyte.HistoryScreen(columns, rows, history=100000)
    pyte.Stream(terminal).feed(output.decode("utf-8", "replace"))
    lines = ["".join(row[x].data for x in range(columns)).rstrip() for row in terminal.history.top]
    return code, lines + [line.rstrip() for line in terminal.display]


@pytest.mark.parametrize("columns", [80, 100, 160])
def test_the_terminal_keeps_every_epoch_line_and_the_whole_run_report(columns, tmp_path):
    cmd = cli_command(
        "--trainer.max_epochs=3", "--trainer.enable_progress_bar=true", "--drop_callbacks=[RichModelSummary]"
    )
    code, lines = screen(cmd, tmp_path, columns)
    text = "\n".join(lines)
    assert code == 0, text[-3000:]
    for epoch in range(3):
        assert sum(line.startswith(f"epoch {epoch} | train loss") for line in lines) == 1, text
    title = next(i for i, line in enumerate(lines) if "Run report" in line)
    table = lines[title + 1 : title + 6]
    assert table[0].startswith("┏") and "rank" in table[1] and table[4].startswith("└"), text
    assert "cpu" in table[3] and "12" in table[3]  # its one row: 3 epochs x 4 steps
    # Lightning's own lines (its logger writes to stderr) are not drawn over by the bar, nor the bar left twice
    assert lines.count("`Trainer.fit` stopped: `max_epochs=3` reached.") == 1, text
    (bar,) = [i for i, line in enumerate(lines) if line.startswith("Epoch 2/2")]
    assert bar < title, text  # the finished bar stays above the report, not redrawn below it
    assert "0.00it/s" not in lines[bar], text  # rich had two updates of the bar to measure its speed


def test_ctrl_c_in_a_terminal_says_what_it_does_above_the_bar(tmp_path):
    """The "received SIGINT" line waits for the end of the step while the bar is live (a line written at once
    would be drawn over), then the stop line; one bar stays on the screen."""
    cmd = cli_command("--trainer.max_epochs=1000", "--trainer.enable_progress_bar=true")
    code, lines = screen(cmd, tmp_path, 160, ctrl_c_after=b"epoch 1 | train loss")
    text = "\n".join(lines)
    assert code == 130, text[-3000:]
    received = (
        "[rank 0] received SIGINT: stopping after this step, with a checkpoint if every rank finishes it "
        "(Ctrl-C again: stop now)"
    )
    assert lines.count(received) == 1, text
    stopped = [i for i, line in enumerate(lines) if re.match(r"SIGINT: stopped (in the validation )?after step", line)]
    assert len(stopped) == 1 and lines.index(received) < stopped[0], text
    assert sum(line.startswith("Epoch ") for line in lines) == 1, text


def test_ctrl_c_mid_epoch_leaves_the_bar_at_the_step_the_stop_line_names(tmp_path):
    """The bar is redrawn at most every 0.5 s: a stop between two redraws left it at its last one (250/430 under
    "stopped after step 261", a helper's run of the quickstart). It ends at the step trained."""
    cmd = cli_command("--trainer.limit_train_batches=1.0", "--data.train_size=16384", "--data.batch_size=4")
    cmd += ["--trainer.enable_progress_bar=true", "--trainer.limit_val_batches=0"]
    code, lines = screen(cmd, tmp_path, 160, ctrl_c_after=b"/4096 ", ctrl_c_delay=2.2)  # between two redraws
    text = "\n".join(lines)
    assert code == 130, text[-3000:]
    [stop] = [line for line in lines if line.startswith("SIGINT: stopped after step ")]
    step = int(re.search(r"after step (\d+) \(epoch 0\)", stop).group(1))
    [bar] = [line for line in lines if line.startswith("Epoch 0/0")]
    assert f" {step}/4096 " in bar, text


@pytest.mark.parametrize("strategy", ["auto", "ddp", "horovod", "mpirun"])
def test_redirected_output_is_plain_text(tmp_path, strategy):
    """stdout into a file gets plain lines, no bar redrawn. Under ddp too: the task logs torchmetrics objects per
    epoch, whose first read is a collective; rank 0's bar read them alone and the run hung at the end of epoch 0
    (Lightning issue 21264). Under ``mpirun -np 2`` typed by the user (horovod's usual launch) each rank's stdout
    is a pseudo-terminal of mpirun's, which mpirun copies to its own stdout: the bar saw a terminal and filled the
    log with its redraws. The horovod strategy's own mpirun launch is the same but for the launcher in between."""
    name = "horovod" if strategy == "mpirun" else strategy
    strategy_flags = [f"--trainer.strategy={name}", "--trainer.devices=2"] if strategy != "auto" else []
    cmd = cli_command("--trainer.enable_progress_bar=true", *strategy_flags)
    if strategy == "mpirun":
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-np", "2", "--oversubscribe", *cmd]
    result = run(cmd, cwd=tmp_path, timeout=180, log=tmp_path / "log.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b" not in result.stdout + result.stderr
    assert "epoch 0 | train loss" in result.stdout + result.stderr
    assert noise(result.stderr) == [], noise(result.stderr)


def test_json_callbacks_on_the_command_line_still_append(tmp_path):
    """--trainer.callbacks+= adds to the defaults, as before."""
    marker = tmp_path / "marker.txt"
    spec = {"class_path": "tests.test_as_users_run_it.Marker", "init_args": {"path": str(marker)}}
    result = run(cli_command("--trainer.callbacks+=" + json.dumps(spec)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.read_text() == "4" and list((tmp_path / "lightning_logs").rglob("last.ckpt"))
