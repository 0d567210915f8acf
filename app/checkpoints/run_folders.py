"""Each run's own ``version_N`` folder: claimed with one ``mkdir`` before anything is written into it, and removed
again when the run fails before it has trained, tested or saved anything.

Lightning's loggers each pick "the next free version_N" by listing the folder, so two runs started at once in one
root both take the same N and write into each other's files. Here the process that will be global rank 0 creates
``version_N`` itself (``mkdir`` fails for the loser of a race, which then tries N+1) and hands N to every logger
that writes under that root, through the loggers' ``version`` argument. Processes that a launcher starts later
(Lightning's ddp re-runs this script per rank) read N from the environment.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoints.atomic import write_text
from app.checkpoints.storage import is_local, move_onto, remove_tree, run_path
from app.errors import UserError
from app.launch.launcher import SlurmJob, TorchrunJob, is_first_process
from app.launch.restarts import agent_of

VERSION_ENV = "TEMPLATE_RUN_VERSION"  # the claimed N, for the ranks a launcher starts after the claim
# Columns of metrics.csv that say nothing of the training itself: a run that logged only these (the learning-rate
# monitor logs at the first batch, before anything is trained) has nothing to keep. Any other value is kept,
# whatever the task names its metrics.
BOOKKEEPING = ("epoch", "step")
BOOKKEEPING_PREFIXES = ("lr-",)


def folder_logger_root(logger) -> Path | None:
    """``save_dir/name`` of a CSV or TensorBoard logger config whose version is left to pick, or names the folder
    of an earlier run (a run's config.yaml records its version), else None."""
    class_path = getattr(logger, "class_path", None)
    init_args = getattr(logger, "init_args", None)
    if not class_path or init_args is None:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, CSVLogger | TensorBoardLogger)):
        return None
    folder = init_args.get("name", "lightning_logs")
    root = run_path(init_args.get("save_dir") or ".") / (folder or "")
    version = init_args.get("version")
    if version is not None and not earlier_run(root, version):
        return None  # a new folder of the user's naming
    return root


def earlier_run(root: Path, version) -> Path | None:
    """The folder a logger's ``version`` names, if it holds anything (Lightning would delete its logs)."""
    folder = root / (version if isinstance(version, str) else f"version_{version}")
    return folder if folder.is_dir() and any(folder.iterdir()) else None


def claim_versions(loggers: list, continued: dict[Path, int] | None = None) -> list[Path]:
    """Give each folder-writing logger config (version unset) a claimed ``version_N``; returns the claimed folders.

    ``continued`` maps a logger root to the version an elastic restart goes on writing (no claim, no notice)."""
    continued = continued or {}
    claimed: dict[Path, int] = {}
    told: set[Path] = set()
    first = is_first_process()
    for logger in loggers:
        root = folder_logger_root(logger)
        if root is None:
            continue
        if root in continued:
            logger.init_args.version = continued[root]
            continue
        if root not in claimed:
            if first:
                claimed[root] = claim(root)
                os.environ[VERSION_ENV] = str(claimed[root])
            elif os.environ.get(VERSION_ENV, "").isdigit():
                claimed[root] = int(os.environ[VERSION_ENV])
            else:
                continue  # a rank started by an outside launcher: it never writes the run folder
        pinned = logger.init_args.get("version")
        if first and pinned is not None and pinned != claimed[root] and root not in told:
            told.add(root)
            rank_zero_info(
                f"{earlier_run(root, pinned)} holds an earlier run (its config.yaml names it): this run logs to "
                f"{root / f'version_{claimed[root]}'} instead"
            )
        logger.init_args.version = claimed[root]
    return [root / f"version_{n}" for root, n in claimed.items()] if first else []


def claim(root: Path) -> int:
    """Create ``root/version_N`` for the lowest N above every existing one; ``mkdir`` decides a race."""
    hint = "pass a writable --trainer.default_root_dir"
    if root.exists() and not root.is_dir():
        raise UserError(f"{root}: is a file, where the runs' folder belongs; move it away or {hint}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        taken = [int(m[1]) for p in root.iterdir() if (m := re.fullmatch(r"version_(\d+)", p.name))]
        n = max(taken, default=-1) + 1
        while True:
            try:
                (root / f"version_{n}").mkdir()
                return n
            except OSError:
                if not (root / f"version_{n}").exists():  # an sftp server's mkdir fails without saying why
                    raise
                n += 1  # another run took it a moment ago
    except OSError as err:
        raise UserError(f"{root}: cannot create the run folder ({err.strerror or err}); {hint}") from None


_made: list[Path] = []  # the top folder check_writable made for this run: gone again if the run writes nothing


def check_writable(folder: Path) -> None:
    """The run's output folder exists (made if needed) and takes a file, or one line naming it."""
    folder = run_path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--trainer.default_root_dir={folder}: is a file; pass a folder")
        missing = [path for path in (folder, *folder.parents) if not path.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        _made[:] = missing[-1:]  # this run's only
        if is_local(folder):
            with tempfile.TemporaryFile(dir=folder):
                pass
        else:
            probe = folder / f".probe.{os.getpid()}.{os.urandom(4).hex()}"
            probe.write_bytes(b"")
            probe.unlink()
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - an OSError here; on a URL whatever its filesystem raises (paramiko's)
        if is_local(folder) and not isinstance(err, OSError):
            raise
        reason = getattr(err, "strerror", None) or f"{type(err).__name__}: {err}"
        raise UserError(
            f"--trainer.default_root_dir={folder}: cannot write there ({reason}); pass a writable folder"
        ) from None


def release_made_folders() -> None:
    """Remove the folders :func:`check_writable` made, when the run failed before writing a file into them (a bad
    --data or --model value is found after the root folder was checked)."""
    while _made:
        top = _made.pop()
        if top.is_dir() and not any(path.is_file() or path.is_symlink() for path in top.rglob("*")):
            remove_tree(top)


def release_if_unused(folders: list[Path]) -> None:
    """Remove claimed run folders that hold no checkpoint, no predictions and nothing logged but bookkeeping at
    step 0; a folder with any metric of the task's, whatever its name, or any row past step 0 is kept."""
    for folder in folders:
        if folder.is_dir() and not _worth_keeping(folder):
            remove_tree(folder)
            if folder.parent.is_dir() and not any(folder.parent.iterdir()):
                remove_tree(folder.parent)


def _worth_keeping(folder: Path) -> bool:
    if any(folder.rglob("*.ckpt")) or (folder / "predictions.csv").exists():
        return True
    metrics = folder / "metrics.csv"
    if not metrics.is_file():
        return False
    with metrics.open(newline="") as f:
        rows = csv.DictReader(f)
        kept = [c for c in rows.fieldnames or [] if c not in BOOKKEEPING and not c.startswith(BOOKKEEPING_PREFIXES)]
        for row in rows:
            if any(row.get(c) not in (None, "") for c in kept) or (row.get("step") or "0").strip() not in ("0", ""):
                return True  # a value of the task's own, or a row logged after the first step
        return False


# ---------------------------------------------------------------- the run a job's later starts continue
# torchrun restarts every worker from the start of the program, and SLURM runs a requeued job's batch script again:
# a later start must find the run folder its job's first start claimed (by the job's id, torchrun's rendezvous id or
# SLURM's job id, written into it as ``elastic.json``; marked finished at the end, so two jobs are told apart, and a
# job started with the id of an unfinished run continues it).
MARKER = "elastic.json"
METRICS_BEFORE_RESTART = "metrics.before-restart.csv"
Job = TorchrunJob | SlurmJob


def mark_run(folder: Path, job: Job, finished: bool = False, agents: list[str] = (), shape: dict | None = None) -> None:
    """Name ``folder`` as the run of this torchrun or SLURM job, for its later starts to find (``finished`` once it
    trained to the end: a later job with the same id then starts a run of its own). ``agents`` are the agents of
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


def _marked_runs(root: Path, job: Job) -> dict[int, dict]:
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


def run_of(root: Path, job: Job) -> int | None:
    """The version number of the newest unfinished run folder under ``root`` that a start of this job marked.

    Looked up at every start, not only when ``TORCHELASTIC_RESTART_COUNT`` > 0: torchrun does not count a restart
    for a node that joins, and those restarts must continue the run too."""
    return max((v for v, marker in _marked_runs(root, job).items() if not marker.get("finished")), default=None)


def finished_run_of(root: Path, job: Job, agent: str) -> int | None:
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
        move_onto(metrics, folder / METRICS_BEFORE_RESTART)


def continue_run_folder(loggers: list, job: Job) -> tuple[dict[Path, int], str | None, str | None]:
    """A restart by torchrun, or a start of a requeued SLURM job, goes on in the run folder of the job's first
    start, from its last.ckpt if any.

    Returns the logger roots with the version they go on writing, the ``last.ckpt`` to resume from (None: start
    fresh) and the name this start's config file gets beside the first start's ``config.yaml``. Exits 0 with one
    line when the job's run had already finished (a worker failed after training, e.g. at exit)."""
    continued: dict[Path, int] = {}
    ckpt, config_name = None, None
    for logger in loggers:
        root = folder_logger_root(logger)
        version = None if root is None else run_of(root, job)
        if version is None and root is not None:
            done = finished_run_of(root, job, agent_of(job))
            if done is not None:
                who = (
                    "torchrun restarted the job" if isinstance(job, TorchrunJob) else f"SLURM requeued job {job.job_id}"
                )
                rank_zero_info(
                    f"{who} after its run finished ({root}/version_{done}, marked finished; a worker failed after "
                    "training, e.g. at exit): nothing left to train"
                )
                raise SystemExit(0)
        if version is None or root in continued:
            continue
        continued[root] = version
        config_name = f"config.{job.start_name}.yaml"
        folder = root / f"version_{version}"
        if is_first_process():
            keep_metrics_for_restart(folder)
        last = folder / "checkpoints" / "last.ckpt"
        if last.exists() and ckpt is None:  # a file, or fsdp's sharded folder
            ckpt = str(last.resolve() if is_local(last) else last)
    return continued, ckpt, config_name
