"""Files written whole or not at all: whoever reads one (a user, another rank, the launcher) finds the old file or
the new one, never a part of one, whatever kills the writer.

Each writer writes a temporary file beside the target (hidden, a name of its own, so ranks writing the same target
never share one) and renames it onto the target once it is complete and on disk; an error on the way removes the
temporary file and leaves the target as it was. Checkpoints add a disk-full message and a survivor's announcement
of its save: :func:`app.checkpoints.io.atomic_torch_save`.

A target on a URL (:mod:`app.checkpoints.storage`) is written the same way: the file is made here, then uploaded
beside the target under a temporary name and moved onto it (:func:`~app.checkpoints.storage.move_onto` says how
atomic each kind of storage makes that move).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from app.checkpoints.storage import is_local, move_onto, run_path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None, private: bool = False) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that takes a path (matplotlib's ``savefig``,
    ``torch.export.save``), renamed onto ``path`` when the block ends without an error, removed when it raises.

    ``suffix``: the temporary file's (default ``path``'s: some writers pick the format by it). ``private``: keep
    the temporary file's 0600 permissions (a file only this user may read); default: those a plain ``open`` gives.
    """
    path = run_path(path)
    if not is_local(path):
        with tempfile.TemporaryDirectory() as local:
            yield Path(local) / path.name
            upload(Path(local) / path.name, path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix if suffix is None else suffix
    )
    os.close(fd)
    try:
        yield Path(tmp)
        if not private:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def upload(local: Path, target: Path) -> None:
    """Copy a finished local file onto ``target`` on a URL (:func:`write_to_url`)."""
    with open(local, "rb") as source:
        write_to_url(target, lambda f: shutil.copyfileobj(source, f))


def write_to_url(target: Path, write: Callable[[IO], None], unless: Callable[[], bool] | None = None) -> bool:
    """``write(file)`` into a hidden temporary file beside ``target`` on a URL, then moved onto it
    (:func:`~app.checkpoints.storage.move_onto`); True when ``target`` was written. ``unless``: as
    :func:`app.checkpoints.io.atomic_torch_save`'s."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        with partial.open("wb") as f:
            write(f)
        if unless is not None and unless():
            partial.unlink()
            return False
        move_onto(partial, target)
    except BaseException:
        with contextlib.suppress(Exception):  # (a dropped connection: the write's own error is the one to see)
            if partial.exists():
                partial.unlink()
        raise
    return True


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", private: bool = False, **open_kwargs: Any) -> Iterator[IO]:
    """``open(path, mode)`` (``"w"`` or ``"wb"``; ``open_kwargs`` such as ``newline=""``) whose file replaces ``path``
    only once the block has ended without an error and the bytes are on disk (``fsync``)."""
    with atomic_path(path, suffix=".tmp", private=private) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str, private: bool = False) -> None:
    """``Path(path).write_text(text)``, atomically (:func:`atomic_write`)."""
    with atomic_write(path, "w", private=private) as f:
        f.write(text)


def write_bytes(path: str | os.PathLike, data: bytes, private: bool = False) -> None:
    """``Path(path).write_bytes(data)``, atomically (:func:`atomic_write`)."""
    with atomic_write(path, "wb", private=private) as f:
        f.write(data)
