"""Runs under torchrun's elastic agent: the numbers it gives, and the run folder its restarts continue in.

torchrun (``torch.distributed.run``) starts ``--nproc_per_node`` workers per node and, with ``--max-restarts=R``,
restarts all of a node's workers when one fails or when the set of nodes changes, after a new rendezvous with
whoever is there (``--nnodes=MIN:MAX``). Every restart runs this program again from the start, with the world
size of the re-formed job in its environment. This module reads that environment:

- the number of processes per node and the number of nodes, which Lightning otherwise wants repeated as
  ``--trainer.devices``/``--trainer.num_nodes`` (and refuses when they differ from the launcher's: a job that
  lost a node could not go on);
- whether this start is a restart, and the run folder the first start claimed: a restart continues that run
  (its ``last.ckpt``, its ``metrics.csv``) instead of starting a new one. The folder is found by the job's
  rendezvous id, written into it as ``elastic.json`` by the first start and marked finished at the end;
  ``--rdzv-id`` tells two jobs apart (a job started with the id of an unfinished run continues it).
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from app.checkpoints.atomic import write_text
from app.errors import UserError
from app.launch.launcher import TorchrunJob, torchrun_job

MARKER = "elastic.json"
METRICS_BEFORE_RESTART = "metrics.before-restart.csv"


# Set by the horovod strategy's own mpirun launch (``--trainer.strategy.max_restarts``) in its ranks' environment.
MPI_RESTARTS_LEFT = "TEMPLATE_MPI_RESTARTS_LEFT"  # how many more times the launcher restarts the ranks
MPI_RESTART = "TEMPLATE_MPI_RESTART"  # which start this is: 0 first, 1 the first restart, ...


def restarts_possible() -> bool:
    """True when a launcher will start this program again after a failure: torchrun with ``--max-restarts``, or
    the horovod strategy's self-launch with restarts left (``--trainer.strategy.max_restarts``)."""
    job = torchrun_job()
    if job is not None:
        return job.restarts_possible
    return int(os.environ.get(MPI_RESTARTS_LEFT, "0")) > 0


def restarts_left() -> bool:
    """True when a failure of this start will be followed by another (torchrun or the horovod self-launch has a
    restart left); what a rank may promise when it stops after a failure."""
    job = torchrun_job()
    if job is not None:
        return job.restarts_left
    return int(os.environ.get(MPI_RESTARTS_LEFT, "0")) > 0


def is_restart() -> bool:
    """True in a start that a launcher made after a failure: it continues a run (torchrun restart, horovod restart)."""
    job = torchrun_job()
    if job is not None:
        return job.restart_count > 0
    return int(os.environ.get(MPI_RESTART, "0")) > 0


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
    if name in ("dp", "ddp_spawn") or name.endswith((".DataParallelStrategy", ".DDPSpawnStrategy")):
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
    devices = trainer_config.devices
    if devices in ("auto", None, -1, "-1") or not devices_given:
        trainer_config.devices = job.local_world_size
    elif _count(devices) != job.local_world_size:
        raise UserError(
            f"--trainer.devices={devices}, but torchrun started {job.local_world_size} process(es) per node "
            f"(--nproc_per_node={job.local_world_size}); drop --trainer.devices under torchrun or make the two equal"
        )
    nodes = trainer_config.num_nodes
    if nodes in (1, None) or nodes == job.nodes:
        trainer_config.num_nodes = job.nodes
    elif continuing:
        rank_zero_info(
            f"torchrun re-formed the job with {job.nodes} node(s): --trainer.num_nodes {nodes} -> {job.nodes}"
        )
        trainer_config.num_nodes = job.nodes
    else:
        raise UserError(
            f"--trainer.num_nodes={nodes}, but torchrun started {job.nodes} node(s) (--nnodes); drop "
            "--trainer.num_nodes under torchrun or make the two equal"
        )


def _count(devices) -> int:
    if isinstance(devices, list | tuple):
        return len(devices)
    text = str(devices)
    return len([d for d in text.split(",") if d.strip()]) if "," in text else int(text)


def agent_id() -> str:
    """This worker's torchrun agent: its host and process id (the agent starts the worker, and restarts it with the
    same process id; a new ``torchrun`` command is another agent)."""
    return f"{socket.gethostname()}:{os.getppid()}"


def mark_run(
    folder: Path, job: TorchrunJob, finished: bool = False, agents: list[str] = (), shape: dict | None = None
) -> None:
    """Name ``folder`` as the run of this torchrun job, for its restarts to find (``finished`` once it trained to
    the end: a later job with the same rendezvous id then starts a run of its own). ``agents`` are the agents of
    the job's ranks: a restart by one of them after the run finished has nothing left to train. ``shape`` is the
    first start's devices, per-device batch and accumulation (:class:`~app.callbacks.Elastic`), kept once given: a
    restart that finds no state to resume from still trains with the configured global batch."""
    marker = {"rdzv_id": job.run_id, "finished": finished, "agents": sorted(set(agents))}
    shape = shape or run_shape(folder)
    if shape:
        marker["shape"] = shape
    write_text(folder / MARKER, json.dumps(marker) + "\n")


def run_shape(folder: Path) -> dict | None:
    """The shape of the run in ``folder`` as its first start recorded it (:func:`mark_run`), or None."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    shape = marker.get("shape") if isinstance(marker, dict) else None
    return shape if isinstance(shape, dict) else None


def _marked_runs(root: Path, job: TorchrunJob) -> dict[int, dict]:
    """``{version: marker}`` of the run folders under ``root`` that a start of a job with this id marked."""
    found = {}
    for folder in root.glob("version_*"):
        match = re.fullmatch(r"version_(\d+)", folder.name)
        try:
            marker = json.loads((folder / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if match and isinstance(marker, dict) and marker.get("rdzv_id") == job.run_id:
            found[int(match[1])] = marker
    return found


def run_of(root: Path, job: TorchrunJob) -> int | None:
    """The version number of the newest unfinished run folder under ``root`` that a start of this job marked.

    Looked up at every start, not only when ``TORCHELASTIC_RESTART_COUNT`` > 0: torchrun does not count a restart
    for a node that joins, and those restarts must continue the run too."""
    return max((v for v, marker in _marked_runs(root, job).items() if not marker.get("finished")), default=None)


def finished_run_of(root: Path, job: TorchrunJob, agent: str) -> int | None:
    """The version number of the newest finished run under ``root`` that this very job trained (``agent`` was one
    of its agents), or None. A worker that fails after the run finished (at exit) makes torchrun restart the job;
    that restart must not train a new run."""
    finished = [v for v, m in _marked_runs(root, job).items() if m.get("finished") and agent in m.get("agents", [])]
    return max(finished, default=None)


def keep_metrics_for_restart(folder: Path) -> None:
    """Move the run's ``metrics.csv`` aside before the restarted run's CSV logger starts (it deletes the file); the
    :class:`~app.callbacks.Elastic` callback writes its rows back in front of the new ones. A ``metrics.csv`` that
    exists holds every earlier row (it is written only after they were put back), so it replaces the kept copy."""
    metrics = folder / "metrics.csv"
    if metrics.is_file():
        os.replace(metrics, folder / METRICS_BEFORE_RESTART)


def continue_run_folder(loggers: list, job: TorchrunJob) -> tuple[dict[Path, int], str | None, str | None]:
    """A restart by torchrun goes on in the run folder of the job's first start, from its last.ckpt if any.

    Returns the logger roots with the version they go on writing, the ``last.ckpt`` to resume from (None: start
    fresh) and the name this start's config file gets beside the first start's ``config.yaml``. Exits 0 with one
    line when the job's run had already finished (a worker failed after training, e.g. at exit)."""
    from app.checkpoints.run_folders import folder_logger_root
    from app.launch.launcher import is_first_process

    continued: dict[Path, int] = {}
    ckpt, config_name = None, None
    for logger in loggers:
        root = folder_logger_root(logger)
        version = None if root is None else run_of(root, job)
        if version is None and root is not None:
            done = finished_run_of(root, job, agent_id())
            if done is not None:
                rank_zero_info(
                    f"torchrun restarted the job after its run finished ({root}/version_{done}, marked finished; "
                    "a worker failed after training, e.g. at exit): nothing left to train"
                )
                raise SystemExit(0)
        if version is None or root in continued:
            continue
        continued[root] = version
        config_name = f"config.restart{job.restart_count}.yaml" if job.restart_count else "config.rejoined.yaml"
        folder = root / f"version_{version}"
        if is_first_process():
            keep_metrics_for_restart(folder)
        last = folder / "checkpoints" / "last.ckpt"
        if last.is_file() and ckpt is None:
            ckpt = str(last.resolve())
    return continued, ckpt, config_name
