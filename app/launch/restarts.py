"""Runs under torchrun's elastic agent: the numbers it gives, and the run folder its restarts continue in.

torchrun (``torch.distributed.run``) starts ``--nproc_per_node`` workers per node and, with ``--max-restarts=R``,
restarts all of a node's workers when one fails or when the set of nodes changes, after a new rendezvous with
whoever is there (``--nnodes=MIN:MAX``). Every restart runs this program again from the start, with the world
size of the re-formed job in its environment. This module reads that environment:

- the number of processes per node and the number of nodes, which Lightning otherwise wants repeated as
  ``--trainer.devices``/``--trainer.num_nodes`` (and refuses when they differ from the launcher's: a job that
  lost a node could not go on);
- whether this start is a restart, and which one: a restart continues the first start's run (its ``last.ckpt``,
  its ``metrics.csv``) instead of starting a new one. Which folder that is, app/checkpoints/run_folders.py finds
  (the job's rendezvous id, written into it as ``elastic.json`` by the first start).

A SLURM batch job is started again the same way when SLURM requeues it (app/launch/slurm.py): its later starts
continue its run too, and a rank that survives a lost one saves and asks SLURM for the requeue.
"""

from __future__ import annotations

import os
import socket

from lightning.pytorch.utilities import rank_zero_info

from app.errors import UserError
from app.launch.launcher import SlurmJob, TorchrunJob, self_launch_restarts, take_launcher_counts, torchrun_job
from app.launch.slurm import requeue, requeueable_job, requeued_here
from app.parallelism import configured_to_start_own_workers


def restarts_possible() -> bool:
    """True when a launcher will start this program again after a failure: torchrun with ``--max-restarts``, the
    horovod strategy's self-launch with restarts left (``--trainer.strategy.max_restarts``), or SLURM, which runs a
    batch job's script again when the job is requeued."""
    return _restarts("restarts_possible")


def restarts_left() -> bool:
    """True when a failure of this start will be followed by another (torchrun or the horovod self-launch has a
    restart left, or SLURM requeues the batch job: :func:`restart_after_failure`); what a rank may promise when it
    stops after a failure."""
    return _restarts("restarts_left")


def _restarts(torchrun_says: str) -> bool:
    job = torchrun_job()
    if job is not None and (getattr(job, torchrun_says) or requeueable_job() is None):
        return getattr(job, torchrun_says)
    return requeueable_job() is not None or self_launch_restarts()[1] > 0


def restart_after_failure() -> str:
    """What starts the job again after this start failed, for a rank's last line; a SLURM batch job is requeued
    here (SLURM does not requeue a job whose steps failed by itself: it is FAILED once its script ends)."""
    job = torchrun_job()
    if job is not None and (job.restarts_left or requeueable_job() is None):
        return "the launcher restarts the job"
    slurm = requeueable_job()
    if slurm is not None:
        refused = requeue(slurm)
        if refused is None and requeued_here(slurm):
            return f"this rank requeued SLURM job {slurm.job_id}, which resumes by itself"
        if refused is None:  # SLURM noticed first (a lost node past SlurmdTimeout) and requeued it itself
            return f"SLURM had requeued job {slurm.job_id} itself, which resumes by itself"
        return f"SLURM did not requeue the job ({refused}); submit it again with --ckpt_path last"
    return "the launcher restarts the job"


def is_restart() -> bool:
    """True in a start that a launcher made after a failure: it continues a run (torchrun restart, horovod restart,
    a requeued SLURM job)."""
    job = torchrun_job()
    if job is not None and job.restart_count > 0:
        return True
    slurm = requeueable_job()
    if slurm is not None and slurm.restart_count > 0:
        return True
    return self_launch_restarts()[0] > 0


def later_start(job: TorchrunJob | SlurmJob) -> bool:
    """Whether this start may continue a run of its job: any start of a torchrun job with restarts (torchrun does not
    count a restart that takes in a joining node), a SLURM job's once SLURM has requeued it (``SLURM_RESTART_COUNT``;
    a batch script that runs two fits in one job starts two runs)."""
    return isinstance(job, TorchrunJob) or job.restart_count > 0


def torchrun_restarts_possible() -> bool:
    """True under torchrun with ``--max-restarts`` > 0 (torchrun's own wording applies)."""
    job = torchrun_job()
    return job is not None and job.restarts_possible


def take_launcher_numbers(
    trainer_config, job: TorchrunJob, devices_given: bool = True, continuing: bool = False
) -> None:
    """Put torchrun's processes per node and node count into the trainer settings.

    ``--trainer.devices`` (left at auto, or set by a config file rather than on the command line: ``devices_given``
    false) and ``--trainer.num_nodes`` (left at 1) are taken from the launcher. A value given that disagrees is one
    line naming both numbers; in a start that continues the job's run (``continuing``: a restart or a node joining,
    after a first start that trained), the launcher's count replaces a given ``num_nodes`` (the job re-formed
    without, or with more, nodes). A restart after a first start that was refused is refused the same way.
    """
    strategy = trainer_config.strategy
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")
    if configured_to_start_own_workers(strategy):  # ddp_spawn, ddp_fork, ddp_notebook, dp
        raise UserError(
            f"--trainer.strategy={name} starts its own workers, but torchrun started this process as one of "
            f"{job.world_size}; under torchrun use --trainer.strategy=ddp (one process per device)"
        )
    if name == "horovod" or name.endswith(".HorovodStrategy"):  # each worker would start an mpirun of its own
        raise UserError(
            f"--trainer.strategy={name} runs its ranks under mpirun, but torchrun started this process as one of "
            f"{job.world_size}; under torchrun use --trainer.strategy=ddp, or run horovod without torchrun (python "
            "cli.py ... starts mpirun itself; docs/strategies.md)"
        )
    nodes = trainer_config.num_nodes
    take_launcher_counts(
        trainer_config, devices_given, job.local_world_size, job.nodes,
        f"--trainer.devices={trainer_config.devices}, but torchrun started {job.local_world_size} process(es) per node "
        f"(--nproc_per_node={job.local_world_size}); drop --trainer.devices under torchrun or make the two equal",
        None if continuing else f"--trainer.num_nodes={nodes}, but torchrun started {job.nodes} node(s) (--nnodes); "
        "drop --trainer.num_nodes under torchrun or make the two equal",
    )  # fmt: skip
    if nodes not in (1, None, job.nodes):  # continuing: the job re-formed without, or with more, nodes
        rank_zero_info(
            f"torchrun re-formed the job with {job.nodes} node(s): --trainer.num_nodes {nodes} -> {job.nodes}"
        )


def agent_of(job: TorchrunJob | SlurmJob) -> str:
    """Who starts this job's workers again: the torchrun agent (:func:`agent_id`), or SLURM itself for a batch job
    (the job's id: every start of it is the same job's)."""
    return agent_id() if isinstance(job, TorchrunJob) else job.run_id


def agent_id() -> str:
    """This worker's torchrun agent: its host and process id (the agent starts the worker, and restarts it with the
    same process id; a new ``torchrun`` command is another agent)."""
    return f"{socket.gethostname()}:{os.getppid()}"
