"""A training platform's pods (Kubeflow's PyTorchJob without nprocPerNode, Trainer v2, Vertex AI, PAI-DLC): each pod
runs the image's entrypoint once, with ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (pods) and ``RANK`` (its index)
and no launcher (app/launch/pods.py). Two "pods" here are two processes on this machine given exactly that
environment, started from another working directory; they train one run together. (Each pod in a podman container
on a node of its own: not yet.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from app.errors import UserError
from app.launch.launcher import PodJob, pod_job
from app.launch.pods import take_pod_numbers
from tests.conftest import ROOT, TINY_CONFIG

CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
OTHERS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "NPROC_PER_NODE", "SLURM_STEP_ID")


@pytest.fixture
def pod_env(monkeypatch):
    for var in OTHERS + ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "HOROVOD_SIZE"):
        monkeypatch.setenv(var, "")  # recorded, so that what take_pod_numbers sets (NODE_RANK, LOCAL_RANK) is undone
        monkeypatch.delenv(var)
    for var, value in zip(CONTRACT, ("job-master-0", "23456", "2", "1"), strict=True):
        monkeypatch.setenv(var, value)
    return monkeypatch


def test_the_contract_alone_is_a_pod_and_any_launcher_variable_is_not(pod_env):
    assert pod_job() == PodJob(pods=2, index=1, processes_per_pod=1)
    pod_env.setenv("NPROC_PER_NODE", "4")
    assert pod_job() == PodJob(pods=2, index=1, processes_per_pod=4)
    for var in ("LOCAL_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"):  # torchrun, Lightning, srun
        pod_env.setenv(var, "0")
        assert pod_job() is None, var
        pod_env.delenv(var)
    pod_env.delenv("MASTER_ADDR")
    assert pod_job() is None


def test_a_pod_becomes_a_node_of_one_device_and_what_disagrees_is_one_line(pod_env):
    trainer = Namespace(devices="auto", num_nodes=1)
    take_pod_numbers(trainer, PodJob(2, 1, 1), devices_given=False)
    assert (trainer.devices, trainer.num_nodes) == (1, 2)
    assert (os.environ["NODE_RANK"], os.environ["LOCAL_RANK"]) == ("1", "0")
    with pytest.raises(UserError, match=r"NPROC_PER_NODE=4: .*torchrun --nnodes \$WORLD_SIZE --node_rank \$RANK"):
        take_pod_numbers(Namespace(devices="auto", num_nodes=1), PodJob(2, 1, 4), devices_given=False)
    with pytest.raises(UserError, match=r"--trainer.devices=2, but the platform started one process in this pod"):
        take_pod_numbers(Namespace(devices=2, num_nodes=1), PodJob(2, 1, 1), devices_given=True)
    with pytest.raises(UserError, match=r"--trainer.num_nodes=3, but the platform started 2 pods \(WORLD_SIZE\)"):
        take_pod_numbers(Namespace(devices="auto", num_nodes=3), PodJob(2, 1, 1), devices_given=False)


@pytest.mark.slow
def test_two_pods_given_only_the_platforms_variables_train_one_run_together(tmp_path):
    """Before, each pod trained alone (world size 1) and exited 0. Now both are ranks of one ddp run: one run folder,
    a checkpoint written by 2 ranks, the epoch line says so, and rank 0 names what it found in one line."""
    root, cwd = tmp_path / "pvc", tmp_path / "workdir"  # the shared volume; the image's working directory
    cwd.mkdir()
    port = str(find_free_network_port())
    base = {k: v for k, v in os.environ.items() if k not in OTHERS and not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    command = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), "--trainer.max_epochs=1"]
    command += ["--trainer.accelerator=cpu", f"--trainer.default_root_dir={root}"]
    pods = []
    for rank in (0, 1):
        contract = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank)}
        env = {**base, **contract, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        log = (tmp_path / f"pod{rank}.log").open("w")
        pods.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [pod.wait(timeout=300) for pod in pods]
    logs = [(tmp_path / f"pod{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], logs[0][-3000:] + "\n--- pod 1:\n" + logs[1][-3000:]
    said = "WORLD_SIZE=2 and RANK=0 with no launcher (a PyTorchJob's pod): 2 node(s), one process and device each"
    assert said in logs[0] and "WORLD_SIZE=2 and RANK=1" not in logs[1]
    assert "2 x cpu (ddp)" in logs[0], logs[0][-3000:]
    [run] = (root / "lightning_logs").glob("version_*")
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    [state] = [v for k, v in last["callbacks"].items() if k.startswith("RandomState")]
    assert state["world_size"] == 2
    assert sorted(p.name for p in cwd.iterdir()) == []  # nothing written where the image starts
    assert not Path(root / "lightning_logs" / "version_1").exists()
