"""Kubernetes and the cloud training platforms: a pod started with torch's environment contract and no launcher.

Kubeflow's PyTorchJob (without ``nprocPerNode``), Kubeflow Trainer v2, Vertex AI, PAI-DLC and Baidu AIHC start the
same image in N pods and give each ``MASTER_ADDR`` (the master pod's service name), ``MASTER_PORT``, ``WORLD_SIZE``
(N) and ``RANK`` (the pod's index). Nobody runs torchrun: the image's own entrypoint runs, once per pod. Lightning has
``KubeflowEnvironment`` for this but does not detect it, and its default environment takes such a process for a run
of its own: every pod trained alone, to the end, and exited 0.

Here each pod is a node of one device: ``--trainer.num_nodes`` becomes ``WORLD_SIZE`` and the pod's rank its node
rank (``NODE_RANK``; ``LOCAL_RANK`` 0: the process is the node's one rank, started from outside). Where the platform
says ``NPROC_PER_NODE`` (more processes per pod), the pod runs torchrun, as those platforms' own docs show: one line
says the command. (Kubernetes itself was not run here: docs/multi-node.md.)
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities import rank_zero_info

from app.errors import UserError
from app.launch.launcher import PodJob, device_count


def take_pod_numbers(trainer_config, pod: PodJob, devices_given: bool) -> None:
    """Make this process node ``pod.index`` of ``pod.pods``, with one device: the trainer's ``num_nodes`` and
    ``devices``, and the variables Lightning reads (``NODE_RANK``, ``LOCAL_RANK``)."""
    if pod.processes_per_pod > 1:
        raise UserError(
            f"NPROC_PER_NODE={pod.processes_per_pod}: this pod should run {pod.processes_per_pod} processes; start "
            "them with torchrun: torchrun --nnodes $WORLD_SIZE --node_rank $RANK --nproc_per_node $NPROC_PER_NODE "
            "--master_addr $MASTER_ADDR --master_port $MASTER_PORT cli.py fit ..."
        )
    devices = trainer_config.devices
    if devices_given and devices not in ("auto", None, -1, "-1") and device_count(devices) != 1:
        raise UserError(
            f"--trainer.devices={devices}, but the platform started one process in this pod (RANK {pod.index} of "
            f"WORLD_SIZE {pod.pods}), which drives one device; drop --trainer.devices, or give the pod "
            "NPROC_PER_NODE and run torchrun in it"
        )
    nodes = trainer_config.num_nodes
    if nodes not in (1, None) and nodes != pod.pods:
        raise UserError(
            f"--trainer.num_nodes={nodes}, but the platform started {pod.pods} pods (WORLD_SIZE); drop "
            "--trainer.num_nodes or make the two equal"
        )
    trainer_config.devices, trainer_config.num_nodes = 1, pod.pods
    os.environ["NODE_RANK"], os.environ["LOCAL_RANK"] = str(pod.index), "0"
    rank_zero_info(
        f"WORLD_SIZE={pod.pods} and RANK={pod.index} with no launcher (a PyTorchJob's pod): {pod.pods} node(s), one "
        f"process and device each, meeting at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    )
