"""Elastic training: a run that loses a node goes on at the new world size, and trains each sample of an epoch once.

The multi-process tests start real launchers: two torchrun agents on this host (two "nodes" of one process each,
c10d rendezvous), and Lightning's own ddp launcher. Which samples each rank trained on is recorded by image content
(tests/record_samples.py), independently of the loader's own bookkeeping.
"""

import contextlib
import csv
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Trainer
from torch.utils.data import DistributedSampler, TensorDataset

from app.checkpoints.io import CHECKPOINT_FORMAT, FORMAT_KEY, atomic_torch_save, check_compatible, load_checkpoint
from app.checkpoints.run_folders import finished_run_of, mark_run, run_of
from app.checkpoints.saved_state import MPI_LAUNCH_DIR, saved_state_announcer, saved_states
from app.errors import UserError
from app.launch.launcher import torchrun_job
from app.launch.restarts import agent_id, take_launcher_numbers
from app.loader import DeviceLoader, ResumableLoader, ResumableSampler
from app.strategies import HorovodStrategy
from tests import warm
from tests.conftest import ROOT, TINY_CONFIG, run_cli
from tests.parity import MPI_ENV
from tests.record_samples import read_records
from tests.tiny import LR, TinyClassifier
from tests.trackers import mlflow_runs, wandb_segments

SAMPLES, BATCH = 48, 4  # a training set of 48, 4 per device: 6 steps an epoch on 2 devices
EPOCHS = 2


# The survivor is still computing the next batch when the watchdog sees the lost rank's process gone (its
# first collective comes only after a long backward): it must live on to save its state (issue 34, item 4).
SURVIVOR_COMPUTES = {
    "class_path": "tests.faults.Fault",
    "init_args": {"at": "next_batch", "step": 3, "action": "pause", "seconds": 3},
}


def fit_args(root: Path, records: Path, *more: str) -> list[str]:
    record = {"class_path": "tests.record_samples.RecordSamples", "init_args": {"folder": str(records)}}
    return [
        *(str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), f"--data.train_size={SAMPLES}"),
        *(f"--data.batch_size={BATCH}", "--trainer.limit_train_batches=null"),
        *(f"--trainer.max_epochs={EPOCHS}", f"--trainer.default_root_dir={root}"),
        "--trainer.callbacks+=" + json.dumps(record),
        *more,
    ]


def env(**more: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **more}


def assert_each_sample_once_per_epoch(records: list[dict], resumed_at_step: int, world_before: int = 2) -> None:
    """Batches started before the state the run resumed from, plus all batches after it: each epoch is the training
    set, each sample once. (A batch started after that state and then lost with its node is done again.)"""
    trained = defaultdict(list)
    for record in records:
        before_failure = record["world"] == world_before
        if not before_failure or record["step"] < resumed_at_step:
            trained[record["epoch"]] += record["ids"]
    assert sorted(trained) == list(range(EPOCHS))
    for epoch, ids in trained.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: {len(ids)} samples, {len(set(ids))} distinct"


def start_agent(
    tmp_path: Path, name: str, port: int, args: list[str], is_host: bool, last_call: int = 15, delay: float = 0, **more
) -> subprocess.Popen:
    """One torchrun agent (a "node" of one process) of the job ``elastic-test``, its output in ``tmp_path/name.log``."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=2"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test"),
        # a round waits this long after MIN nodes are in for more, up to MAX
        f"--rdzv-conf=is_host={str(is_host).lower()},last_call_timeout={last_call}",
        # a node whose worker starts late (a slower machine): rank 0 is set up before it looks for a run
        *("--no-python", "sh", "-c", f'sleep {delay}; exec "$@"', "worker", sys.executable),
        *args,
    ]
    folder = tmp_path / name  # not the run's root: runs go where default_root_dir says
    folder.mkdir()
    # as docs/elastic.md says: torch 2.14's shared rendezvous store gives a node joining a later round no address
    more = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **more}
    with open(tmp_path / f"{name}.log", "w") as log:  # a file, not a pipe nobody reads while the other runs
        return subprocess.Popen(command, cwd=folder, env=env(**more), stdout=log, stderr=subprocess.STDOUT)


def run_two_nodes(tmp_path: Path, port: int, args: list[str]) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The agents "survivor" (hosts the store, which must outlive the lost node) and "lost" (``LOSE_THIS_NODE=1``,
    starting 5 s later), run to their end."""
    survivor = start_agent(tmp_path, "survivor", port, args, is_host=True)
    time.sleep(1)
    lost = start_agent(tmp_path, "lost", port, args, is_host=False, delay=5, LOSE_THIS_NODE="1")
    try:
        survivor.wait(timeout=250)
        lost.wait(timeout=60)
    finally:
        for process in (survivor, lost):
            process.kill()
    return survivor, lost


@pytest.mark.slow
def test_a_lost_node_mid_epoch_leaves_the_survivor_training_alone_each_sample_once(tmp_path):
    """Two torchrun agents (nodes); after step 3 one node's agent and worker are SIGKILLed. The survivor's collective
    fails, it saves the state after step 3, torchrun restarts it at world size 1, and it resumes from that state with
    accumulate_grad_batches 2 (the same global batch), in the same run folder. An MLflow run (a SQLite store) logs
    beside the run folder, and W&B offline: the restart goes on in each, each step logged once."""
    root, records = tmp_path / "runs", tmp_path / "records"
    port = find_free_network_port()
    lose = {"class_path": "tests.lose_node.LoseNodeAtStep", "init_args": {"step": 3}}
    args = fit_args(root, records, "--trainer.strategy=ddp", "--trainer.callbacks+=" + json.dumps(lose))
    args.append("--trainer.callbacks+=" + json.dumps(SURVIVOR_COMPUTES))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args += ["--trainer.logger+=lightning.pytorch.loggers.MLFlowLogger", f"--trainer.logger.tracking_uri={store}"]
    files = tmp_path / "wandb"  # and a W&B run, offline
    args += ["--trainer.logger+=lightning.pytorch.loggers.WandbLogger", "--trainer.logger.offline=true"]
    args += [f"--trainer.logger.save_dir={files}"]
    # The store's tables, made before the nodes start: every rank builds an MLflow client, and two first clients of one
    # SQLite file at once race to make them ("table ... already exists": the lost node's first start failed, under load)
    import mlflow

    mlflow.MlflowClient(tracking_uri=store).search_experiments()

    survivor, lost = run_two_nodes(tmp_path, port, args)
    output, other = (tmp_path / "survivor.log").read_text(), (tmp_path / "lost.log").read_text()
    assert survivor.returncode == 0, output[-4000:] + "\n--- the lost node:\n" + other[-3000:]
    assert lost.returncode == -9
    assert "Saved the state after step 3 to" in output, output[-4000:]
    assert "torchrun restart 1 of at most 2: 1 process(es) on 1 node(s), resuming from" in output
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch 8" in output
    assert "Traceback" not in output.split("torchrun restart 1")[1]  # the restarted run is clean

    [run] = (root / "lightning_logs").glob("version_*")  # one run folder, continued by the restart
    final = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)  # the steps of an unbroken run at global batch 8
    recorded = read_records(records)
    assert_each_sample_once_per_epoch(recorded, resumed_at_step=3)
    in_flight = [r["step"] for r in recorded if r["world"] == 2 and r["step"] >= 3]
    assert len(in_flight) <= 1  # done again: at most the step in flight on the survivor
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(row["step"]) for row in rows]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == final["global_step"] - 1
    assert {row["epoch"] for row in rows if row["val/acc"]} == {"0", "1"}  # both epochs' validation, one file
    # one row per step and metric: not the lost step in flight twice, not the learning rate once per accumulated
    # batch (accumulate 2 after the restart), the epoch a whole number in restored rows too (issue 34, item 14)
    logged = [
        (row["step"], name) for row in rows for name, value in row.items() if value and name not in ("step", "epoch")
    ]
    assert len(logged) == len(set(logged)), sorted({x for x in logged if logged.count(x) > 1})[:5]
    assert {row["epoch"] for row in rows} <= {"", "0", "1"}
    assert (run / "config.yaml").is_file() and (run / "config.restart1.yaml").is_file()
    # what the restart trained with, not what it was given (issue 34, item 14): accumulate 2, and why
    restart = (run / "config.restart1.yaml").read_text()
    assert yaml.safe_load(restart)["trainer"]["accumulate_grad_batches"] == 2
    assert restart.startswith("# Elastic changed this start's settings: 2 -> 1 devices: accumulate_grad_batches 1")
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["accumulate_grad_batches"] == 1
    # finished: a later job with the same --rdzv-id starts a run of its own; a restart by this job's agent does not
    marker = json.loads((run / "elastic.json").read_text())
    assert marker["rdzv_id"] == "elastic-test" and marker["finished"] is True and len(marker["agents"]) == 1
    [tracked] = mlflow_runs(store, "lightning_logs")  # one MLflow run across the restart, each step once
    assert tracked["steps"] == list(range(final["global_step"])) and tracked["status"] == "FINISHED", tracked
    first, restarted = wandb_segments(files)  # one W&B run: a segment per start, each step in one of them once
    assert first["id"] == restarted["id"], (first, restarted)
    assert first["steps"] + restarted["steps"] == tracked["steps"], (first, restarted)

    kill = max(r["time"] for r in recorded if r["world"] == 2 and r["rank"] == 1)
    first_after = min(r["time"] for r in recorded if r["world"] == 1)
    print(f"\nfrom the lost node's last batch to the first batch after the restart: {first_after - kill:.1f} s")


@pytest.mark.slow
def test_a_node_that_hangs_mid_epoch_is_cut_off_by_the_survivors_watchdog_and_the_survivor_saves(tmp_path):
    """After step 3 one node's agent and worker stop (SIGSTOP): nothing closes their connections, as when a link is
    cut, so the survivor's gloo collective would wait for good. Its watchdog judges the node lost after
    --watchdog.timeout and shuts its connections to it down: the collective fails, the training thread saves the
    state after step 3 (a save from another thread fails under the suite), and torchrun restarts it at world size 1
    from that state, each sample once."""
    root, records, pids = tmp_path / "runs", tmp_path / "records", tmp_path / "hung.pids"
    port = find_free_network_port()
    hang = {"class_path": "tests.lose_node.HangNodeAtStep", "init_args": {"step": 3}}
    args = fit_args(root, records, "--trainer.strategy=ddp", "--trainer.callbacks+=" + json.dumps(hang))
    args.append("--watchdog.timeout=6")
    survivor = start_agent(tmp_path, "survivor", port, args, is_host=True, last_call=5)
    time.sleep(1)
    hung = start_agent(tmp_path, "hung", port, args, is_host=False, LOSE_THIS_NODE="1", HANG_PIDS=str(pids))
    try:
        survivor.wait(timeout=250)
    finally:
        for pid in pids.read_text().split() if pids.is_file() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for process in (survivor, hung):
            process.kill()
    output = (tmp_path / "survivor.log").read_text()
    assert survivor.returncode == 0, output[-4000:]
    assert pids.is_file()  # the other node did hang
    before_restart = output.split("torchrun restart 1")[0]
    assert re.search(r"lost rank 1: rank 1 has not answered for \d+ s\. Saving this rank's state first", output)
    assert re.search(r"\[rank 0\] Saved the state after step 3 to \S+last\.ckpt; the launcher restarts", output)
    assert "Traceback" not in before_restart, before_restart[-3000:]  # one line each: the verdict's, the save's
    assert "torchrun restart 1 of at most 2: 1 process(es) on 1 node(s), resuming from" in output
    assert "Traceback" not in output.split("torchrun restart 1")[1]

    [run] = (root / "lightning_logs").glob("version_*")
    final = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)  # the steps of an unbroken run at global batch 8
    recorded = read_records(records)
    assert_each_sample_once_per_epoch(recorded, resumed_at_step=3)
    in_flight = [r["step"] for r in recorded if r["world"] == 2 and r["rank"] == 0 and r["step"] >= 3]
    assert len(in_flight) <= 1  # done again: at most the step in flight on the survivor

    stopped = max(r["time"] for r in recorded if r["world"] == 2 and r["rank"] == 1)
    first_after = min(r["time"] for r in recorded if r["world"] == 1)
    print(f"\nfrom the hung node's last batch to the first batch after the restart: {first_after - stopped:.1f} s")


@pytest.mark.slow
def test_a_node_lost_while_the_survivor_waits_for_the_stop_flag_still_leaves_its_state_saved(tmp_path):
    """The collective that fails is Preemption's stop flag, waited for after the optimizer step (on a busy machine
    its exchange lags behind the gradients'): the survivor had not yet recorded that step's state, so it saved
    nothing and the restart began at step 0, 16 trained steps lost (issue 45, item 5). Elastic now records each
    step before any other callback's collective can fail: the state after the step is saved and resumed from."""
    root, records = tmp_path / "runs", tmp_path / "records"
    lose = {"class_path": "tests.lose_node.LoseNodeInStopFlag", "init_args": {"step": 3}}
    args = fit_args(root, records, "--trainer.strategy=ddp", "--trainer.callbacks+=" + json.dumps(lose))
    survivor, lost = run_two_nodes(tmp_path, find_free_network_port(), args)
    output, other = (tmp_path / "survivor.log").read_text(), (tmp_path / "lost.log").read_text()
    assert survivor.returncode == 0, output[-4000:] + "\n--- the lost node:\n" + other[-3000:]
    assert "Saved the state after step 4 to" in output, output[-4000:]
    assert "resuming from" in output and "(step 4) in the same run folder" in output, output[-4000:]
    recorded = read_records(records)
    assert min(r["step"] for r in recorded if r["world"] == 1) == 4  # no trained step done again
    assert_each_sample_once_per_epoch(recorded, resumed_at_step=4)


@pytest.mark.slow
def test_a_lost_node_under_fsdp_restarts_from_the_last_checkpoint_on_disk(tmp_path):
    """Under fsdp each rank holds a shard of the state, and a lost node takes its shard along: the survivor says so
    in one line instead of saving, and torchrun's restart goes on from the epoch-0 checkpoint at world size 1 with
    the global batch kept; epoch 1 is trained again in full, each sample once."""
    root, records = tmp_path / "runs", tmp_path / "records"
    port = find_free_network_port()
    lose = {"class_path": "tests.lose_node.LoseNodeAtStep", "init_args": {"step": 8}}  # epoch 1: steps 6 to 11
    args = fit_args(root, records, "--trainer.strategy=fsdp", "--trainer.callbacks+=" + json.dumps(lose))
    survivor, lost = run_two_nodes(tmp_path, port, args)
    output, other = (tmp_path / "survivor.log").read_text(), (tmp_path / "lost.log").read_text()
    assert survivor.returncode == 0, output[-4000:] + "\n--- the lost node:\n" + other[-3000:]
    [run] = (root / "lightning_logs").glob("version_*")
    line = "under fsdp each rank holds a shard of the state and the lost rank's is gone, so none is saved here; a "
    line += f"restart goes on from the last checkpoint written ({run.resolve() / 'checkpoints' / 'last.ckpt'})"
    assert line in output, output[-4000:]
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch 8" in output, output[-4000:]
    final = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)
    assert_each_sample_once_per_epoch(read_records(records), resumed_at_step=SAMPLES // (2 * BATCH))
    with (run / "metrics.csv").open(newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert steps == list(range(final["global_step"]))  # one row per step: the lost steps' rows are gone


@pytest.mark.slow
def test_a_restart_with_no_saved_state_trains_again_from_the_start_with_the_configured_global_batch(tmp_path):
    """Node B is lost after step 3 and the survivor cannot save (its disk is full): torchrun restarts the job on one
    node with nothing to resume from. It trains the run again from its start in the same folder, with the first
    start's global batch 8 (accumulate 2 on 1 device), not 4: the same steps as an unbroken run (issue 34, item 4)."""
    root, records = tmp_path / "runs", tmp_path / "records"
    port = find_free_network_port()
    lose = {
        "class_path": "tests.faults.Fault",
        "init_args": {"at": "step", "step": 3, "action": "kill_node", "node": True},
    }
    full = {"class_path": "tests.faults.Fault", "init_args": {"at": "save", "step": 3, "action": "disk_full"}}
    args = fit_args(
        root, records, "--trainer.strategy=ddp", *(f"--trainer.callbacks+={json.dumps(c)}" for c in (lose, full))
    )
    survivor, _ = run_two_nodes(tmp_path, port, args)
    output = (tmp_path / "survivor.log").read_text()
    assert survivor.returncode == 0, output[-4000:]
    assert "could not save the state after step 3: [Errno 28] No space left on device" in output, output[-4000:]
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch 8" in output, output[-4000:]
    [run] = (root / "lightning_logs").glob("version_*")
    final = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)
    again = [r for r in read_records(records) if r["world"] == 1]
    for epoch in range(EPOCHS):  # the restart trained every sample of both epochs once
        assert sorted(i for r in again if r["epoch"] == epoch for i in r["ids"]) == list(range(SAMPLES))
    with (run / "metrics.csv").open(newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert steps == list(range(final["global_step"]))  # one row per step: the lost start's rows are gone


@pytest.mark.slow
def test_a_node_that_joins_mid_epoch_is_taken_in_and_each_sample_trained_once(tmp_path):
    """One torchrun agent trains alone; after its step 3 a second agent joins. torchrun stops the worker with
    SIGTERM (preemption: last.ckpt after the step), both agents re-form the job at world size 2, and the run goes on
    from that state in the same folder. A global batch of 4 cannot be kept on 2 devices of 4: the learning rate is
    scaled instead (linear scaling rule), with one line."""
    root, records = tmp_path / "runs", tmp_path / "records"
    port = find_free_network_port()
    wait = {"class_path": "tests.lose_node.WaitForNodeAtStep", "init_args": {"step": 3, "world_size": 1}}
    args = fit_args(root, records, "--trainer.strategy=ddp", "--trainer.callbacks+=" + json.dumps(wait))

    first = start_agent(tmp_path, "first", port, args, is_host=True, last_call=2)  # forms the job alone
    joining = None
    try:
        deadline = time.monotonic() + 180
        while not any(r["step"] == 2 for r in read_records(records)):  # the batch that ends at step 3 started
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.5)
        joined = time.time()
        joining = start_agent(tmp_path, "joining", port, args, is_host=False, last_call=2)
        first.wait(timeout=240)
        joining.wait(timeout=60)
    finally:
        for process in (first, joining):
            if process is not None:
                process.kill()
    output, other = (tmp_path / "first.log").read_text(), (tmp_path / "joining.log").read_text()
    assert first.returncode == joining.returncode == 0, output[-4000:] + "\n--- the joining node:\n" + other[-3000:]
    stopped = re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", output)
    assert stopped, output[-4000:]
    saved = int(stopped[1])
    assert "torchrun resumes from it when it restarts the job" in output  # not "--ckpt_path last": nothing to do
    assert "torchrun re-formed: 2 process(es) on 2 node(s), resuming from" in output
    line = "1 -> 2 devices: the global batch 4 -> 8 (1 is not a multiple of 2); learning rate x 2 (linear scaling rule)"
    assert line in output

    [run] = (root / "lightning_logs").glob("version_*")  # one run folder, continued after the join
    final = load_checkpoint(run / "checkpoints" / "last.ckpt")
    left_in_epoch_0 = math.ceil((SAMPLES - saved * BATCH) / (2 * BATCH))
    assert final["global_step"] == saved + left_in_epoch_0 + SAMPLES // (2 * BATCH)
    assert {group["lr"] for group in final["optimizer_states"][0]["param_groups"]} == {2 * LR}
    assert_each_sample_once_per_epoch(read_records(records), resumed_at_step=saved, world_before=1)
    with (run / "metrics.csv").open(newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == final["global_step"] - 1
    assert (run / "config.yaml").is_file() and (run / "config.rejoined.yaml").is_file()
    assert "learning rate x 2 (linear scaling rule)" in (run / "config.rejoined.yaml").read_text().splitlines()[0]
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())  # the module's lr, and what changed it
    assert hparams["lr"] == LR and hparams["elastic_changes"] == [line]
    marker = json.loads((run / "elastic.json").read_text())
    assert marker["rdzv_id"] == "elastic-test" and marker["finished"] is True and len(marker["agents"]) == 2
    first_at_two = min(r["time"] for r in read_records(records) if r["world"] == 2)
    print(f"\nfrom starting the joining agent to the first batch on two nodes: {first_at_two - joined:.1f} s")


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_of_two_processes_resumes_on_one_each_sample_once(tmp_path):
    """SIGTERM on rank 1 of a 2-process ddp run mid-epoch, then ``--ckpt_path last`` with one device: the rest of the
    epoch is dealt out to the one process, and the run ends at the step count of an unbroken 2-process run."""
    root, records = tmp_path / "runs", tmp_path / "records"
    stop = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 2, "rank": 1}}
    stopped = warm.run(
        [sys.executable, *fit_args(root, records, "--trainer.strategy=ddp", "--trainer.devices=2")]
        + ["--trainer.callbacks+=" + json.dumps(stop)],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    checkpoint = load_checkpoint(root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    step = checkpoint["global_step"]
    assert 2 < step < SAMPLES // (2 * BATCH)  # part-way through epoch 0
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["samples"] == step * 2 * BATCH

    resumed = warm.run(
        [sys.executable, *fit_args(root, records, "--trainer.devices=1", "--ckpt_path=last")],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch 8" in resumed.stdout + resumed.stderr
    final = load_checkpoint(root / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)
    assert_each_sample_once_per_epoch(read_records(records), resumed_at_step=step)
    # the resumed run's config.yaml says what it trained with (issue 34, item 14): rerun as is, it trains alike
    config = yaml.safe_load((root / "lightning_logs" / "version_1" / "config.yaml").read_text())
    assert config["trainer"]["accumulate_grad_batches"] == 2
    # and its logger steps go on from the stop, one loss row per optimizer step, none twice (issue 34, item 14:
    # after an odd-aligned resume with accumulation the first row was a duplicate and the last one short)
    logged = []
    for version in (0, 1):
        with (root / "lightning_logs" / f"version_{version}" / "metrics.csv").open(newline="") as f:
            logged += [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert logged == list(range(final["global_step"]))


@pytest.mark.slow
def test_a_checkpoint_from_an_epochs_end_resumes_on_one_device_with_the_global_batch_kept(tmp_path):
    """Epoch 0 on 2 processes, then ``--ckpt_path last`` on one device: accumulate 2 keeps the global batch of 8, and
    epoch 1 takes the 6 steps of an unbroken run. Before, a checkpoint from an epoch's end (which Lightning's fit
    loop does not count as a restart) resumed at accumulate 1: 12 steps at half the global batch."""
    root, records = tmp_path / "runs", tmp_path / "records"
    for more in (("--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_epochs=1"),
                 ("--trainer.devices=1", "--ckpt_path=last")):  # fmt: skip
        result = warm.run(
            [sys.executable, *fit_args(root, records, *more)],
            cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch 8" in result.stdout + result.stderr
    final = load_checkpoint(root / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)
    assert_each_sample_once_per_epoch(read_records(records), resumed_at_step=SAMPLES // (2 * BATCH))


@pytest.mark.slow
def test_batch_counts_keep_their_meaning_when_a_resume_changes_the_world_size(tmp_path):
    """--trainer.limit_train_batches=4 counts batches per process: 4 x 2 processes = 32 samples an epoch. Resumed
    mid-epoch on one process, the limit becomes 8 (with accumulate 2: the same 4 steps an epoch), and
    limit_val_batches and val_check_interval alike; the run ends at an unbroken run's step with each epoch's 32
    samples trained once. Before (issue 34, item 1), the limit stayed 4: 1 more step in epoch 0, half of epoch 1."""
    root, records = tmp_path / "runs", tmp_path / "records"
    limits = ("--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2", "--trainer.val_check_interval=4")
    stop = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 1, "rank": 1}}
    stopped = warm.run(
        [sys.executable, *fit_args(root, records, "--trainer.strategy=ddp", "--trainer.devices=2", *limits)]
        + ["--trainer.callbacks+=" + json.dumps(stop)],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    step = load_checkpoint(root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")["global_step"]
    assert 1 < step < 4  # part-way through epoch 0
    resumed = warm.run(
        [sys.executable, *fit_args(root, records, "--trainer.devices=1", "--ckpt_path=last", *limits)],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert (
        "2 -> 1 devices: limit_train_batches 4 -> 8, limit_val_batches 2 -> 4, val_check_interval 4 -> 8 keep the "
        "batches of an epoch" in output
    ), output[-3000:]
    final = load_checkpoint(root / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * 4
    trained = defaultdict(list)
    for record in read_records(records):
        if record["world"] == 1 or record["step"] < step:
            trained[record["epoch"]] += record["ids"]
    assert sorted(trained) == list(range(EPOCHS))
    for epoch, ids in trained.items():
        assert len(ids) == len(set(ids)) == 4 * 2 * BATCH, (
            f"epoch {epoch}: {len(ids)} samples, {len(set(ids))} distinct"
        )
    with (root / "lightning_logs" / "version_1" / "metrics.csv").open(newline="") as f:
        validated = [row["step"] for row in csv.DictReader(f) if row.get("val/acc")]
    assert len(validated) == EPOCHS  # one validation per epoch, as unbroken


@pytest.mark.slow
def test_a_lost_horovod_rank_is_restarted_from_the_survivors_state_each_sample_once(tmp_path):
    """The horovod strategy starts its own 2 ranks with max_restarts=1; after step 3 rank 1 is SIGKILLed. mpirun
    (with recovery) keeps rank 0 alive, whose collective fails; it saves the state after step 3 and reports it. The
    launcher restarts on the surviving rank from that state, in the same run folder, keeping the global batch."""
    root, records, elsewhere = tmp_path / "runs", tmp_path / "records", tmp_path / "elsewhere"
    elsewhere.mkdir()
    lose = {"class_path": "tests.lose_node.LoseRankAtStep", "init_args": {"step": 3, "rank": 1}}
    args = fit_args(root, records, "--trainer.strategy=horovod", "--trainer.devices=2")
    args += ["--trainer.strategy.max_restarts=1", "--trainer.callbacks+=" + json.dumps(lose)]
    args.append("--trainer.callbacks+=" + json.dumps(SURVIVOR_COMPUTES))
    result = warm.run(
        [sys.executable, *args], cwd=elsewhere, env=env(**MPI_ENV), capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "[rank 0]" in output and "Saved the state after step 3 to" in output, output[-5000:]
    restart = "horovod: rank(s) 1 lost (mpirun exited with a failure); restart 1 of at most 1 on 1 rank(s), resuming"
    assert restart in output, output[-5000:]
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch 8" in output
    assert "Traceback" not in output.split(restart)[1]  # the restarted run is clean

    [run] = (root / "lightning_logs").glob("version_*")  # one run folder, continued by the restart
    final = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)  # the steps of an unbroken run at global batch 8
    recorded = read_records(records)
    assert_each_sample_once_per_epoch(recorded, resumed_at_step=3)
    assert len([r for r in recorded if r["world"] == 2 and r["step"] >= 3]) <= 1  # at most the step in flight again
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(row["step"]) for row in rows]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == final["global_step"] - 1
    assert {row["epoch"] for row in rows if row["val/acc"]} == {"0", "1"}  # both epochs' validation, one file
    # one row per step and metric: not the lost step in flight twice, not the learning rate once per accumulated
    # batch (accumulate 2 after the restart), the epoch a whole number in restored rows too (issue 34, item 14)
    logged = [
        (row["step"], name) for row in rows for name, value in row.items() if value and name not in ("step", "epoch")
    ]
    assert len(logged) == len(set(logged)), sorted({x for x in logged if logged.count(x) > 1})[:5]
    assert {row["epoch"] for row in rows} <= {"", "0", "1"}
    assert (run / "config.yaml").is_file() and (run / "config.restart1.yaml").is_file()
    kill = max(r["time"] for r in recorded if r["world"] == 2 and r["rank"] == 1)
    first_after = min(r["time"] for r in recorded if r["world"] == 1)
    print(f"\nfrom the lost rank's last batch to the first batch after the restart: {first_after - kill:.1f} s")


@pytest.mark.slow
def test_a_rank_lost_in_the_last_validation_is_restarted_into_that_validation(tmp_path):
    """Rank 1 dies in the middle of the last epoch's validation. The survivor saves the state in that validation
    (weights of the last step), and the restarted run validates the epoch again in full: its val row, its epoch
    checkpoint and the best checkpoint by val/acc are there, as in an unbroken run (issue 34, item 3)."""
    root, records = tmp_path / "runs", tmp_path / "records"
    last_step = EPOCHS * SAMPLES // (2 * BATCH)
    lose = {"class_path": "tests.faults.Fault", "init_args": {"at": "validation", "step": last_step, "action": "kill"}}
    lose["init_args"].update(rank=1, batch=1)
    args = fit_args(root, records, "--trainer.strategy=horovod", "--trainer.devices=2")
    args += ["--trainer.strategy.max_restarts=1", "--trainer.callbacks+=" + json.dumps(lose)]
    result = warm.run(
        [sys.executable, *args], cwd=tmp_path, env=env(**MPI_ENV), capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert f"Saved the state after step {last_step} to" in output, output[-5000:]
    assert "restart 1 of at most 1 on 1 rank(s)" in output, output[-5000:]
    [run] = (root / "lightning_logs").glob("version_*")
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == last_step  # nothing trained again
    epochs = sorted(p.name for p in (run / "checkpoints").glob("epoch=*.ckpt"))
    assert any(name.startswith(f"epoch={EPOCHS - 1}-") for name in epochs), epochs  # the last epoch's checkpoint
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    validated = [row["epoch"] for row in rows if row["val/acc"]]
    assert validated == [str(e) for e in range(EPOCHS)], validated  # each epoch validated once, the last one too
    assert not [r for r in read_records(records) if r["world"] == 1]  # the restart trained no batch
    # The epoch's training aggregates (train/loss_epoch, the epoch line's loss and img/s) were the lost process's:
    # the restarted epoch says so instead of a zero throughput (docs/elastic.md, "Not yet")
    assert re.search(rf"epoch {EPOCHS - 1} \| val acc [\d.]+ \| resumed after its training \| 1 x cpu", output), output


def horovod_fault_run(tmp_path: Path, fault: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """The self-launched horovod strategy on 2 ranks with max_restarts=1 and one ``tests.faults.Fault``, in
    ``tmp_path/runs``, its samples recorded in ``tmp_path/records``."""
    args = fit_args(tmp_path / "runs", tmp_path / "records", "--trainer.strategy=horovod", "--trainer.devices=2")
    spec = {"class_path": "tests.faults.Fault", "init_args": fault}
    args += ["--trainer.strategy.max_restarts=1", "--trainer.callbacks+=" + json.dumps(spec)]
    return warm.run(
        [sys.executable, *args], cwd=tmp_path, env=env(**MPI_ENV), capture_output=True, text=True, timeout=timeout
    )


def horovod_run_with_fault(tmp_path: Path, fault: dict) -> Path:
    """:func:`horovod_fault_run`, which must end with exit 0. Returns its one run folder."""
    result = horovod_fault_run(tmp_path, fault)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    [run] = (tmp_path / "runs" / "lightning_logs").glob("version_*")
    return run


@pytest.mark.slow
def test_rank_0_lost_before_it_logged_its_step_leaves_no_gap_in_metrics_csv(tmp_path):
    """Rank 0 dies after step 3 but before the loop logged that step (its callbacks' hooks come first): the
    survivor's state goes on after the step, so no later start logs it, and metrics.csv had no row for it (issue 34,
    item 14). The survivor keeps the row the loop was about to log, from its own values, for the restart to write."""
    run = horovod_run_with_fault(tmp_path, {"at": "step", "step": 3, "action": "kill", "rank": 0})
    with (run / "metrics.csv").open(newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert steps == list(range(EPOCHS * SAMPLES // (2 * BATCH))), steps  # step index 2 was missing


@pytest.mark.slow
def test_an_mpirun_that_outlives_its_ranks_is_ended_and_the_launch_restarted(tmp_path):
    """Rank 1 is lost after step 3 and its mpirun hangs (stopped here; in CI, Open MPI 5's prterun said "Abort is in
    progress...hit ctrl-c again" and never exited). Rank 0 saves the state and exits, so no rank is left: the launcher
    waited on mpirun for good, until the test's timeout. Now it ends an mpirun that outlives all its ranks by 30 s,
    counts the launch as failed, and restarts on the survivor from its state."""
    fault = {"at": "step", "step": 3, "action": "hang_mpirun_then_kill", "rank": 1}
    root, records = tmp_path / "runs", tmp_path / "records"
    result = horovod_fault_run(tmp_path, fault, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert re.search(r"error: mpirun \(pid \d+\) outlived all its ranks by 30 s", output), output[-5000:]
    # (the survivor's own lines, "Saved the state after step 3", went to the stopped mpirun and are lost with it)
    assert "restart 1 of at most 1 on 1 rank(s)" in output, output[-5000:]
    [run] = (root / "lightning_logs").glob("version_*")
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == EPOCHS * SAMPLES // (2 * BATCH)
    assert_each_sample_once_per_epoch(read_records(records), resumed_at_step=3)  # from the survivor's state


@pytest.mark.slow
def test_a_rank_lost_in_the_epoch_checkpoints_save_leaves_one_best_checkpoint(tmp_path):
    """Rank 1 dies inside the save of epoch 0's checkpoint, after rank 0 wrote the file. The restart validates epoch 0
    again and saves its checkpoint under the same name: one top-1 file at the end, the best by val/acc. (The file
    was left beside an ``-v1`` copy that the restart wrote and later removed, and the interrupted save had marked the
    step saved, so no epoch checkpoint was written at all; found by the chaos test.)"""
    run = horovod_run_with_fault(tmp_path, {"at": "save", "step": 6, "action": "kill", "rank": 1})
    [best] = (run / "checkpoints").glob("epoch=*.ckpt")
    [state] = [
        v for k, v in load_checkpoint(run / "checkpoints" / "last.ckpt")["callbacks"].items() if "Checkpoint" in k
    ]
    assert Path(state["best_model_path"]) == best


def test_the_horovod_launcher_counts_a_survivors_save_once_it_is_in_place_and_nothing_else(tmp_path, monkeypatch):
    """Each survivor announces its save to the launcher before the file is in place, naming the temporary file; the
    launcher (once the ranks are gone) counts the saves whose file was renamed into place, and removes what a save
    cut short left. Rank 0 saved; rank 1 was killed after its announcement, before the rename (its temporary file is
    there, complete or not); rank 2's save failed (it takes its report back, and its file). A report written only
    after the rename was missed by a kill in between, and the launcher said that no rank saved, with last.ckpt there."""
    launch, checkpoints = tmp_path / "launch", tmp_path / "checkpoints"
    launch.mkdir()
    monkeypatch.setenv(MPI_LAUNCH_DIR, str(launch))
    last = checkpoints / "last.ckpt"
    atomic_torch_save({"w": torch.ones(3)}, last, announce=saved_state_announcer(0, str(last)))
    cut_short = checkpoints / ".last.ckpt.killed.tmp"
    cut_short.write_bytes(b"PK\x03\x04 half of a checkpoint")
    saved_state_announcer(1, str(last))(cut_short)
    with pytest.raises(AttributeError, match="pickle"):  # a local object: torch.save fails half-way
        atomic_torch_save({"w": lambda: None}, last, announce=saved_state_announcer(2, str(last)))
    assert sorted(p.name for p in launch.iterdir()) == ["saved-state-0", "saved-state-1"]
    assert saved_states(launch) == {0: str(last)}
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]  # rank 1's temporary file removed

    last.unlink()  # rank 0's file was renamed, but is gone since: no save
    assert saved_states(launch) == {}
    monkeypatch.delenv(MPI_LAUNCH_DIR)
    assert saved_state_announcer(0, str(last)) is None  # not under the horovod launcher (torchrun): nothing to tell


def test_a_late_save_after_a_failure_leaves_a_later_checkpoint_in_place(tmp_path, monkeypatch):
    """A node cut off from a shared run folder saves its state late; by then the nodes that went on may have written a
    later last.ckpt. The save checks just before its rename (atomic_torch_save's ``unless``) and leaves it: the file,
    its content and the folder are as they were, and a horovod launcher's report is taken back."""
    from app.checkpoints.io import saved_at_step

    launch, checkpoints = tmp_path / "launch", tmp_path / "checkpoints"
    launch.mkdir()
    monkeypatch.setenv(MPI_LAUNCH_DIR, str(launch))
    last = checkpoints / "last.ckpt"
    assert saved_at_step(last) is None  # none yet
    assert atomic_torch_save({"global_step": 12, "w": torch.ones(3)}, last) is True
    assert saved_at_step(last) == 12
    later = lambda: (saved_at_step(last) or -1) > 3  # noqa: E731 - the check the survivor's save makes
    late = {"global_step": 3, "w": torch.zeros(3)}
    written = atomic_torch_save(late, last, announce=saved_state_announcer(1, str(last)), unless=later)
    assert written is False and saved_at_step(last) == 12
    assert torch.load(last, weights_only=True)["w"].tolist() == [1.0, 1.0, 1.0]
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"] and not list(launch.iterdir())
    assert atomic_torch_save({"global_step": 13}, last, unless=lambda: (saved_at_step(last) or -1) > 13) is True
    (checkpoints / "junk.ckpt").write_bytes(b"not a checkpoint")
    assert saved_at_step(checkpoints / "junk.ckpt") is None


def test_horovod_max_restarts_is_checked(monkeypatch):
    with pytest.raises(UserError, match=r"max_restarts=-1 must be >= 0"):
        HorovodStrategy(max_restarts=-1)
    with pytest.raises(UserError, match=r"max_restarts=2 restarts a run on the ranks that survive.*--trainer.devices"):
        Trainer(accelerator="cpu", devices=1, strategy=HorovodStrategy(max_restarts=2), logger=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    with pytest.raises(UserError, match=r"under your own mpirun or horovodrun, restarting is the launcher's job"):
        HorovodStrategy(max_restarts=1)._configure_launcher()


# ---------------------------------------------------------------- the loader at another world size, in-process
def take_epoch(loaders: list[ResumableLoader], batches: int | None = None) -> list[int]:
    """Each rank's loader hands out ``batches`` batches (all when None), rank by rank, as the ranks of a step do."""
    iterators = [iter(loader) for loader in loaders]
    taken = []
    for _ in range(batches if batches is not None else len(loaders[0])):
        for iterator in iterators:
            batch = next(iterator, None)
            if batch is not None:
                taken += batch[0].tolist()
    return taken


def loaders_for(
    world: int, size: int, state: dict | None = None, drop_last: bool = False, on_device: bool = False
) -> list[ResumableLoader]:
    dataset = TensorDataset(torch.arange(size))
    loaders = []
    for rank in range(world):
        sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=drop_last)
        if on_device:  # the training device here is the CPU: the same path, other memory
            loader = DeviceLoader(dataset, sampler=sampler, batch_size=BATCH, seed=7, device=torch.device("cpu"))
        else:
            loader = ResumableLoader(dataset, sampler=sampler, batch_size=BATCH, seed=7)
        if state is None:
            sampler.set_epoch(3)
        else:
            loader.load_state_dict(state)
        loaders.append(loader)
    return loaders


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4), (4, 2), (3, 2)])
def test_the_rest_of_an_epoch_is_dealt_out_over_the_new_ranks(before, after):
    size = 96  # divisible by every world size here times the batch: no padding, so "once" is exact
    first = loaders_for(before, size)
    head = take_epoch(first, batches=3)
    state = first[0].state_dict()
    assert state == {"epoch": 3, "batches": 3, "samples": 3 * BATCH * before, "world_size": before}
    second = loaders_for(after, size, state)
    # Lightning's count ends at len(loader): the batches of a whole epoch minus those left (a short last one counts)
    assert second[0].first_batch() == len(second[0]) - math.ceil((size - len(head)) / after / BATCH)
    rest = take_epoch(second)
    assert sorted(head + rest) == list(range(size))
    assert second[0].state_dict()["samples"] == size


def test_the_same_world_size_resumes_the_exact_order_and_padding_of_an_unbroken_epoch():
    size = 50  # not divisible by 3: DistributedSampler pads with the epoch's first indices
    unbroken = [list(DistributedSampler(range(size), 3, r, seed=7)) for r in range(3)]
    for r, sampler in enumerate(unbroken):
        fresh = ResumableSampler(range(size), 3, r, seed=7)
        fresh.set_epoch(0)
        assert list(fresh) == sampler
    first = loaders_for(3, size)
    head = take_epoch(first, batches=2)
    rest = take_epoch(loaders_for(3, size, first[0].state_dict()))
    whole = take_epoch(loaders_for(3, size))
    assert head + rest == whole


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_device_loader_hands_out_the_host_loaders_batches_and_resumes_as_it_does(drop_last):
    """``--data.on_device`` (app.loader.DeviceLoader): the epoch's order cut on the device gives the host loader's
    batches, rank by rank, and a stop part-way resumes into the rest of them (50 samples over 3 ranks: padded, or
    cut with drop_last)."""
    size = 50
    host, device = loaders_for(3, size, drop_last=drop_last), loaders_for(3, size, drop_last=drop_last, on_device=True)
    assert [len(loader) for loader in device] == [len(loader) for loader in host]
    whole = take_epoch(host)
    assert take_epoch(device) == whole and len(whole) == (48 if drop_last else 51)
    first = loaders_for(3, size, drop_last=drop_last, on_device=True)
    head = take_epoch(first, batches=2)
    state = first[0].state_dict()
    assert state == {"epoch": 3, "batches": 2, "samples": 2 * BATCH * 3, "world_size": 3}
    assert head + take_epoch(loaders_for(3, size, state, drop_last=drop_last, on_device=True)) == whole


def test_a_checkpoint_without_the_global_position_resumes_as_before():
    old_state = {"epoch": 3, "batches": 2}  # format 1: batches per rank, at the same world size
    head = take_epoch(loaders_for(2, 96), batches=2)
    rest = take_epoch(loaders_for(2, 96, old_state))
    assert sorted(head + rest) == list(range(96))


# ---------------------------------------------------------------- torchrun's numbers and bad input
def torchrun_env(monkeypatch, world: int, local: int, restart: int = 0) -> None:
    variables = {"TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local)}
    variables.update(GROUP_WORLD_SIZE=str(world // local), TORCHELASTIC_RESTART_COUNT=str(restart))
    variables.update(TORCHELASTIC_MAX_RESTARTS="3")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def trainer_config(**settings) -> SimpleNamespace:
    return SimpleNamespace(**{"strategy": "ddp", "devices": "auto", "num_nodes": 1, **settings})


def test_devices_and_nodes_come_from_torchrun_when_not_given(monkeypatch):
    torchrun_env(monkeypatch, world=6, local=2)
    config = trainer_config()
    take_launcher_numbers(config, torchrun_job())
    assert (config.devices, config.num_nodes) == (2, 3)
    config = trainer_config(devices=2, num_nodes=3)
    take_launcher_numbers(config, torchrun_job())  # given and equal: fine
    assert (config.devices, config.num_nodes) == (2, 3)
    config = trainer_config(devices=1)  # from a config file written for one process, not on the command line
    take_launcher_numbers(config, torchrun_job(), devices_given=False)
    assert config.devices == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"devices": 4}, "--trainer.devices=4, but torchrun started 2 process(es) per node (--nproc_per_node=2)"),
        ({"num_nodes": 2}, "--trainer.num_nodes=2, but torchrun started 3 node(s) (--nnodes)"),
        ({"strategy": "dp"}, "--trainer.strategy=dp starts its own workers, but torchrun started this process as one"),
        ({"strategy": "ddp_spawn"}, "under torchrun use --trainer.strategy=ddp"),
        # Lightning 2.x has no DDPSpawnStrategy class: ddp_fork and ddp_notebook got past a check by class name
        ({"strategy": "ddp_fork"}, "--trainer.strategy=ddp_fork starts its own workers, but torchrun started"),
        ({"strategy": "ddp_notebook"}, "--trainer.strategy=ddp_notebook starts its own workers"),
        (
            {
                "strategy": SimpleNamespace(
                    class_path="lightning.pytorch.strategies.DDPStrategy", init_args={"start_method": "spawn"}
                )
            },
            "--trainer.strategy=lightning.pytorch.strategies.DDPStrategy starts its own workers",
        ),
        (
            {"strategy": SimpleNamespace(class_path="app.strategies.dp.DataParallelStrategy", init_args={})},
            "--trainer.strategy=app.strategies.dp.DataParallelStrategy starts its own workers",
        ),
        ({"strategy": "horovod"}, "--trainer.strategy=horovod runs its ranks under mpirun, but torchrun started"),
    ],
)
def test_settings_that_disagree_with_torchrun_are_one_line(monkeypatch, settings, message):
    torchrun_env(monkeypatch, world=6, local=2)
    with pytest.raises(UserError) as error:
        take_launcher_numbers(trainer_config(**settings), torchrun_job())
    assert message in str(error.value) and "\n" not in str(error.value)


def test_after_a_restart_the_launchers_node_count_wins(monkeypatch):
    torchrun_env(monkeypatch, world=2, local=2, restart=1)  # the job had 2 nodes; one was lost
    config = trainer_config(num_nodes=2)
    take_launcher_numbers(config, torchrun_job(), continuing=True)
    assert config.num_nodes == 1


@pytest.mark.slow
def test_num_nodes_that_torchrun_did_not_start_is_refused_at_every_start(tmp_path):
    port = find_free_network_port()
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1", "--max-restarts=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(ROOT / "cli.py"), "fit"),
        *("--config", str(TINY_CONFIG), "--trainer.num_nodes=2", f"--trainer.default_root_dir={tmp_path / 'runs'}"),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    refused = "error: --trainer.num_nodes=2, but torchrun started 1 node(s) (--nnodes)"
    assert output.count(refused) == 2, output[-3000:]  # the first start and torchrun's restart
    assert not list((tmp_path / "runs").rglob("*.ckpt"))


def test_a_restart_after_a_refused_first_start_is_refused_too(monkeypatch):
    """--trainer.num_nodes=2 on one node: the first start is refused, and torchrun restarts it; that restart has no
    run to continue, so it is refused the same way instead of quietly training on one node (issue 34, item 11)."""
    torchrun_env(monkeypatch, world=2, local=2, restart=1)
    with pytest.raises(UserError, match=r"--trainer.num_nodes=2, but torchrun started 1 node\(s\)"):
        take_launcher_numbers(trainer_config(num_nodes=2), torchrun_job(), continuing=False)


def rank_of_two(rank: int, rank0_decided: dict) -> SimpleNamespace:
    """A trainer of a 2-rank job as ElasticRunFolder sees it: broadcast gives rank 0's decision (the other rank
    agrees in these cases, so this rank's vote decides)."""
    strategy = SimpleNamespace(
        broadcast=lambda obj, src: rank0_decided if rank else obj,
        reduce_boolean_decision=lambda decision, all: decision,
    )
    return SimpleNamespace(strategy=strategy, is_global_zero=rank == 0)


def test_the_run_folder_is_marked_after_every_rank_decided_and_a_disagreement_is_one_line(monkeypatch, tmp_path):
    from app.callbacks.elastic import ElasticRunFolder

    torchrun_env(monkeypatch, world=2, local=1, restart=1)
    job, root = torchrun_job(), tmp_path / "lightning_logs"
    (root / "version_3").mkdir(parents=True)
    first = ElasticRunFolder(job, claimed=[root / "version_3"], continued={}, ckpt_path=None)
    assert run_of(root, job) is None  # not marked while the ranks decide
    first.setup(rank_of_two(0, {}), None, "fit")
    assert run_of(root, job) == 3  # marked once they agreed: a restart continues it

    # rank 1 of a restart does not see the folder rank 0 continues (a root the nodes do not share)
    rank0 = {"continues": [(str(root), 3)], "ckpt": str(root / "version_3" / "checkpoints" / "last.ckpt")}
    rank1 = ElasticRunFolder(job, claimed=[], continued={}, ckpt_path=None)
    with pytest.raises(UserError) as error:
        rank1.setup(rank_of_two(1, rank0), None, "fit")
    assert f"rank 0 continues {root}/version_3" in str(error.value) and "shared filesystem" in str(error.value)

    first.on_fit_end(rank_of_two(0, {}), None)
    assert run_of(root, job) is None  # finished: a later job with this id starts a run of its own
    assert finished_run_of(root, job, agent_id()) == 3  # ... but a restart by this job's agent finds it finished
    assert finished_run_of(root, job, "otherhost:1") is None


def test_a_restart_after_the_run_finished_trains_nothing(monkeypatch, tmp_path, caplog):
    """A worker that fails after the run finished (it died at exit) makes torchrun restart the job: the restart
    exits 0 with one line instead of training a new run from scratch; a new torchrun command (another agent) with
    the same --rdzv-id starts its own run."""
    torchrun_env(monkeypatch, world=1, local=1, restart=1)
    job, logs = torchrun_job(), tmp_path / "lightning_logs"
    (logs / "version_0").mkdir(parents=True)
    mark_run(logs / "version_0", job, finished=True, agents=[agent_id()])
    base = ["--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.strategy=ddp"]
    with pytest.raises(SystemExit) as stop, caplog.at_level(logging.INFO):
        run_cli("fit", *base)
    assert stop.value.code == 0
    assert "torchrun restarted the job after its run finished" in caplog.text
    assert sorted(p.name for p in logs.iterdir()) == ["version_0"]
    mark_run(logs / "version_0", job, finished=True, agents=["otherhost:1"])
    assert finished_run_of(logs, job, agent_id()) is None  # another job's run: this start trains its own


@pytest.mark.slow
def test_torchrun_refuses_more_minimum_nodes_than_maximum(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:1", "--nproc_per_node=1", str(ROOT / "cli.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "min_nodes must be > 0 and <= max_nodes, got min_nodes=2, max_nodes=1" in result.stderr


@pytest.mark.slow
def test_horovod_under_torchrun_is_one_line_per_node_and_writes_nothing(tmp_path):
    """Each torchrun worker would start an mpirun of its own (ports collide, a version folder each, tracebacks):
    refused before anything runs, one line, and torchrun reports the failure (issue 34, item 8)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "cli.py"),
    ]
    command += [
        "fit",
        "--config",
        str(TINY_CONFIG),
        "--trainer.strategy=horovod",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env())
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "runs its ranks under mpirun, but torchrun started" in errors[0], result.stderr[-3000:]
    # the one traceback is torchrun's own report of a failed worker; the workers print none
    assert result.stderr.count("Traceback") <= 1 and "ChildFailedError" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "lightning_logs").exists()


def test_a_checkpoint_from_a_newer_format_is_refused_in_one_line(tmp_path):
    module = TinyClassifier()
    checkpoint = {FORMAT_KEY: CHECKPOINT_FORMAT + 1, "hyper_parameters": dict(module.hparams), "state_dict": {}}
    with pytest.raises(UserError) as error:
        check_compatible(checkpoint, tmp_path / "future.ckpt", module)
    assert f"checkpoint format {CHECKPOINT_FORMAT + 1}, this one reads up to {CHECKPOINT_FORMAT}" in str(error.value)


def test_batch_counts_that_the_new_world_cannot_share_are_refused_in_one_line():
    from app.callbacks.elastic.world_size import rescale_batch_counts

    trainer = SimpleNamespace(limit_train_batches=4, limit_val_batches=1.0, val_check_interval=None)
    rescale_batch_counts(trainer, before=2, now=4)
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.val_check_interval) == (2, 1.0, None)
    trainer.limit_train_batches = 4
    with pytest.raises(UserError) as error:
        rescale_batch_counts(trainer, before=2, now=3)
    assert str(error.value).startswith("--trainer.limit_train_batches=4 counts batches per device, 8 over the 2")
    assert "\n" not in str(error.value)


def test_a_stopping_rank_promises_a_restart_only_when_one_is_left(monkeypatch, tmp_path):
    """'The launcher restarts the job' was printed with torchrun's restarts used up and under horovod without
    restarts (issue 34, item 10): the advice now follows what the launcher will do."""
    from app.callbacks.rank_watchdog import what_next
    from app.launch.launcher import MPI_RESTARTS_LEFT

    last = tmp_path / "last.ckpt"
    last.write_bytes(b"x")
    torchrun_env(monkeypatch, world=2, local=1, restart=2)  # --max-restarts=3: one left
    assert what_next(last) == f"The launcher restarts the job from {last}"
    torchrun_env(monkeypatch, world=2, local=1, restart=3)  # all used
    assert what_next(last) == f"{last} is intact: restart with the same command plus --ckpt_path last"
    assert what_next(None) == "No checkpoint was written yet: restart with the same command"
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name)
    monkeypatch.setenv(MPI_RESTARTS_LEFT, "0")  # the horovod self-launch, no restarts left
    assert what_next(last).startswith(f"{last} is intact")
    monkeypatch.setenv(MPI_RESTARTS_LEFT, "1")
    assert what_next(last).startswith("The launcher restarts the job")
