"""SLURM: asking it to requeue the job a run belongs to, and reading what it says of the job.

A batch job (``sbatch``) that SLURM requeues (``scontrol requeue``, preemption with ``PreemptMode=REQUEUE``, a job
that requeues itself) runs its batch script again with the same job id and ``SLURM_RESTART_COUNT`` one higher. The
run folder of the job's first start is marked with the job's id (app/checkpoints/run_folders.py), so the new start
goes on in that folder from its ``last.ckpt`` with no flag added. This module is what the run says to SLURM: the
requeue after a save (the time-limit warning ``--signal=USR1@N``, a lost node) and the job's state.
"""

from __future__ import annotations

import shutil
import subprocess

from app.errors import UserError
from app.launch.launcher import SLURM_WARNING_SIGNAL, SlurmJob, slurm_job, take_launcher_counts
from app.parallelism import configured_to_start_own_workers

SCONTROL_TIMEOUT_S = 20  # slurmctld answers in milliseconds; a lost controller must not hold up a stopping run
_requeued: list[str] = []  # the jobs this process has requeued: once is enough


def requeueable_job() -> SlurmJob | None:
    """The SLURM batch job this process belongs to, which SLURM can start again (requeue); None elsewhere."""
    job = slurm_job()
    return job if job is not None and job.batch else None


def requeued_here(job: SlurmJob) -> bool:
    """Whether this process requeued ``job`` (not SLURM by itself: a lost node it noticed first, a preemption)."""
    return job.job_id in _requeued


def requeue(job: SlurmJob) -> str | None:
    """Ask SLURM to requeue ``job`` (``scontrol requeue``): None once it is done (or was, by this process), else
    why not, in SLURM's words. SLURM then stops the job's steps (SIGTERM, SIGKILL after ``KillWait``) and runs its
    batch script again when the job's nodes are free."""
    if job.job_id in _requeued:
        return None
    if shutil.which("scontrol") is None:
        return "no scontrol command on this node"
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job.job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"scontrol requeue {job.job_id} had no answer within {SCONTROL_TIMEOUT_S} s"
    if result.returncode != 0:
        restarts = job_fields(job).get("Restarts", "")
        if restarts.isdigit() and int(restarts) > job.restart_count:
            return None  # SLURM requeued it already (a lost node, a preemption): "Job is pending execution"
        said = " ".join((result.stderr or result.stdout).split()) or f"exit code {result.returncode}"
        return f"scontrol requeue {job.job_id}: {said}"
    _requeued.append(job.job_id)
    return None


def job_fields(job: SlurmJob) -> dict[str, str]:
    """``scontrol show job -o``'s fields of ``job`` (JobState, Reason, Requeue, BatchFlag, ...); {} when SLURM does
    not answer."""
    try:
        result = subprocess.run(
            ["scontrol", "show", "job", "-o", job.job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    fields = {}
    for word in result.stdout.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def after_stop(job: SlurmJob, signum: int) -> str:
    """What follows a stop whose state is saved, for the run's last line. A stop that SLURM's time limit caused (its
    warning signal, or the SIGTERM at the limit) requeues the job here; one that SLURM requeues by itself (``scontrol
    requeue``, preemption) needs nothing; a cancelled job is over.

    While SLURM delivers its SIGTERM, ``scontrol show job`` says (SLURM 22.05): at the time limit JobState=COMPLETING
    with Reason=TimeLimit; after ``scontrol requeue`` or a preemption with PreemptMode=REQUEUE, COMPLETING with
    ``Restarts`` already one above this start's ``SLURM_RESTART_COUNT``; after ``scancel``, COMPLETING with neither.
    """
    if not job.batch:
        return (
            f"SLURM cannot requeue job {job.job_id} (srun started it, not sbatch): continue with the same command plus "
            "--ckpt_path last"
        )
    fields = {} if signum == SLURM_WARNING_SIGNAL else job_fields(job)
    if signum == SLURM_WARNING_SIGNAL or fields.get("Reason") == "TimeLimit":
        why = "before its time limit" if signum == SLURM_WARNING_SIGNAL else "at its time limit"
        refused = requeue(job)
        if refused is None:
            return f"Requeued SLURM job {job.job_id} ({why}): its next start resumes from it by itself"
        return f"SLURM did not requeue job {job.job_id} ({refused}): submit the script again with --ckpt_path last"
    restarts = fields.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > job.restart_count:
        return f"SLURM requeues job {job.job_id}: its next start resumes from it by itself"
    if fields.get("JobState") in ("COMPLETING", "CANCELLED"):
        return f"SLURM job {job.job_id} was cancelled: submit the script again with --ckpt_path last to continue"
    return "Continue with the same command plus --ckpt_path last"


def take_slurm_numbers(trainer_config, job: SlurmJob, devices_given: bool) -> None:
    """In a SLURM job's tasks (``srun``, one per device), the tasks per node and the nodes are the processes per node
    and the node count: ``--trainer.devices`` left at auto or set by a config file, and ``--trainer.num_nodes`` left
    at 1, are taken from SLURM; a value on the command line that disagrees is one line naming both (Lightning's
    own check says "HINT: Set devices=..." with no word of the batch script). The batch script itself, when it
    runs cli.py without srun in a job of several tasks, is one line too: Lightning would take it for task 0 and
    wait for the others for good."""
    strategy = trainer_config.strategy
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")
    horovod = name == "horovod" or name.endswith(".HorovodStrategy")  # its own mpirun starts the ranks
    if not job.in_step:
        if job.tasks > 1 and not horovod and not configured_to_start_own_workers(strategy):
            raise UserError(
                f"SLURM job {job.job_id} has {job.tasks} tasks, but its batch script runs cli.py itself: start it "
                "with srun (srun python cli.py ...), which runs one task per device on every node, as "
                "scripts/slurm_multinode.sbatch does"
            )
        return
    if job.tasks < 2 or horovod:
        return
    if configured_to_start_own_workers(strategy):  # ddp_spawn, ddp_fork, ddp_notebook, dp
        raise UserError(
            f"--trainer.strategy={name} starts its own workers, but srun started this process as one of {job.tasks} "
            "tasks; under srun use --trainer.strategy=ddp (one task per device), or run one task per node"
        )
    per_node = job.tasks_per_node or job.tasks // max(job.nodes, 1)
    take_launcher_counts(
        trainer_config, devices_given, per_node, job.nodes,
        f"--trainer.devices={trainer_config.devices}, but SLURM starts {per_node} task(s) per node (#SBATCH "
        f"--ntasks-per-node={per_node}): one task per device, so make the two equal (or drop --trainer.devices)",
        f"--trainer.num_nodes={trainer_config.num_nodes}, but SLURM job {job.job_id} has {job.nodes} node(s) (#SBATCH "
        f"--nodes={job.nodes}): make the two equal (or drop --trainer.num_nodes)",
    )  # fmt: skip
