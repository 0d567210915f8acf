"""Which launcher started this process, and where the process stands in the job: the one place that reads the
launchers' environment variables (mpirun/horovodrun, torchrun, Lightning's own ddp children, srun).

Everything that asks "is this global rank 0, before any strategy has set ranks up", "did MPI start me" or "is
this a torchrun worker that may be restarted" asks here.
"""

from __future__ import annotations

import os
import select
import signal
from dataclasses import dataclass

# (world size, rank, local rank, local size) variables of each launcher, most specific first.
_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("HOROVOD_SIZE", "HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_SIZE", "PMIX_RANK", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


def launcher_ranks() -> tuple[int, int, int, int] | None:
    """``(world_size, rank, local_rank, local_size)`` from the launcher's variables, or None outside a launch."""
    env = os.environ
    for size, rank, local_rank, local_size in _LAUNCHER_VARS:
        if size in env and rank in env:
            world = int(env[size])
            # srun with PMI (SLURM's MpiDefault=pmi2) sets PMI_SIZE and PMI_RANK but no local rank: SLURM says it
            local = env.get(local_rank, env.get("SLURM_LOCALID", env[rank]))
            return world, int(env[rank]), int(local), int(env.get(local_size) or slurm_tasks_per_node() or world)
    return None


def wait_for_first_on_node(timeout: float) -> None:
    """Until this node's first process (local rank 0, started by the same launcher as this one) has exited, at most
    ``timeout`` seconds; at once where there is none, or it cannot be told (no ``/proc``, no pidfd: Linux < 5.3)."""
    pid = _first_on_node_sibling()
    if pid is None:
        return
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already; or no pidfd
        return
    try:
        select.select([fd], [], [], timeout)  # a pidfd is readable once its process has exited
    finally:
        os.close(fd)


def _first_on_node_sibling() -> int | None:
    """The pid of the process that shares this one's parent (torchrun's agent, mpirun or its node's daemon) and is
    local rank 0 by the launcher's variable, from ``/proc``; None where there is none."""
    env = os.environ
    variable = next((local for size, rank, local, _ in _LAUNCHER_VARS if size in env and rank in env), "LOCAL_RANK")
    variable = variable.encode()
    parent, me = os.getppid(), os.getpid()
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != me]
    except OSError:
        return None
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) != parent:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if variable + b"=0" in f.read().split(b"\0"):
                    return pid
        except (OSError, ValueError, IndexError):
            continue
    return None


def one_gpu_per_rank() -> bool:
    """Whether this MPI rank, one of several on its node, was given a GPU of its own: it sees exactly one, named in
    ``CUDA_VISIBLE_DEVICES`` (SLURM's ``--gpus-per-task`` / ``--gpu-bind``, wrappers that bind one GPU per rank).
    Its device is then its one visible GPU, not the node's GPU number ``local rank``."""
    ranks = launcher_ranks()
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if ranks is None or ranks[3] < 2 or len(visible) != 1:
        return False
    import torch

    return torch.cuda.device_count() == 1


def slurm_tasks_per_node() -> int | None:
    """The tasks SLURM starts on this node (``SLURM_NTASKS_PER_NODE``, or ``SLURM_STEP_TASKS_PER_NODE`` /
    ``SLURM_TASKS_PER_NODE`` such as ``4(x2)`` or ``4,3``, read for this node's ``SLURM_NODEID``), or None."""
    env = os.environ
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    per_node: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit():
            return None
        per_node += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return per_node[node] if node < len(per_node) else None


def device_count(devices) -> int:
    """The number of devices a ``--trainer.devices`` value names: ``4``, ``"0,1"``, ``[0, 1]``."""
    if isinstance(devices, list | tuple):
        return len(devices)
    text = str(devices)
    return len([d for d in text.split(",") if d.strip()]) if "," in text else int(text)


def take_launcher_counts(config, devices_given: bool, per_node: int, nodes: int, *errors: str | None) -> None:
    """A launcher started ``per_node`` processes on each of ``nodes`` nodes: ``config.devices`` left at auto (or set by
    a config file rather than on the command line: ``devices_given`` false) and ``config.num_nodes`` left at 1 take
    those numbers (given devices of the right count stay: ``"2,3"``). A given value that disagrees is the error
    ``errors`` names for it (devices, nodes), said in one line; a nodes error of None lets the launcher's count
    replace the given one."""
    from app.errors import UserError

    devices_error, nodes_error = errors
    if not devices_given or config.devices in ("auto", None, -1, "-1"):
        config.devices = per_node
    elif device_count(config.devices) != per_node:
        raise UserError(devices_error)
    if config.num_nodes not in (1, None, nodes) and nodes_error is not None:
        raise UserError(nodes_error)
    config.num_nodes = nodes


def mpi_world_size() -> int:
    """Number of ranks this process was launched with by an MPI launcher (1 when there is none)."""
    ranks = launcher_ranks()
    return ranks[0] if ranks else 1


@dataclass(frozen=True)
class TorchrunJob:
    run_id: str
    world_size: int
    local_world_size: int
    nodes: int
    restart_count: int
    max_restarts: int

    @property
    def restarts_possible(self) -> bool:
        """torchrun was given ``--max-restarts`` > 0: a failure may be followed by a start that continues the run."""
        return self.max_restarts > 0

    @property
    def restarts_left(self) -> bool:
        """torchrun will start the job again after a failure of this start (its restarts are not used up)."""
        return self.restart_count < self.max_restarts

    @property
    def start_name(self) -> str:
        """What this start is called in the names of its files (``config.restart2.yaml``): torchrun counts the
        restarts after a failure, not those that take in a node that joins."""
        return f"restart{self.restart_count}" if self.restart_count else "rejoined"


def torchrun_job() -> TorchrunJob | None:
    """The torchrun job this process is a worker of, or None when torchrun did not start it."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_WORLD_SIZE" not in env:
        return None
    world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    return TorchrunJob(
        run_id=env["TORCHELASTIC_RUN_ID"],
        world_size=world,
        local_world_size=local,
        nodes=int(env.get("GROUP_WORLD_SIZE", world // max(local, 1))),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
    )


# What ``#SBATCH --signal=USR1@SECONDS`` sends the job's tasks before its time limit (Lightning's SLURMEnvironment
# takes the same signal for its requeue)
SLURM_WARNING_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job this process runs in: its id (the same in every start of the job), how many times SLURM has
    requeued it, and whether ``sbatch`` started it (SLURM requeues batch jobs only)."""

    job_id: str  # "1234", or "1234_7" for a task of a job array
    restart_count: int  # SLURM_RESTART_COUNT: 0 in the first start, N after the N-th requeue
    batch: bool  # submitted with sbatch: a requeue runs its script again
    in_step: bool  # this process is a task of a job step (srun), not the batch script itself
    nodes: int  # the job's nodes (#SBATCH --nodes)
    tasks: int  # the tasks of this step (srun's, or the job's in its batch script): SLURM_NTASKS
    tasks_per_node: int | None  # this node's share of them (:func:`slurm_tasks_per_node`)

    @property
    def run_id(self) -> str:
        """The id its run folder is marked with (app/checkpoints/run_folders.py)."""
        return f"slurm-{self.job_id}"

    @property
    def restarts_possible(self) -> bool:
        """SLURM may start it again after a stop (requeue, preemption, a failed node): a batch job."""
        return self.batch

    @property
    def start_name(self) -> str:
        return f"requeue{self.restart_count}"


def slurm_job() -> SlurmJob | None:
    """The SLURM job this process runs in (inside ``sbatch``, ``salloc`` or ``srun``), or None outside SLURM."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    count = env.get("SLURM_RESTART_COUNT", "0")
    return SlurmJob(
        job_id=f"{array}_{task}" if array and task else env["SLURM_JOB_ID"],
        restart_count=int(count) if count.isdigit() else 0,
        batch=_started_by_sbatch(),
        in_step=bool(env.get("SLURM_STEP_ID")),
        nodes=_number(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"), 1),
        tasks=_number(env.get("SLURM_NTASKS"), 1),
        tasks_per_node=slurm_tasks_per_node(),
    )


@dataclass(frozen=True)
class PodJob:
    """A pod of a training platform that starts one process per pod and hands it torch's environment contract:
    Kubeflow's PyTorchJob without ``nprocPerNode`` (Lightning's ``KubeflowEnvironment``), Trainer v2, and the cloud
    platforms that do the same (Vertex AI, PAI-DLC, Baidu AIHC)."""

    pods: int  # WORLD_SIZE
    index: int  # RANK
    processes_per_pod: int  # NPROC_PER_NODE where the platform sets it, else 1 (-1 in each: not a number)


def pod_job() -> PodJob | None:
    """This process's pod when ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` are set and no launcher
    started it (no torchrun, Lightning's own ddp ranks, SLURM task or MPI rank), else None. Lightning alone takes
    such a process for a run of its own: every pod trained alone, with no word. Also a local rank that Lightning's
    launcher started in a pod of ``NPROC_PER_NODE`` processes (app/launch/pods.py gave it ``NODE_RANK``, no
    ``RANK``)."""
    env = os.environ
    if not all(env.get(var, "").strip() for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")):
        return None
    if any(var in env for var in ("TORCHELASTIC_RUN_ID", "GROUP_RANK")) or env.get("SLURM_STEP_ID"):
        return None
    if launcher_ranks() is not None:
        return None
    per_pod = _number(env.get("NPROC_PER_NODE", "").strip() or "1", -1)
    if "LOCAL_RANK" in env or "NODE_RANK" in env:  # Lightning's launcher, or a node started by hand
        if per_pod > 1 and "RANK" not in env and "LOCAL_RANK" in env and "NODE_RANK" in env:
            return PodJob(_number(env["WORLD_SIZE"], 0) // per_pod, _number(env["NODE_RANK"], -1), per_pod)
        return None
    if not env.get("RANK", "").strip():
        return None
    return PodJob(_number(env["WORLD_SIZE"].strip(), -1), _number(env["RANK"].strip(), -1), per_pod)


def _number(text: str | None, default: int) -> int:
    return int(text) if text and text.isdigit() else default


def _started_by_sbatch() -> bool:
    # sbatch sets ENVIRONMENT=BATCH in the batch script's environment, which srun hands on to the job's tasks
    return os.environ.get("ENVIRONMENT") == "BATCH"


def is_first_process() -> bool:
    """True in the process that becomes global rank 0 (before any strategy has set ranks up)."""
    ranks = launcher_ranks()  # mpirun / horovodrun
    if ranks is not None:
        return ranks[1] == 0
    # torchrun sets RANK; Lightning's ddp children LOCAL_RANK; a second node's launcher NODE_RANK; srun SLURM_PROCID.
    # Under `srun torchrun` SLURM_PROCID numbers the torchrun agents, and torchrun may give rank 0 to another node's
    # worker (it orders the nodes itself): its RANK alone says.
    if torchrun_job() is not None:
        return os.environ.get("RANK", "0") == "0"
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def first_on_node() -> bool:
    """Whether this is the first process of its node (local rank 0): the one that prints a bad-input error. Under
    ``mpirun`` or ``torchrun`` every rank checks the same command line and files and finds the same error; the
    others exit 2 without printing it again (8 times on an 8-GPU node). A node-specific error still shows, once per
    node."""
    ranks = launcher_ranks()
    return (ranks[2] if ranks is not None else int(os.environ.get("LOCAL_RANK") or 0)) == 0


@dataclass(frozen=True)
class TorchrunAgent:
    pid: int
    endpoint: tuple[str, int] | None  # where it meets the other nodes' agents (the rendezvous), when it says

    @property
    def where(self) -> str:
        return f"{self.endpoint[0]}:{self.endpoint[1]}" if self.endpoint else "?"


def torchrun_agent() -> TorchrunAgent | None:
    """This worker's torchrun agent, from ``/proc`` (Linux): its nearest ancestor process that runs torchrun (within
    three levels: a wrapper such as ``sh -c`` may stand between), and the rendezvous endpoint its command line gives.
    None when torchrun did not start this process, or where ``/proc`` cannot tell."""
    if torchrun_job() is None:
        return None
    found = _ancestor(lambda args: any(os.path.basename(a) == "torchrun" or a == "torch.distributed.run" for a in args))
    return TorchrunAgent(found[0], _rendezvous_endpoint(found[1])) if found else None


MPI_DAEMONS = ("mpirun", "mpiexec", "prterun", "prted", "orterun", "orted", "hydra_pmi_proxy")


def mpi_daemon() -> tuple[int, str] | None:
    """The Open MPI (or MPICH) process that started this rank, from ``/proc``: ``(pid, name)`` of mpirun on the node
    it runs on, the node's daemon (``prted``) on the others; None when MPI did not start this process."""
    if launcher_ranks() is None or torchrun_job() is not None:
        return None
    found = _ancestor(lambda args: os.path.basename(args[0]) in MPI_DAEMONS)
    return (found[0], os.path.basename(found[1][0])) if found else None


def _ancestor(matches, levels: int = 3) -> tuple[int, list[str]] | None:
    """The nearest of this process's ancestors (within ``levels``) whose command line ``matches``: (pid, args)."""
    pid = os.getppid()
    for _ in range(levels):
        args = _cmdline(pid)
        if not args:
            return None
        if matches(args[:3]):
            return pid, args
        pid = _parent_pid(pid)
        if pid <= 1:
            return None
    return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state, parent pid, ...); None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # "(comm)" may hold spaces and parentheses: split after it
    except (OSError, IndexError):
        return None


def _parent_pid(pid: int) -> int:
    fields = proc_stat(pid)
    return int(fields[1]) if fields and len(fields) > 1 and fields[1].isdigit() else 0


def _option(args: list[str], *names: str) -> str | None:
    """The value of torchrun's option ``--name=value`` or ``--name value`` (each spelling in ``names``)."""
    for i, arg in enumerate(args):
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
            if arg == name and i + 1 < len(args):
                return args[i + 1]
    return None


def _rendezvous_endpoint(args: list[str]) -> tuple[str, int] | None:
    """``--rdzv-endpoint=HOST[:PORT]`` (c10d's port 29400 by default); for a static rendezvous (none given), the
    ``--master-addr``/``--master-port`` pair, torchrun's 127.0.0.1:29500 by default."""
    endpoint = _option(args, "--rdzv-endpoint", "--rdzv_endpoint")
    try:
        if endpoint:
            host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
            return host.strip("[]"), int(port)
        host = _option(args, "--master-addr", "--master_addr") or "127.0.0.1"
        return host, int(_option(args, "--master-port", "--master_port") or 29500)
    except ValueError:
        return None


# ---------------------------------------------------------------- the horovod strategy's own mpirun launch
# It sets these in its ranks' environment (``--trainer.strategy.max_restarts``); app/launch/restarts.py reads them.
MPI_RESTARTS_LEFT = "TEMPLATE_MPI_RESTARTS_LEFT"  # how many more times the launcher restarts the ranks
MPI_RESTART = "TEMPLATE_MPI_RESTART"  # which start this is: 0 first, 1 the first restart, ...


def self_launch_restarts() -> tuple[int, int]:
    """``(which start this is, restarts left)`` of the horovod strategy's own mpirun launch; ``(0, 0)`` outside it."""
    return int(os.environ.get(MPI_RESTART, "0")), int(os.environ.get(MPI_RESTARTS_LEFT, "0"))


def mpi_job_id() -> str:
    """The MPI job's id (Open MPI's, PMIx's or PMI's), the same in every rank of the job; "" when none says it."""
    return (
        os.environ.get("OMPI_MCA_ess_base_jobid")  # noqa: SIM112
        or os.environ.get("PMIX_NAMESPACE")
        or os.environ.get("PMI_ID", "")
    )


def rendezvous_address() -> tuple[str | None, int | None]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` where the launcher or the user set them, else None for each."""
    port = os.environ.get("MASTER_PORT")
    return os.environ.get("MASTER_ADDR") or None, int(port) if port else None


def this_rank() -> str:
    """This process as the others' line names it, before any strategy has set ranks up."""
    env = os.environ
    for var in ("RANK", "SLURM_PROCID"):
        if env.get(var, "").isdigit():
            return f"rank {env[var]}"
    node, local = env.get("NODE_RANK") or env.get("GROUP_RANK") or "0", env.get("LOCAL_RANK") or "0"
    return "rank 0" if node == local == "0" else f"node {node}'s local rank {local}"


def expected_ranks() -> int | None:
    """The processes of the run, where the launcher says it before the strategy exists."""
    env = os.environ
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(var, "").isdigit():
            return int(env[var])
    return None
