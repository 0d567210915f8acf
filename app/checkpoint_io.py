"""How checkpoints reach the disk and come back: atomically, and without unpickling anything.

:class:`SafeCheckpointIO` replaces Lightning's ``TorchCheckpointIO`` in every strategy (``cli.py`` installs it):

- save: ``torch.save`` into a hidden temporary file in the same folder, ``fsync``, then ``os.replace`` onto the
  target and ``fsync`` the folder. A kill at any moment leaves either the old file or the new one, never a
  half-written ``last.ckpt``; a failed save removes its temporary file.
- load: always ``torch.load(weights_only=True)`` (plain tensors and containers; a checkpoint carrying a pickled
  object is refused, not executed), remote ``http(s)://`` paths only when allowed, and one-line errors.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from app.errors import UserError

REMOTE_PREFIXES = ("http://", "https://")


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` that never leaves a partial ``path`` behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a checkpoint is as readable as any file the run writes
        os.replace(tmp, path)
    except BaseException as err:
        full = isinstance(err, OSError | RuntimeError) and _disk_full(path.parent, err)
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
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.rglob("*.ckpt"))
        example = inside[-1] if inside else path / "checkpoints" / "last.ckpt"
        raise UserError(f"{path}: is a folder; pass a checkpoint file such as {example}")
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file; pass --ckpt_path lightning_logs/version_N/checkpoints/...")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: an empty file (0 bytes), not a checkpoint; pass another --ckpt_path")
    with path.open("rb") as f:
        head = f.read(2)
    if not head.startswith((b"PK", b"\x80")):  # torch.save's zip archive, or its legacy pickle stream
        raise UserError(
            f"{path}: not a checkpoint: not a file torch.save writes; pass a .ckpt file, such as "
            "lightning_logs/version_N/checkpoints/last.ckpt"
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"{path}: refused: it holds pickled Python objects, not only tensors and plain data, and nothing is "
            "unpickled here (torch.load weights_only=True); re-save it from a state_dict"
        ) from None
    except Exception as err:  # truncated, or not a torch file at all
        lines = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()
        reason = lines[0][:100] if lines else "no details"
        raise UserError(
            f"{path}: not a loadable checkpoint, truncated or corrupt ({type(err).__name__}: {reason})"
        ) from None


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic saves and ``weights_only`` loads for Lightning's strategies."""

    def __init__(self, allow_remote: bool = False) -> None:
        self.allow_remote = allow_remote

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        location = map_location if map_location is not None else (lambda storage, loc: storage)
        return safe_torch_load(path, allow_remote=self.allow_remote, map_location=location)
