"""Kubernetes and the cloud training platforms: a pod started with torch's environment contract and no launcher.

Kubeflow's PyTorchJob (without ``nprocPerNode``), Kubeflow Trainer v2, Vertex AI, PAI-DLC and Baidu AIHC start the
same image in N pods and give each ``MASTER_ADDR`` (the master pod's service name), ``MASTER_PORT``, ``WORLD_SIZE``
(N) and ``RANK`` (the pod's index). Nobody runs torchrun: the image's own entrypoint runs, once per pod. Lightning has
``KubeflowEnvironment`` for this but does not detect it, and its default environment takes such a process for a run
of its own: every pod trained alone, to the end, and exited 0.

Here each pod is a node: ``--trainer.num_nodes`` becomes ``WORLD_SIZE`` and the pod's index its node rank
(``NODE_RANK``). With one process per pod, that process is the node's one rank, started from outside (``LOCAL_RANK``
0). Where the platform also sets ``NPROC_PER_NODE`` (the cloud platforms' form), the pod runs that many: Lightning's
own launcher starts the others, as on any node it launches, and ``RANK`` and ``WORLD_SIZE`` become theirs. A contract
that contradicts itself or the command line is one line on every pod. (How it was run here: docs/kubernetes.md.)
"""

from __future__ import annotations

import os
import socket
import time

from lightning.pytorch.utilities import rank_zero_info

from app.errors import UserError
from app.launch.launcher import PodJob, take_launcher_counts

# A just-created pod's service name can take seconds to appear in the cluster's DNS (Kubeflow's PyTorchJob once ran
# an init container that waited for it); after this long, a name that still does not resolve is a wrong one.
RESOLVE_SECONDS = 20.0


def take_pod_numbers(trainer_config, pod: PodJob, devices_given: bool) -> None:
    """Make this process node ``pod.index`` of ``pod.pods`` with ``pod.processes_per_pod`` devices: the trainer's
    ``num_nodes`` and ``devices``, and the variables Lightning reads (``NODE_RANK``, and ``LOCAL_RANK`` 0 for a pod's
    one process). One line where the contract or the command line disagrees."""
    per_pod = pod.processes_per_pod
    if pod.pods < 1 or per_pod < 1 or not 0 <= pod.index < pod.pods:
        raise UserError(
            f"RANK={pod.index}, WORLD_SIZE={pod.pods}"
            + (f", NPROC_PER_NODE={per_pod}" if per_pod != 1 else "")
            + ": RANK must be the pod's index, 0 to WORLD_SIZE-1, and WORLD_SIZE and NPROC_PER_NODE whole numbers of "
            "at least 1; fix the job's replicas or these variables"
        )
    started = "one process" if per_pod == 1 else f"NPROC_PER_NODE={per_pod} processes"
    take_launcher_counts(
        trainer_config, devices_given, per_pod, pod.pods,
        f"--trainer.devices={trainer_config.devices}, but the platform starts {started} in this pod (RANK {pod.index} "
        f"of WORLD_SIZE {pod.pods}), one device each; drop --trainer.devices, or set NPROC_PER_NODE to the devices "
        "the pod should use",
        f"--trainer.num_nodes={trainer_config.num_nodes}, but the platform started {pod.pods} pods (WORLD_SIZE); drop "
        "--trainer.num_nodes or make the two equal",
    )  # fmt: skip
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    check_resolves(address, port)
    os.environ["NODE_RANK"] = str(pod.index)
    if per_pod == 1:
        os.environ["LOCAL_RANK"] = "0"  # the node's one rank, started from outside: Lightning launches nothing
    else:  # Lightning's launcher starts local ranks 1.. with these; the pod's RANK was its node rank, not a rank
        os.environ["WORLD_SIZE"] = str(pod.pods * per_pod)
        os.environ.pop("RANK", None)
    each = "one process and device each" if per_pod == 1 else f"{per_pod} processes and devices each"
    rank_zero_info(
        f"WORLD_SIZE={pod.pods} and RANK={pod.index} with no launcher (a PyTorchJob's pod): {pod.pods} node(s), "
        f"{each}, meeting at {address}:{port}"
    )


def check_resolves(address: str, port: str, seconds: float = RESOLVE_SECONDS) -> None:
    """Wait up to ``seconds`` for ``address`` to resolve; then one line. Without this, torch's store retries an
    unknown name for its 30 minutes. (DNS has no event to wait on: the name is asked for once a second.)"""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.getaddrinfo(address, int(port), type=socket.SOCK_STREAM)
            return
        except socket.gaierror as err:
            if err.errno not in (socket.EAI_NONAME, socket.EAI_AGAIN, getattr(socket, "EAI_NODATA", None)):
                raise UserError(f"MASTER_ADDR={address}: {err.strerror}") from None
            if time.monotonic() >= deadline:
                raise UserError(
                    f"MASTER_ADDR={address} does not resolve ({err.strerror}) after {seconds:.0f} s: it must name the "
                    "master pod (its service, <job>-master-0 in a PyTorchJob) or its address; check the job's name "
                    "and that the master pod exists"
                ) from None
        time.sleep(1.0)
