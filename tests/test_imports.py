"""``import app`` and every module under it only define: no warning filter, warning format, exit hook, logging
filter, signal handler or strategy name appears in a process that imports them (issue 59). What a run needs is set up
by its entry (``cli.py``'s ``main``, ``trainer_defaults``, a rank's first hook), so a fork or a test can import any
part of the template without changing the process it runs in."""

import atexit
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from app.launch import startup
from app.strategies import register
from tests.conftest import ROOT

# Run in a fresh interpreter: the libraries the template builds on first (what their own imports change is theirs),
# then a snapshot, then every module under app/, then the snapshot again.
IMPORT_EVERYTHING = textwrap.dedent(
    """
    import atexit, json, logging, os, pkgutil, signal, sys, threading, warnings, importlib

    import jsonargparse, lightning.pytorch, torch, torchmetrics  # noqa: F401  (their own import effects)
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    def describe(value):
        return getattr(value, "pattern", repr(value))  # a compiled pattern, or None

    def snapshot():
        loggers = {"": logging.getLogger()}
        loggers.update((name, logger) for name, logger in logging.Logger.manager.loggerDict.items()
                       if isinstance(logger, logging.Logger))
        return {
            "warning filters": [[f[0], describe(f[1]), f[2].__name__, describe(f[3]), f[4]] for f in warnings.filters],
            "warning format": repr(warnings.formatwarning),
            "showwarning": repr(warnings.showwarning),
            "exit hooks": atexit._ncallbacks(),
            "strategies": {name: [f"{entry['strategy'].__module__}.{entry['strategy'].__qualname__}",
                                  entry["description"], repr(entry["init_params"])]
                           for name, entry in StrategyRegistry.items()},
            "names kept from CPUs": list(FSDPStrategy.get_registered_strategies()),
            "logging": {name: [repr(x) for x in (*logger.filters, *logger.handlers)] + [logger.level]
                        for name, logger in loggers.items() if logger.filters or logger.handlers or name == ""},
            "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                        if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
            "excepthook": repr(sys.excepthook),
            "threads": len(threading.enumerate()),
            "environment": dict(os.environ),
        }

    before = snapshot()
    import app
    imported = ["app"]
    for module in pkgutil.walk_packages(app.__path__, "app."):
        importlib.import_module(module.name)
        imported.append(module.name)
    after = snapshot()
    changed = {key: {"before": before[key], "after": after[key]} for key in before if before[key] != after[key]}
    print(json.dumps({"imported": imported, "changed": changed}))
    """
)


@pytest.mark.slow
def test_importing_every_module_of_app_changes_nothing_in_the_process():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert {"app.run.cli", "app.strategies", "app.launch.startup", "app.strategies.launchers._mpi_worker"} <= set(
        report["imported"]
    ), report["imported"]
    assert report["changed"] == {}, json.dumps(report["changed"], indent=1)[-4000:]
    assert result.stderr == "", result.stderr[-3000:]  # nor does an import print anything


def test_install_and_register_act_once_however_often_called():
    """The entries call them without asking who did already (cli.py's main, trainer_defaults, DDPStrategy's
    setup_environment in the same process, this suite's conftest): a second call adds no exit hook, no second
    format wrapper and no registry change. (The filters are compared by what they are: pytest resets them around
    each test.)"""

    def state():
        strategies = {name: (entry["strategy"], entry["description"]) for name, entry in StrategyRegistry.items()}
        return atexit._ncallbacks(), warnings.formatwarning, strategies

    startup.install()  # conftest's were the first calls
    register()
    before = state()
    for _ in range(3):
        startup.install()
        register()
    assert state() == before
