"""What a surviving rank tells the horovod strategy's mpirun launcher (app/strategies/launchers/mpirun.py) about its
save.

The launcher gives each rank a private folder (``TEMPLATE_MPI_LAUNCH_DIR``). A rank that survives a failure and saves
the state of the last completed step writes there ``saved-state-RANK``, naming the checkpoint; the launcher reads the
reports once no rank runs any more (:func:`saved_states`) and restarts the ranks from a save that is in place. The
report is written when the save's temporary file exists (:func:`saved_state_announcer`), so a rank killed at any
moment of its save leaves a report the launcher reads right. torchrun needs none of this: its restarts find
``last.ckpt`` in the run folder (app/checkpoints/run_folders.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from app.checkpoints.atomic import write_text
from app.checkpoints.storage import run_path

MPI_LAUNCH_DIR = "TEMPLATE_MPI_LAUNCH_DIR"  # the launcher's private folder, where survivors report their state
SAVED_STATE = "saved-state"  # a survivor's report: the file ``saved-state-RANK`` names the checkpoint it saves


def report_saved_state(rank: int, path: str, pending: Path | None = None) -> None:
    """Tell the horovod strategy's launcher (if it started this rank) that this rank survived a failure and saves the
    state of the last completed step to ``path`` (``pending``: the temporary file that becomes ``path``; without it,
    the save is over); it restarts the ranks that saved."""
    folder = os.environ.get(MPI_LAUNCH_DIR)
    if folder and Path(folder).is_dir():
        entry = {"path": path} if pending is None else {"path": path, "pending": str(pending)}
        write_text(Path(folder) / f"{SAVED_STATE}-{rank}", json.dumps(entry))


def saved_state_announcer(rank: int, path: str) -> Callable[[Path], Callable[[], None]] | None:
    """Under the horovod strategy's launcher (which started this rank): what tells it that this rank saves the state
    of the last completed step to ``path``, for :func:`app.checkpoints.io.atomic_torch_save`'s ``announce``; None
    elsewhere.

    The report is written as soon as the save's temporary file exists, and names it: from then on the temporary file
    leaves only by its rename onto ``path``, so the launcher, which reads the reports once the ranks are gone, knows
    whether each save is in place (:func:`saved_states`), whenever a rank was killed. A report written after the
    rename was missed by a kill in between: the launcher said that no rank saved the state, with ``last.ckpt`` on
    disk. A save that fails takes its report back before it removes its file."""
    folder = os.environ.get(MPI_LAUNCH_DIR)
    if not folder or not Path(folder).is_dir():
        return None

    def announce(temporary: Path) -> Callable[[], None]:
        report_saved_state(rank, path, pending=temporary)
        return lambda: (Path(folder) / f"{SAVED_STATE}-{rank}").unlink(missing_ok=True)

    return announce


def saved_states(folder: Path) -> dict[int, str]:
    """The launcher, once no rank of its mpirun runs any more: rank -> the checkpoint that rank saved, for each rank
    whose save is in place. The temporary file of a save that was cut short is removed (the checkpoint folder keeps
    nothing of it), and that save counts as not made: its rename can no longer happen."""
    saved = {}
    for report in folder.glob(f"{SAVED_STATE}-*"):
        try:
            entry = json.loads(report.read_text())
            rank, path, pending = int(report.name.rsplit("-", 1)[1]), run_path(entry["path"]), entry.get("pending")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if pending is not None:
            try:
                Path(pending).unlink()  # still there: the rename never came, and now it cannot
                continue
            except FileNotFoundError:
                pass  # renamed onto the checkpoint (a failed save takes its report back first)
            except OSError:
                continue
        if path.is_file():
            saved[rank] = str(path)
    return saved
