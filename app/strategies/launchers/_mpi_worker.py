"""Entry point of each rank started by :class:`app.strategies.launchers.mpirun.MPIRunLauncher` (not for direct use)."""

import multiprocessing.spawn
import os
import pickle
import shutil
import sys
import traceback
from pathlib import Path

from app.checkpoints.atomic import write_text
from app.checkpoints.generators import set_generator_states
from app.errors import Diverged, Preempted, UserError
from app.launch import startup
from app.launch.early_signals import catch_early_signals
from app.launch.launcher import launcher_ranks
from app.launch.signals import process_alive, wait_for_taken_over_exit
from app.strategies import register as register_strategies
from app.strategies.launchers.mpirun import DIVERGED, PREEMPTED, USER_ERROR


def main(job_path: str, result_path: str) -> None:
    startup.install()  # as cli.py's main does: the filters, the warning format, the exit hook
    register_strategies()  # before anything is unpickled: the caller's script, imported again, may name one
    workdir = Path(job_path).parent
    rank = (launcher_ranks() or (1, 0, 0, 1))[1]
    catch_early_signals()  # a stop sent while this rank starts is acted on once the trainer runs
    failed = False
    (workdir / f"rank-{rank}.pid").write_text(str(os.getpid()))  # where the launcher sends SIGTERM/SIGINT
    try:
        with open(job_path, "rb") as f:  # written by our own launcher, mode 0700
            # The caller's main script or module, imported as __mp_main__ (as multiprocessing's spawn does), so that
            # classes defined in it unpickle.
            multiprocessing.spawn.prepare(pickle.load(f))
            launcher, trainer, function, args, kwargs, generators = pickle.load(f)
        set_generator_states(generators)  # the launching process's, seeded: dropout draws what ddp_spawn's would
        launcher.run_in_rank(trainer, function, args, kwargs, result_path)
    except UserError as err:  # bad input found in the ranks: the launcher says it once, as one line
        write_text(workdir / USER_ERROR, str(err), private=True)
    except Diverged as stop:  # every rank stops at the same step: the launcher says it once, as the last line
        if rank == 0:
            write_text(workdir / DIVERGED, stop.message, private=True)
    except Preempted as stop:  # checkpointed and said so; the launcher exits with 128 + signal, mpirun with 0
        write_text(workdir / PREEMPTED, str(stop.signum), private=True)
    except Exception:
        traceback.print_exc()  # as Python would on its way out
        failed = True
    finally:
        if rank == 0 and not process_alive(int(os.environ.get("APP_LAUNCHER_PID", "0"))):
            shutil.rmtree(workdir, ignore_errors=True)  # the launcher is gone: nobody else will clean up
    if failed:
        # A peer may be gone (a lost rank): leaving as Python does would run MPI_Finalize, which waits for it for
        # good. The rank watchdog's thread, which ends this process after a verdict, goes first.
        wait_for_taken_over_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
