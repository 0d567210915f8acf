"""What a process of the template sets up before it trains, called by whoever starts one; importing ``app`` sets up
nothing, so a fork or a test can import any part of it without changing the process it runs in.

:func:`install` is called by ``cli.py``'s ``main``, by :func:`app.run.defaults.trainer_defaults` (the Python API), by
each rank of the horovod strategy's mpirun self-launch before it unpickles anything, and by the template's
``DDPStrategy`` when a rank starts (``ddp_spawn``'s ranks never run ``main``). The strategies' names are registered
apart, by :func:`app.strategies.register`. :func:`check_torchvision` runs before anything imports Lightning.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Install the template's warning filters and ``warning: ...`` format, and destroy the process group at exit;
    once per process, however often called (a second exit hook or format wrapper would stack)."""
    global _installed
    with _lock:
        if _installed:
            return
        from app.errors import install_warning_format
        from app.launch import formation, library_noise, process_group

        library_noise.install()
        install_warning_format()  # the template's warnings read "warning: ...", like its "error: ..." lines
        process_group.install()  # no rank ends in SIGABRT at exit (see the module)
        formation.announce_uncaught_exceptions()  # a rank that fails before its group forms stops the others
        _installed = True


def catch_slurms_warning() -> None:
    """In a SLURM job, the warning SLURM sends before the time limit (``#SBATCH --signal=USR1@N``) may come while the
    program still imports; its default action ends the process, and the job ends unsaved and is not requeued (seen
    in tests/test_slurm_training.py under load). From the first lines of ``cli.py`` it is remembered instead, and
    :class:`~app.callbacks.Preemption` acts on it once training runs: the run stops after its first step, saves and
    requeues the job."""
    from app.launch.early_signals import catch_early_signals
    from app.launch.launcher import SLURM_WARNING_SIGNAL, slurm_job

    if slurm_job() is not None:
        catch_early_signals((SLURM_WARNING_SIGNAL,))


def check_torchvision() -> None:
    """torch and torchvision of two builds (pip took them from two indexes: a CPU torch beside PyPI's CUDA
    torchvision) fail on the first import of torchvision, which Lightning's metrics make, with a traceback of 40 lines
    ending ``operator torchvision::nms does not exist``: said in one line instead. Imports Lightning, so it comes
    first."""
    try:
        import lightning.pytorch  # noqa: F401  (torchmetrics imports torchvision where it is installed)
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        import sys
        from importlib.metadata import version

        import torch

        print(
            f"error: torchvision {version('torchvision')} is not a build for torch {torch.__version__} ({err}); "
            "install both from one index: pip install --force-reinstall torch torchvision (with the same "
            "--index-url for both, e.g. https://download.pytorch.org/whl/cpu)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
