"""How checkpoints reach the disk and come back: atomically, and without unpickling anything.

:class:`SafeCheckpointIO` replaces Lightning's ``TorchCheckpointIO`` in every strategy (``cli.py`` installs it):

- save: ``torch.save`` into a hidden temporary file in the same folder, ``fsync``, then ``os.replace`` onto the
  target and ``fsync`` the folder. A kill at any moment leaves either the old file or the new one, never a
  half-written ``last.ckpt``; a failed save removes its temporary file.
- load: always ``torch.load(weights_only=True)`` (plain tensors and containers; a checkpoint carrying a pickled
  object is refused, not executed), remote ``http(s)://`` paths only when allowed, and one-line errors.

Every checkpoint is checked, when it is loaded, against the CRC-32 its zip archive keeps for each record (torch
writes one per record, and reads none): the pickled structure (keys, numbers, hyperparameters) and each tensor's
bytes (:func:`check_archive`). A file damaged on a disk or in a copy loaded silently before (4 KiB of 0xff in the
middle of a last.ckpt resumed, then "diverged"); a file cut short is named as such. The check costs nothing at save
(torch computes the CRCs as it writes) and one read of the file at load.

A checkpoint the template writes carries its format number (:data:`FORMAT_KEY`); :func:`check_compatible` is the
rule a run applies before it loads one: not from a newer template, written by the model class this run builds, with
the network the task's :class:`~app.task.TaskSpec` names, and every tensor in the shape the network has.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import tempfile
import textwrap
import threading
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from app.checkpoints.atomic import write_to_url
from app.checkpoints.storage import is_local, run_path
from app.errors import UserError
from app.task import spec_of

REMOTE_PREFIXES = ("http://", "https://")


def atomic_torch_save(
    obj: Any,
    path: str | Path,
    announce: Callable[[Path], Callable[[], None]] | None = None,
    unless: Callable[[], bool] | None = None,
) -> bool:
    """``torch.save(obj, path)`` that never leaves a partial ``path`` behind; True when ``path`` was written.

    ``announce``: called with the temporary file as soon as it exists, before anything is written to it; it returns
    what takes the announcement back. Whoever reads the announcement may then tell a save in place from one cut short
    by a kill (:func:`app.checkpoints.saved_state.saved_states`): the temporary file leaves only by its rename onto
    ``path``, or, when the save fails, after the announcement was taken back.

    ``unless``: asked once the file is written, just before it replaces ``path``; when it says True, ``path`` is left
    as it is (the temporary file is removed, the announcement taken back) and the result is False."""
    path = run_path(path)
    if not is_local(path):  # no announcement: a survivor's save is read back from a local run folder only
        return write_to_url(path, lambda f: torch.save(obj, f), unless)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    take_back = None
    try:
        with os.fdopen(fd, "wb") as f:
            if announce is not None:
                take_back = announce(Path(tmp))
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if unless is not None and unless():
            if take_back is not None:
                take_back()
            Path(tmp).unlink(missing_ok=True)
            return False
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a checkpoint is as readable as any file the run writes
        os.replace(tmp, path)
    except BaseException as err:
        full = isinstance(err, OSError | RuntimeError) and _disk_full(path.parent, err)
        with contextlib.suppress(OSError):  # not taken back: the temporary file stays for the announcement's reader
            if take_back is not None:
                take_back()
            Path(tmp).unlink(missing_ok=True)
        if full:
            raise UserError(
                f"{path}: not written, {full}; the file there before (if any) is unchanged. Free space, then resume "
                "with --ckpt_path last"
            ) from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    return True


def saved_at_step(path: str | Path) -> int | None:
    """The ``global_step`` of the checkpoint at ``path`` (its tensors are mapped, not read); None when there is none
    or it cannot be read."""
    try:
        path = run_path(path)
        if not is_local(path):
            with path.open("rb") as f:
                return int(torch.load(f, map_location="cpu", weights_only=True)["global_step"])
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:  # noqa: BLE001 - a missing, partial or foreign file: nothing newer to keep
        return None


def _disk_full(folder: Path, err: BaseException) -> str:
    """Why a write failed when the disk is the reason (torch's zip writer reports a full disk as a RuntimeError)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return f"{folder}: {err.strerror}"
    try:
        stat = os.statvfs(folder)
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    return f"the disk is full ({free / 2**20:.1f} MiB free in {folder})" if free < 2**20 else ""


def safe_torch_load(path: str | Path, allow_remote: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with one-line errors naming the file."""
    if str(path).startswith(REMOTE_PREFIXES):
        if not allow_remote:
            raise UserError(
                f"{path}: remote checkpoints are not loaded by default; download it and pass the local file, "
                "or add --allow_remote_ckpt=true (it is still loaded with weights_only=True)"
            )
        return torch.hub.load_state_dict_from_url(str(path), map_location=map_location, weights_only=True)
    path = run_path(path)
    if path.is_dir() and (path / ".metadata").is_file():
        from app.checkpoints.sharded import not_loaded_here

        raise not_loaded_here(path)
    if path.is_dir():
        inside = sorted(path.rglob("*.ckpt"))
        example = inside[-1] if inside else path / "checkpoints" / "last.ckpt"
        raise UserError(f"{path}: is a folder; pass a checkpoint file such as {example}")
    if not path.is_file():
        raise UserError(
            f"{path}: no such checkpoint file; pass an existing one (a run's checkpoints are in "
            "<default_root_dir>/lightning_logs/version_N/checkpoints/), or --ckpt_path last for the newest run's"
        )
    if path.stat().st_size == 0:
        raise UserError(f"{path}: an empty file (0 bytes), not a checkpoint; pass another --ckpt_path")
    with path.open("rb") as f:
        head = f.read(2)
    if not head.startswith((b"PK", b"\x80")):  # torch.save's zip archive, or its legacy pickle stream
        raise UserError(
            f"{path}: not a checkpoint: not a file torch.save writes; pass a .ckpt file, such as "
            "lightning_logs/version_N/checkpoints/last.ckpt"
        )
    if head.startswith(b"PK"):
        check_archive(path)
    try:
        if is_local(path):
            loaded = torch.load(path, map_location=map_location, weights_only=True)
        else:
            with path.open("rb") as f:
                loaded = torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        raise UserError(
            f"{path}: refused: it holds pickled Python objects{f' ({found[1]})' if found else ''}, not only tensors "
            "and plain data, and nothing is unpickled here (torch.load weights_only=True); re-save it from a "
            "state_dict"
        ) from None
    except EOFError:  # torch.save's older format (no zip archive), cut short
        raise UserError(
            f"{path}: truncated: the file ends before the checkpoint does ({path.stat().st_size} bytes; a copy, "
            "download or write that did not finish); pass another --ckpt_path, such as an earlier epoch=N.ckpt "
            "beside it"
        ) from None
    except Exception as err:  # damaged where the archive's checksums do not reach, or not a torch file at all
        lines = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()
        reason = textwrap.shorten(lines[0], 160, placeholder=" ...") if lines else "no details"
        raise UserError(
            f"{path}: not a loadable checkpoint, damaged or not written by torch.save ({type(err).__name__}: "
            f"{reason}); pass another --ckpt_path, such as an earlier epoch=N.ckpt beside it"
        ) from None
    return loaded


def check_archive(path: Path) -> None:
    """A ``torch.save`` zip archive that is whole: its directory is there (torch.save writes it last, so a file cut
    short has none) and every record matches the CRC-32 the zip format keeps for it.

    torch checks no CRC: one flipped byte in ``data.pkl`` was refused as "pickled Python objects", failed as
    another error, or loaded with a value changed, depending on the byte; bytes damaged inside a tensor loaded
    silently; and a file cut short failed in torch with a paragraph of its own (cut mid-word here), or an
    ``OSError: Invalid argument``."""
    size = path.stat().st_size
    with path.open("rb") as file:
        try:
            archive = zipfile.ZipFile(file)
        except (zipfile.BadZipFile, OSError, EOFError):
            raise UserError(
                f"{path}: truncated or damaged: the zip archive that torch.save writes ends without its directory "
                f"({size} bytes; a copy, download or write that did not finish); pass another --ckpt_path, such as "
                "an earlier epoch=N.ckpt beside it"
            ) from None
        _check_records(archive, path)


def _check_records(archive: zipfile.ZipFile, path: Path) -> None:
    with archive:
        for record in archive.infolist():
            if record.CRC == 0 and record.file_size:  # written with torch.serialization.set_crc32_options(False)
                continue
            try:
                with archive.open(record) as data:
                    while data.read(1 << 24):  # the CRC-32 is checked at the record's end
                        pass
            except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError):
                name = record.filename.split("/", 1)[-1]
                what = f"{name} inside it (a tensor's bytes)" if _STORAGE.fullmatch(name) else f"{name} inside it"
                raise UserError(
                    f"{path}: damaged: {what} no longer matches the checksum written with it (a disk, copy or "
                    "transfer error); pass another --ckpt_path, such as an earlier epoch=N.ckpt beside it"
                ) from None


_STORAGE = re.compile(r"data/\d+")  # a tensor's bytes, in torch.save's archive


# Set by the test suite (tests/conftest.py): a checkpoint written from any thread but the main one, which runs
# training in every process of a run, fails its save. Lightning does not promise that trainer.save_checkpoint is safe
# from another thread, and the template calls it on none (the rank watchdog's verdict makes the training thread's
# collective fail instead: app/launch/connections.py). fsdp's background saves (app/checkpoints/sharded.py) write
# their copied pieces from a worker thread through DCP's own writer, not through this IO.
TRAINING_THREAD_CHECK = "TEMPLATE_SAVE_ON_TRAINING_THREAD"


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic saves and ``weights_only`` loads for Lightning's strategies."""

    def __init__(self, allow_remote: bool = False) -> None:
        self.allow_remote = allow_remote

    @override
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        storage_options: Any | None = None,
        announce: Callable[[Path], Callable[[], None]] | None = None,
        unless: Callable[[], bool] | None = None,
    ) -> bool:
        """``announce``, ``unless``: as :func:`atomic_torch_save`'s (a survivor's save after a failure)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        if os.environ.get(TRAINING_THREAD_CHECK) and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"{path}: written from thread {threading.current_thread().name!r}, not the one that runs training "
                f"({TRAINING_THREAD_CHECK} is set: the test suite checks that no other thread writes a checkpoint)"
            )
        checkpoint.setdefault(FORMAT_KEY, CHECKPOINT_FORMAT)
        return atomic_torch_save(checkpoint, path, announce=announce, unless=unless)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        location = map_location if map_location is not None else (lambda storage, loc: storage)
        return safe_torch_load(path, allow_remote=self.allow_remote, map_location=location)


# What a checkpoint of this template holds: 1 = no number (the loader's position counted per rank); 2 = the loader
# saves its global position in the epoch (app/loader.py), so a run resumes at any world size.
CHECKPOINT_FORMAT = 2
FORMAT_KEY = "template_checkpoint_format"
OLD_FORMAT_KEYS = ("fashion_mnist_template_format",)  # the same number, as checkpoints before 2026-11-25 name it


def checkpoint_format(checkpoint: dict[str, Any]) -> int:
    for key in (FORMAT_KEY, *OLD_FORMAT_KEYS):
        if key in checkpoint:
            return int(checkpoint[key])
    return 1


def load_checkpoint(ckpt_path: str | Path, allow_remote: bool = False, shapes: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint, loaded safely (``weights_only``: plain data, nothing executed). ``shapes``: for the
    run's checks, an fsdp sharded checkpoint (a folder) is read without its tensors (its weights as shapes on the
    meta device, and everything else); without it, such a folder is refused in one line."""
    from app.checkpoints.sharded import is_sharded_checkpoint, not_loaded_here, read_sharded

    if is_sharded_checkpoint(ckpt_path):
        if not shapes:
            raise not_loaded_here(ckpt_path)
        return read_sharded(ckpt_path)
    checkpoint = safe_torch_load(ckpt_path, allow_remote=allow_remote)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise UserError(f"{ckpt_path}: not a checkpoint written by `cli.py fit` (no state_dict)")
    checkpoint.setdefault("hyper_parameters", {})  # a module that never called save_hyperparameters
    return checkpoint


def saved_class(checkpoint: dict[str, Any]) -> str | None:
    """The class path of the LightningModule that wrote the checkpoint, when LightningCLI recorded it."""
    return checkpoint.get("hyper_parameters", {}).get("_class_path")


def check_compatible(checkpoint: dict[str, Any], ckpt_path: str | Path, module: torch.nn.Module) -> None:
    """Refuse, in one line, a checkpoint whose network is not the one this run builds, or that a newer version of
    this template wrote (it may hold state this one would silently drop)."""
    if checkpoint_format(checkpoint) > CHECKPOINT_FORMAT:
        raise UserError(
            f"{ckpt_path}: written by a newer version of this template (checkpoint format "
            f"{checkpoint_format(checkpoint)}, this one reads up to {CHECKPOINT_FORMAT}); update this checkout "
            "(git pull) to resume from it"
        )
    saved, hparams = checkpoint["hyper_parameters"], dict(getattr(module, "hparams", {}))
    for key in spec_of(module).network:
        if key in saved and key in hparams and saved[key] != hparams[key]:
            raise UserError(
                f"{ckpt_path} holds a network with --model.{key}={saved[key]}, but this run builds "
                f"--model.{key}={hparams[key]}; pass --model.{key}={saved[key]} or another --ckpt_path"
            )
    check_weights_fit(checkpoint["state_dict"], module.state_dict(), ckpt_path)


def check_weights_fit(weights: dict[str, Any], expected: dict[str, Any], ckpt_path: str | Path) -> None:
    """Every tensor the network has, with the shape it has, and nothing else; one line naming the first misfit."""
    for name in sorted(set(weights) | set(expected)):
        have = tuple(weights[name].shape) if name in weights else "missing"
        want = tuple(expected[name].shape) if name in expected else "not in this network"
        if have != want:
            raise UserError(
                f"{ckpt_path}: its weights do not fit this network ({name}: checkpoint {have}, network {want}); "
                "pass the --model options it was trained with, or another --ckpt_path"
            )
