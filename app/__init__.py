"""ResNet / Fashion-MNIST training template on PyTorch Lightning, with dp, ddp, ddp_spawn and horovod strategies."""

__version__ = "0.1.0"


def _check_torchvision() -> None:
    """torch and torchvision of two builds (pip took them from two indexes: a CPU torch beside PyPI's CUDA
    torchvision) fail on the first import of torchvision, which Lightning's metrics make, with a traceback of 40 lines
    ending ``operator torchvision::nms does not exist``: said in one line instead."""
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


import app.errors  # noqa: E402
import app.launch.library_noise  # noqa: E402

app.launch.library_noise.install()
app.errors.install_warning_format()  # the template's warnings read "warning: ...", like its "error: ..." lines
_check_torchvision()

import app.launch.process_group  # noqa: E402

app.launch.process_group.install()  # no rank ends in SIGABRT at exit (see the module)

import app.strategies  # noqa: E402, F401  (registers "dp" and "horovod" in Lightning's StrategyRegistry)
