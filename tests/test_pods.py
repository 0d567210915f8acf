"""A training platform's pods (Kubeflow's PyTorchJob without nprocPerNode, Trainer v2, Vertex AI, PAI-DLC): each pod
runs the image's entrypoint once, with ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (pods) and ``RANK`` (its index)
and no launcher (app/launch/pods.py). Two "pods" here are two processes on this machine given exactly that
environment, started from another working directory; they train one run together. (Each pod as a podman container
of the image on a node of its own: tests/test_kubernetes.py.)"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from app.errors import UserError
from app.launch.launcher import PodJob, pod_job
from app.launch.pods import check_resolves, take_pod_numbers
from tests.conftest import ROOT, TINY_CONFIG

CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
OTHERS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "NPROC_PER_NODE", "SLURM_STEP_ID")


@pytest.fixture
def pod_env(monkeypatch):
    for var in OTHERS + ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "HOROVOD_SIZE"):
        monkeypatch.setenv(var, "")  # recorded, so that what take_pod_numbers sets (NODE_RANK, LOCAL_RANK) is undone
        monkeypatch.delenv(var)
    for var, value in zip(CONTRACT, ("localhost", "23456", "2", "1"), strict=True):
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
    pod_env.setenv("RANK", "x")
    assert pod_job() == PodJob(pods=2, index=-1, processes_per_pod=4)  # not a number: take_pod_numbers says so
    pod_env.delenv("MASTER_ADDR")
    assert pod_job() is None


def test_a_pod_becomes_a_node_of_one_device_and_what_disagrees_is_one_line(pod_env):
    trainer = Namespace(devices="auto", num_nodes=1)
    take_pod_numbers(trainer, PodJob(2, 1, 1), devices_given=False)
    assert (trainer.devices, trainer.num_nodes) == (1, 2)
    assert (os.environ["NODE_RANK"], os.environ["LOCAL_RANK"], os.environ["RANK"]) == ("1", "0", "1")
    with pytest.raises(UserError, match=r"--trainer.devices=2, but the platform starts one process in this pod"):
        take_pod_numbers(Namespace(devices=2, num_nodes=1), PodJob(2, 1, 1), devices_given=True)
    with pytest.raises(UserError, match=r"--trainer.num_nodes=3, but the platform started 2 pods \(WORLD_SIZE\)"):
        take_pod_numbers(Namespace(devices="auto", num_nodes=3), PodJob(2, 1, 1), devices_given=False)
    for pod in (PodJob(2, 2, 1), PodJob(0, 0, 1), PodJob(2, -1, 1), PodJob(2, 0, -1)):
        with pytest.raises(UserError, match=r"RANK must be the pod's index, 0 to WORLD_SIZE-1"):
            take_pod_numbers(Namespace(devices="auto", num_nodes=1), pod, devices_given=False)


def test_nproc_per_node_makes_the_pod_a_node_whose_other_ranks_lightning_starts(pod_env):
    """NPROC_PER_NODE=2 (the cloud platforms' form): the pod is a node of 2 devices, Lightning's launcher starts its
    local rank 1 (no LOCAL_RANK here), RANK and WORLD_SIZE become the ranks'; that child, which inherits them, is
    told the same numbers again (its command line is the pod's)."""
    pod_env.setenv("NPROC_PER_NODE", "2")
    trainer = Namespace(devices="auto", num_nodes=1)
    take_pod_numbers(trainer, pod_job(), devices_given=False)
    assert (trainer.devices, trainer.num_nodes) == (2, 2)
    assert (os.environ["NODE_RANK"], os.environ["WORLD_SIZE"]) == ("1", "4")
    assert "LOCAL_RANK" not in os.environ and "RANK" not in os.environ
    pod_env.setenv("LOCAL_RANK", "1")  # what Lightning's launcher gives the child
    assert pod_job() == PodJob(pods=2, index=1, processes_per_pod=2)
    child = Namespace(devices=1, num_nodes=1)  # (the config file's devices)
    take_pod_numbers(child, pod_job(), devices_given=False)
    assert (child.devices, child.num_nodes) == (2, 2)
    with pytest.raises(UserError, match=r"--trainer.devices=4, but the platform starts NPROC_PER_NODE=2 processes"):
        take_pod_numbers(Namespace(devices=4, num_nodes=1), PodJob(2, 1, 2), devices_given=True)


def test_a_master_addr_that_does_not_resolve_is_one_line_after_a_bounded_wait(pod_env):
    started = time.monotonic()
    with pytest.raises(UserError, match=r"MASTER_ADDR=job-master-0.invalid does not resolve .* after 2 s"):
        check_resolves("job-master-0.invalid", "23456", seconds=2)
    assert time.monotonic() - started < 30
    check_resolves("127.0.0.1", "23456", seconds=0)  # an address, or a name that resolves: at once


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


KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"


def test_the_docs_manifests_start_the_pods_as_the_tests_do():
    """docs/kubernetes.md's PyTorchJob and TrainJob parse, and what the template relies on in them is what
    tests/test_kubernetes.py runs the image with: the command, ``--ckpt_path=last``, the volumes'
    mount points, shared memory, the restart policy; every variable the page names is one those tests set."""
    from tests import test_kubernetes as pods

    text = KUBERNETES_DOC.read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    [job] = [b for b in blocks if b["kind"] == "PyTorchJob"]
    [train] = [b for b in blocks if b["kind"] == "TrainJob"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    mounts = {"/app/lightning_logs", "/app/data", "/dev/shm"}  # the image's volumes (Dockerfile) and --shm-size
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"  # the lost pod's restart (the test starts both again)
        pod = spec["template"]["spec"]
        [box] = pod["containers"]
        assert box["name"] == "pytorch" and "command" not in box  # the image's entrypoint, as the tests run it
        assert box["args"][0] == "fit" and pods.RESUME in box["args"]
        assert box["resources"]["limits"]["nvidia.com/gpu"] == 1  # one process, one device
        assert {m["mountPath"] for m in box["volumeMounts"]} == mounts
        [shm] = [v for v in pod["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"] == {"medium": "Memory"}
    trainer = train["spec"]["trainer"]
    assert train["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainer["command"][:3] == ["torchrun", "cli.py", "fit"]  # the torchrun test's entrypoint and arguments
    assert pods.RESUME in trainer["command"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]
    [override] = train["spec"]["podTemplateOverrides"]
    [box] = override["spec"]["containers"]
    assert {m["mountPath"] for m in box["volumeMounts"]} == mounts
    set_by_tests = {*pods.pytorchjob_env(0), *pods.torchrun_env(0), "NPROC_PER_NODE"}
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", text))
    assert named and named <= set_by_tests, named - set_by_tests
