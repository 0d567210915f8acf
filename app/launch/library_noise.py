"""Library messages that say nothing to a user of this template, silenced one by one.

Each filter matches one message from one module, and says why it is silenced; every other warning, the user's
own included, still shows. torch's C++ warnings cannot be matched by their text: the one kind silenced here
(:func:`store_warnings_off`) is held back only around the calls that cause it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

from app.launch.launcher import slurm_job


class _DropMessage(logging.Filter):
    def __init__(self, startswith: str) -> None:
        super().__init__()
        self.startswith = startswith

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.startswith)

    def __eq__(self, other: object) -> bool:  # install() twice adds each filter once (Logger.addFilter checks `in`)
        return isinstance(other, _DropMessage) and other.startswith == self.startswith

    def __hash__(self) -> int:
        return hash(self.startswith)


def install() -> None:
    """Install the filters (again: each is added once)."""
    # Lightning 2.6's own pytree helper calls a torch API that torch deprecated; nothing a user can change.
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)", module=r"lightning\.pytorch\.utilities\._pytree"
    )
    # Short runs (tests, smoke runs) have fewer batches than log_every_n_steps; the template logs every epoch's
    # metrics whatever the interval, so nothing is missing from metrics.csv.
    warnings.filterwarnings(
        "ignore", message=r"The number of training batches .* is smaller than the logging interval",
        module=r"lightning\.pytorch\.loops\.fit_loop",
    )  # fmt: skip
    # A resumed run logs to a new version folder by design, so the checkpoint folder always "changes"; the resumed
    # run keeps its own best checkpoints from then on.
    warnings.filterwarnings(
        "ignore", message=r"The dirpath has changed from", module=r"lightning\.pytorch\.callbacks\.model_checkpoint"
    )
    # Every run gets a version folder of its own (app/checkpoints/run_folders.py); the one folder a logger finds
    # non-empty is that of an elastic restart continuing its run, whose metrics.csv was moved aside first and is written
    # back in full.
    warnings.filterwarnings(
        "ignore", message=r"Experiment logs directory .* exists and is not empty",
        module=r"lightning\.fabric\.loggers\.csv_logs",
    )  # fmt: skip
    # Under 16-mixed/bf16-mixed the parameters are stored in float32, which is what the summary then assumes: the
    # size it prints is right, the warning (every bf16-mixed run) is not.
    warnings.filterwarnings("ignore", message=r"Precision (16|bf16)-mixed is not supported by the model summary")
    # ddp's gradient_as_bucket_view (app/strategies/ddp.py) under channels_last: the stem's weight, [C, 1, 3, 3],
    # has a dimension of size 1, whose stride DDP's bucket view and autograd choose differently. Both layouts are the
    # same memory order; torch says so on CUDA ("not an error"). Only that shape (one input channel) is silenced.
    warnings.filterwarnings(
        "ignore", message=r"(?s)Grad strides do not match bucket view strides.*grad\.sizes\(\) = \[\d+, 1, "
    )
    # Lightning warns on every Trainer that "The `srun` command is available on your system but is not used" where
    # SLURM's client tools are installed: on a SLURM login node, where users type their commands, that is every run.
    # Outside a SLURM job a run is one of this machine's, which is what was asked for. Inside one it stays: there it
    # may be a batch script that runs cli.py without srun (app/run/checks.py says what to do in one line).
    if slurm_job() is None:
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    # An advertisement for a cloud service, printed by every Trainer.
    rank_zero.addFilter(_DropMessage("💡 Tip: For seamless cloud"))
    # The template's default RichModelSummary is there on purpose; Lightning notes that it adds no second one.
    rank_zero.addFilter(_DropMessage("Trainer already configured with model summary callbacks"))
    # torch.compile on a CPU (inductor) looks for a CUDA toolkit and warns where one is installed but no GPU is: it
    # compiles C++ for the CPU, and the line tells a CPU user nothing they can act on.
    logging.getLogger("torch.utils.cpp_extension").addFilter(_DropMessage("No CUDA runtime is found"))


_c10_lock = threading.Lock()
_c10_held: Counter[int] = Counter()  # callers inside store_warnings_off, by the threshold each holds
_c10_level_before = 0


@functools.cache
def _c10_log_level() -> ctypes.c_int | None:
    """c10's C++ log threshold (``FLAGS_caffe2_log_level``: 0 info, 1 warning, 2 error), or None where not found."""
    import torch

    name = {"darwin": "libc10.dylib", "win32": "c10.dll"}.get(sys.platform, "libc10.so")
    try:  # the library torch has loaded already: the same handle, the same variable
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / name))
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def store_warnings_off(errors_too: bool = False):
    """Inside: torch's C++ warnings are not printed (c10's log threshold is ERROR; FATAL with ``errors_too``).

    A call to a ``TCPStore`` whose host process is gone (rank 0 killed, its machine lost) prints a C++ warning of 16
    lines, ``TCPStore.cpp:125] [c10d] recvValue failed ... Connection was likely closed`` and the native frames
    under it, before it raises. The rank watchdog's heartbeat (app/callbacks/rank_watchdog.py) calls the store every
    second and reads exactly that failure as "rank 0 is lost", which it says in one line of its own. A C++ log line
    cannot be filtered by its text, only by its level, which is global: it is raised only for these calls (well under
    a millisecond each, once a second; a store that hangs holds it until the watchdog's verdict), so a C++ warning
    another thread prints in those moments is lost too; every error still shows, except with ``errors_too``: a try
    to reach a store that may not be open yet (app/launch/formation.py), whose failure torch logs as an error ("The
    client socket has timed out ... while trying to connect") and raises, and which is tried again."""
    global _c10_level_before
    level = _c10_log_level()
    if level is None:
        yield
        return
    threshold = 3 if errors_too else 2
    with _c10_lock:
        if not any(_c10_held.values()):
            _c10_level_before = level.value
        _c10_held[threshold] += 1
        level.value = max([_c10_level_before, *(t for t, count in _c10_held.items() if count)])
    try:
        yield
    finally:
        with _c10_lock:
            _c10_held[threshold] -= 1
            held = [t for t, count in _c10_held.items() if count]
            level.value = max([_c10_level_before, *held])


class HeldRecords(logging.Filter):
    """Holds a logger's records back until :meth:`release`; :meth:`drop` discards them.

    Lightning seeds (and logs "Seed set to 42") before it builds the model and the data module, which check their
    arguments: an error there would follow the seed line. The line waits until the classes are built."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger, self.records = logging.getLogger(name), []
        self.logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def drop(self) -> None:
        self.logger.removeFilter(self)
        self.records.clear()

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()
